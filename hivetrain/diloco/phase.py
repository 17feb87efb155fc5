"""One inner phase of a volunteer: inner steps paced by its duty cycle and ended by the swarm's schedule.

``PhaseRunner.run`` runs AdamW inner steps (``inner.InnerOptimizer``) from whatever θ the model holds, sleeps between
them as ``duty.DutyCycle`` asks (or blocks while the volunteer paused), and ends the phase when
``schedule.decide_phase_end`` says so (asked before the first step too: a phase may have no step). It keeps our
progress (``progress``, ``throughput``) for the record the heartbeat publishes, and the schedule's estimate of the
seconds left (``eta_s``) for the heartbeat's period.

Units: samples, seconds. ``compute_s`` counts the inner steps only (sleeps and pauses excluded); ``wall_s`` the whole
phase.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from hivemind.utils import get_dht_time

from hivetrain.diloco.duty import DutyCycle
from hivetrain.diloco.inner import InnerOptimizer, InnerPhaseResult
from hivetrain.diloco.schedule import PhasePlan, decide_phase_end
from hivetrain.peers.records import PeerRecord

MAX_PHASE_STEPS = 10_000_000  # the schedule ends a phase; this only bounds the loop
MIN_MEASURED_STEPS = 3  # below this many steps into a phase, our throughput is the last phase's


class PhaseInterrupted(Exception):
    """The trainer is stopping: the phase ended early and its samples are not to be sent."""


@dataclass(frozen=True)
class PhaseResult:
    """A finished inner phase: the optimizer's result, with the seconds spent computing and in all, and why it ended
    (the schedule's last reason, for people: logs and events)."""

    inner: InnerPhaseResult
    compute_s: float
    wall_s: float
    ended: str = ""


class PhaseRunner:
    """Runs a peer's inner phases (see the module docstring). One phase at a time; the progress properties may be
    read from any thread.

    Args:
        inner: the inner optimizer (AdamW over the model).
        batches: yields (B, T+1) int64 token windows.
        plan: the schedule settings.
        duty: paces the steps (fraction 1 and no pause = no sleep).
        peer_id: ours (the schedule ignores our own record: our progress is exact).
        samples_per_step: samples one inner step adds to our progress; None = ``plan.batch_size``. A multi-rank
            node (``node_ranks``) counts all of its ranks' samples here while its swarm plan keeps the run's batch
            size, so that every peer computes the same epoch target.
    """

    def __init__(
        self,
        inner: InnerOptimizer,
        batches: Iterator[torch.Tensor],
        plan: PhasePlan,
        duty: DutyCycle,
        peer_id: str,
        samples_per_step: int | None = None,
    ):
        self.inner, self.batches, self.plan, self.duty, self.peer_id = inner, batches, plan, duty, peer_id
        self.samples_per_step = samples_per_step or plan.batch_size
        self._progress = (0, 0, 0.0)  # (phase epoch, samples so far, monotonic start)
        self._done = (0, 0)  # (epoch of our last ended phase, its samples)
        self._running = False
        self._waiting = False  # between ``wait_for`` and the next ``begin``
        self.last_rate = 0.0  # samples per wall second of our last phase (sleeps included)
        self.eta_s = float("inf")  # the schedule's estimate of the seconds left in the swarm's phase

    @property
    def progress(self) -> tuple[int, int]:
        """(epoch our current or last phase is for, samples computed in it)."""
        return self._progress[0], self._progress[1]

    @property
    def done(self) -> tuple[int, int]:
        """(epoch of our last ended phase, its samples); (0, 0) before the first phase ends."""
        return self._done

    @property
    def throughput(self) -> float:
        """Our effective samples per wall second, as published: 0 while paused, the last phase's rate between
        phases and until a few steps of the current one are measured."""
        if self.duty.paused or self._waiting:
            return 0.0
        _, samples, started = self._progress
        if not self._running or samples < MIN_MEASURED_STEPS * self.samples_per_step:
            return self.last_rate
        return samples / max(time.monotonic() - started, 1e-9)

    def refresh_hint_s(self) -> float:
        """How soon the swarm view should be read again, seconds: often at the start of a phase (0.5, 1, 2, 4 s in:
        peers that began their phase a moment after us must be counted before we plan ours), then half the
        schedule's estimate of the time left."""
        elapsed_s = time.monotonic() - self._progress[2]
        return min(self.eta_s / 2, max(0.5, elapsed_s))

    def begin(self, phase_epoch: int) -> None:
        """Mark the start of a phase for ``phase_epoch`` (so the record published next shows it)."""
        self._progress = (phase_epoch, 0, time.monotonic())
        if self._done[0] == phase_epoch:  # another phase for the same round (after a failed one): it runs anew
            self._done = (0, 0)
        self._running = True
        self._waiting = False

    def wait_for(self, phase_epoch: int) -> None:
        """Mark that our next phase will be for ``phase_epoch`` and that we compute nothing until it begins (the round
        before it is under way without us: ``schedule.round_under_way``). The records published meanwhile show that
        phase with 0 samples and a throughput of 0, so peers neither count us as computing for the round under way
        nor extrapolate samples we do not compute."""
        self._progress = (phase_epoch, 0, time.monotonic())
        self._running = False
        self._waiting = True

    def run(
        self,
        records: Callable[[], list[PeerRecord]],
        stop: threading.Event,
        on_step: Callable[[int, float], None],
        coverage: Callable[[], float] | None = None,
    ) -> PhaseResult:
        """Run the phase begun by ``begin``: inner steps until the schedule ends it. The schedule is asked before the
        first step too, so a phase may end with none (0 samples, ``mean_loss`` 0: the others' phase ends before our
        step would; we join their round with weight 0).

        Args:
            records: the swarm's latest records (no I/O expected: the swarm view's cache).
            stop: set when the trainer stops.
            on_step: callback(step_index, loss) after each step (events, liveness checks; may raise to abort).
            coverage: the fraction of the swarm ``records`` holds (``SwarmView.coverage``); None = all of it.

        Raises:
            PhaseInterrupted: ``stop`` was set.
            FloatingPointError: the loss became NaN/Inf (the caller discards the phase).
        """
        phase_epoch, _, started = self._progress
        last = started
        slept = 0.0
        ended = ""

        def step_done(i: int, loss: float) -> None:
            nonlocal last, slept
            if stop.is_set():
                raise PhaseInterrupted()
            now = time.monotonic()
            step_s, last = now - last, now
            self._progress = (phase_epoch, self._progress[1] + self.samples_per_step, started)
            on_step(i, loss)
            slept += self.duty.after_step(step_s, stop)  # sleeps (duty cycle) or blocks (paused)
            last = time.monotonic()
            if stop.is_set():
                raise PhaseInterrupted()

        def should_end(num_steps: int, num_samples: int) -> bool:
            # before the first step, our pace is the last phase's (a step's length is what the schedule weighs)
            rate = num_samples / max(time.monotonic() - started, 1e-9) if num_samples else self.last_rate
            decision = decide_phase_end(
                self.plan,
                self.peer_id,
                phase_epoch,
                num_samples,
                rate,
                records(),
                get_dht_time(),
                coverage() if coverage is not None else 1.0,
            )
            self.eta_s = decision.eta_s if decision.action == "continue" else float("inf")
            nonlocal ended
            ended = decision.reason
            return decision.action == "end"

        first_step = phase_epoch * self.plan.inner_steps  # the cosine schedule follows the swarm's epochs
        try:
            if should_end(0, 0):  # the others end before our first step would: join their round with weight 0
                result = InnerPhaseResult(num_steps=0, num_samples=0, num_tokens=0, mean_loss=0.0, duration_s=0.0)
            else:
                result = self.inner.run(self.batches, first_step, MAX_PHASE_STEPS, step_done, should_end)
        finally:
            self._running = False
        wall_s = time.monotonic() - started
        if result.num_samples:  # a phase of no step leaves our pace as it was (0 would make the next one step blind)
            self.last_rate = result.num_samples / max(wall_s, 1e-9)
        self._done = (phase_epoch, result.num_samples)
        self.eta_s = float("inf")
        return PhaseResult(result, max(0.0, result.duration_s - slept), wall_s, ended)
