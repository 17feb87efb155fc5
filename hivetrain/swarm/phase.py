"""One owner for a stage server's state: the open phase as one immutable value, the server's status as one locked
transition.

``StagePhase`` is the runtime's whole phase bookkeeping (which window is open, how many inner steps and microbatches
it holds, the global inner step that drives the learning-rate schedule). The runtime replaces it in one assignment
(``StageRuntime._set_phase``) with a value built by one of the pure methods below, so no code path can reset three
counters and forget the fourth.

``ServerStatus`` holds what a stage server announces (joining, serving, syncing, moving). Two threads change it: the
maintenance thread moves the server to another stage, the runtime worker runs the stage's outer step. Every change goes
through ``ServerStatus.transition``, which applies the pure table ``next_status`` under a lock: a move is refused while
the stage is syncing, an outer step is refused while the server is moving, and the end of an outer step can no longer
overwrite "moving" with "serving".
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

from hivetrain.swarm.announce import ServerState


@dataclass(frozen=True)
class StagePhase:
    """The open phase of a stage server (replaced, never mutated).

    Attributes:
        window: index of the open phase since the server's incarnation began; trainers' ledgers key on it.
        inner_step: the global inner step the next AdamW step takes (drives warmup/cosine); epoch * H at a phase start.
        num_inner_steps: inner steps taken in the open phase.
        num_microbatches: microbatches accumulated in the open phase (its weight in the stage's average).
        num_failed_outer_steps: outer steps of this phase that failed all-or-nothing (the phase went on: ``kept``).
        failed_at: when the last of them failed (``time.monotonic()`` seconds; 0 = none); the server backs off from it.
    """

    window: int = 0
    inner_step: int = 0
    num_inner_steps: int = 0
    num_microbatches: int = 0
    num_failed_outer_steps: int = 0
    failed_at: float = 0.0

    @classmethod
    def first(cls, epoch: int, inner_steps: int) -> StagePhase:
        """The first phase of a new incarnation serving a state of ``epoch`` (``inner_steps`` = H)."""
        return cls(window=0, inner_step=epoch * inner_steps)

    def next(self, epoch: int, inner_steps: int) -> StagePhase:
        """The phase after this one (committed or abandoned), starting from the committed state of ``epoch``."""
        return StagePhase(window=self.window + 1, inner_step=epoch * inner_steps)

    def with_microbatch(self) -> StagePhase:
        return dataclasses.replace(self, num_microbatches=self.num_microbatches + 1)

    def with_inner_step(self) -> StagePhase:
        return dataclasses.replace(self, inner_step=self.inner_step + 1, num_inner_steps=self.num_inner_steps + 1)

    def kept(self, now: float) -> StagePhase:
        """The same open phase after an outer step that failed all-or-nothing at ``now`` (monotonic seconds): its
        window, inner steps and microbatches go on, so the next outer step's pseudo-gradient covers the whole, longer
        phase (DiLoCo's carry; the data-parallel trainer does the same) and trainers replay nothing."""
        return dataclasses.replace(self, num_failed_outer_steps=self.num_failed_outer_steps + 1, failed_at=now)

    def retry_at(self, interval_s: float, max_backoff_intervals: int = 8) -> float:
        """Monotonic time before which no new outer step of a kept phase is tried: ``interval_s`` (the servers'
        announce interval) × 1, 2, 4, ... up to ``max_backoff_intervals`` after the last failure; 0 if none failed.
        The stage's servers that failed one round fail it together, so they come back together; each attempt blocks
        the server's compute for its matchmaking, which the backoff bounds while a round cannot form (a dead peer's
        group declaration blocks its epoch until the round timeout, ``averaging.matchmaking.over_because``)."""
        if not self.num_failed_outer_steps:
            return 0.0
        backoff = min(2 ** (self.num_failed_outer_steps - 1), max_backoff_intervals)
        return self.failed_at + interval_s * backoff

    def rebased(self, epoch: int, inner_steps: int) -> StagePhase:
        """The same open phase on a downloaded state of ``epoch``; only valid before its first inner step."""
        assert self.num_inner_steps == 0, "abandon a phase that took inner steps before rebasing it"
        return dataclasses.replace(self, inner_step=epoch * inner_steps)


_ALLOWED: dict[tuple[ServerState, ServerState], str] = {
    ("joining", "serving"): "joined its stage",
    ("serving", "syncing"): "the stage's outer step began",
    ("syncing", "serving"): "the stage's outer step ended",
    ("serving", "moving"): "moving to another stage",
    ("moving", "serving"): "serving the new stage",
}
_REFUSED: dict[tuple[ServerState, ServerState], str] = {
    ("syncing", "moving"): "the stage is syncing: moving now would abandon the outer step its peers are waiting for",
    ("moving", "syncing"): "the server is moving: the phase it leaves is abandoned, not averaged",
}


def next_status(current: ServerState, requested: ServerState) -> tuple[bool, str]:
    """Whether a server in ``current`` may enter ``requested``, and why (pure; the table above).

    Returns:
        (allowed, reason): staying in the same status is refused, so a caller learns it did not start the change.
    """
    if (current, requested) in _ALLOWED:
        return True, _ALLOWED[current, requested]
    if (current, requested) in _REFUSED:
        return False, _REFUSED[current, requested]
    return False, f"no transition from {current!r} to {requested!r}"


class ServerStatus:
    """A stage server's status, changed only through ``transition`` (thread-safe)."""

    def __init__(self, initial: ServerState = "joining"):
        self._value: ServerState = initial
        self._lock = threading.Lock()

    @property
    def value(self) -> ServerState:
        return self._value

    def transition(self, requested: ServerState) -> tuple[bool, str]:
        """Enter ``requested`` if ``next_status`` allows it from the current status, atomically.

        Returns:
            (changed, reason): False and why when refused (the status is then unchanged).
        """
        with self._lock:
            allowed, reason = next_status(self._value, requested)
            if allowed:
                self._value = requested
            return allowed, reason

    def leave(self, expected: ServerState, requested: ServerState) -> bool:
        """Enter ``requested`` only if the status is still ``expected`` (ending a change this caller began)."""
        with self._lock:
            if self._value != expected:
                return False
            allowed, _ = next_status(expected, requested)
            if allowed:
                self._value = requested
            return allowed
