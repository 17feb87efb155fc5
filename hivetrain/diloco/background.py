"""The round that runs in the background while the next inner phase computes (``diloco.overlap``).

``BackgroundRound`` owns what overlap adds to a peer: the round in flight (run by ``RoundRunner`` on its own thread),
the start point of the phase that overlaps it (``overlap.start_params``: the shared θ for "delayed", the eager
estimate for "eager", Kale et al. 2025, Sec. 3.2), and the last committed round the eager estimate needs.

The trainer keeps the shared state. When a background round commits, ``on_commit`` hands the new state to the
trainer at once (so its record and state server show the new epoch while the phase runs on); the train loop then
``settle``s the round when its phase ends, which waits for a round still running (bounded by the round's own
timeouts) and returns its outcome. A round that did not commit applied nothing anywhere (all-or-nothing): its
contribution comes back with the outcome for the trainer to carry or discard.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from hivetrain.diloco.overlap import OverlapMode, PreviousRound, start_params
from hivetrain.diloco.rounds import Contribution, RoundOutcome, RoundRunner
from hivetrain.diloco.state import TrainingState


class BackgroundRound:
    """At most one round in flight, and the start point of the phase that overlaps it.

    Args:
        rounds: runs a round with its retries (thread-safe for one round at a time).
        mode: "delayed" or "eager" ("off": the trainer never launches).
        outer_lr, outer_momentum: the run's outer step (the eager estimate applies it to the start point).
        on_commit: called on the round's thread with a committed outcome (``state`` and ``state_hash`` set) before
            ``settle`` returns it.
    """

    def __init__(
        self,
        rounds: RoundRunner,
        mode: OverlapMode,
        outer_lr: float,
        outer_momentum: float,
        on_commit: Callable[[RoundOutcome], None],
    ):
        self.rounds, self.mode, self.outer_lr, self.outer_momentum = rounds, mode, outer_lr, outer_momentum
        self.on_commit = on_commit
        self._inflight: tuple[Future, Contribution, TrainingState] | None = None
        self._previous: PreviousRound | None = None  # our last committed round (for "eager")

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    @property
    def base_epoch(self) -> int:
        """The epoch of the state the round in flight averages at (its commit makes epoch + 1)."""
        assert self._inflight is not None
        return self._inflight[2].epoch

    def launch(self, state: TrainingState, state_hash: str, contribution: Contribution) -> None:
        """Start the round of ``contribution`` at ``state`` on a daemon thread (a peer that stops does not wait
        for it: it ends within its own timeouts)."""
        assert self._inflight is None, "one round in flight at a time"
        future: Future = Future()

        def run_round() -> None:
            try:
                outcome = self.rounds.run(state, state_hash, contribution)
                if outcome.policy.action == "apply" and outcome.state is not None:
                    self.on_commit(outcome)
                future.set_result(outcome)
            except BaseException as exc:  # noqa: BLE001 - handed to settle() on the train loop's thread
                future.set_exception(exc)

        self._inflight = (future, contribution, state)
        threading.Thread(target=run_round, name=f"round-e{state.epoch}", daemon=True).start()

    def settle(self) -> tuple[RoundOutcome, Contribution]:
        """Wait for the round in flight and return its outcome with the contribution it sent.

        Raises:
            Whatever the round raised (as the synchronous ``RoundRunner.run`` would).
        """
        assert self._inflight is not None
        future, contribution, _ = self._inflight
        self._inflight = None
        return future.result(), contribution

    def abandon(self) -> tuple[RoundOutcome | None, Contribution | None]:
        """The peer is stopping: take the round in flight without waiting. Returns (its outcome if it already
        ended without error, else None; its contribution, or None without a round in flight)."""
        if self._inflight is None:
            return None, None
        future, contribution, _ = self._inflight
        self._inflight = None
        done = future.done() and future.exception() is None
        return (future.result() if done else None), contribution

    def start_state(self, current: TrainingState) -> TrainingState:
        """θ the next inner phase starts from: ``current`` without a round in flight or once it committed,
        otherwise ``overlap.start_params`` from the state the round started at."""
        if self._inflight is None:
            return current
        _, in_flight, base = self._inflight
        if current is not base:  # the round committed already: its state is the start point
            return current
        params = start_params(base, in_flight.delta, self._previous, self.mode, self.outer_lr, self.outer_momentum)
        return TrainingState(epoch=base.epoch, params=params, momentum=base.momentum)

    def remember(self, outcome: RoundOutcome, contribution: Contribution) -> None:
        """Keep a committed round's average and our part of it for the next eager estimate ("eager" only)."""
        result = outcome.result
        if self.mode != "eager" or result is None or outcome.sent is None or result.total_weight <= 0:
            return
        share = min(1.0, contribution.samples / result.total_weight)
        self._previous = PreviousRound(result.tensors, outcome.sent, share)

    def forget(self) -> None:
        """We downloaded state: our last round's average is not the one that led to it."""
        self._previous = None
