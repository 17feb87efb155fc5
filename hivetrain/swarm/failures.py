"""Death detection from failed calls: when a trainer stops waiting for a stage server's record to lapse. Pure; time
injected.

A stage server's DHT record lives ``record_ttl_s`` seconds after its last announcement, so a trainer that learns of a
death only from records learns it ``record_ttl_s`` + up to two announce intervals late (4-16 s in the 3 x 2 pipeline
benchmark). The trainer's own calls tell it sooner:

* **unreachable** (the server's daemon reset the stream, refused the connection, could not be dialed): on a live
  connection this is what a killed process looks like. The server is declared dead at once: banned in routing until
  its record must have lapsed, every other call in flight to it is cancelled and rerouted, and the parameter
  gradients the trainer's ledger holds there are replayed on the stage's other servers right away.
* **timeout**: a server may be slow rather than dead. The first one only bans it with backoff; ``dead_after_timeouts``
  consecutive failures (no success between) within ``record_ttl_s`` declare it dead for routing (cancel and reroute
  its calls in flight), but its ledger entries wait for its record to lapse: a stalled server keeps the gradients it
  accumulated, and replaying them while it may still commit them would count them twice.
* **error** (a malformed reply, an error raised by its handler): the server is alive; ban with backoff only.

The remaining gap: an unreachable verdict on a server that is in fact alive (a connection reset by a flaky network, not
by a death) replays its open phase's gradients of this trainer while the server may still commit them, counting them
twice. ``PipelineTrainer.stats.false_deaths`` counts servers that answered after being declared dead.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

FailureKind = Literal["unreachable", "timeout", "error"]

_UNREACHABLE_MARKERS = (
    "stream reset",
    "connection refused",
    "connection reset",
    "failed to dial",
    "dial backoff",
    "no good addresses",
    "no addresses",
)


def classify_error(message: str) -> FailureKind:
    """The kind of a P2P failure from the daemon's message (the daemon gives no typed code; this is the one place
    that reads its text). Timeouts are classified by the caller, which owns the timer."""
    text = message.lower()
    return "unreachable" if any(marker in text for marker in _UNREACHABLE_MARKERS) else "error"


@dataclass(frozen=True)
class FailureConfig:
    """When failed calls declare a stage server dead.

    Args:
        dead_after_timeouts: consecutive failed calls, at least one a timeout, that declare a server dead for routing.
        window_s: those failures must fall within this many seconds (a server that fails rarely is only banned).
        dead_ban_s: a dead server gets no call for this long, seconds: long enough for its record to lapse.
    """

    dead_after_timeouts: int = 2
    window_s: float = 8.0
    dead_ban_s: float = 16.0

    def __post_init__(self) -> None:
        if self.dead_after_timeouts < 1:
            raise ValueError(f"dead_after_timeouts must be >= 1, got {self.dead_after_timeouts}")
        for name in ("window_s", "dead_ban_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0 seconds, got {value}")

    @classmethod
    def for_swarm(cls, record_ttl_s: float, announce_interval_s: float) -> FailureConfig:
        """Windows sized by the pipeline's record lifetime: a dead server's record lapses within
        ``record_ttl_s + 2 * announce_interval_s`` of its death."""
        lapse_s = record_ttl_s + 2 * announce_interval_s
        return cls(window_s=2 * record_ttl_s, dead_ban_s=2 * lapse_s)


@dataclass(frozen=True)
class PeerHealth:
    """One server's recent calls as seen by one trainer (replaced, never mutated).

    Attributes:
        num_failures: consecutive failed calls since the last success.
        first_failure_at: time of the first of them (meaningless when ``num_failures`` is 0).
        num_timeouts: how many of them timed out.
        dead_since: when it was declared dead; ``math.inf`` = not dead.
    """

    num_failures: int = 0
    first_failure_at: float = 0.0
    num_timeouts: int = 0
    dead_since: float = math.inf

    @property
    def dead(self) -> bool:
        return self.dead_since < math.inf


@dataclass(frozen=True)
class FailureVerdict:
    """What a trainer does after a failed call.

    Attributes:
        health: the server's updated record.
        declare_dead: it just became dead: cancel and reroute every other call in flight to it, ban it ``ban_s``.
        replay_now: replay the ledger entries held there now (only for an unreachable server).
        ban_s: how long to ban it, seconds; 0 = the ordinary backoff ban.
        reason: for people (logs, summaries).
    """

    health: PeerHealth
    declare_dead: bool
    replay_now: bool
    ban_s: float
    reason: str


def judge_failure(health: PeerHealth, kind: FailureKind, now: float, config: FailureConfig) -> FailureVerdict:
    """Update ``health`` with a failed call of ``kind`` at ``now`` and decide whether the server is dead.

    Args:
        health: the server's record before this failure (``PeerHealth()`` for a server never seen failing).
        kind: how the call failed (``classify_error``, or "timeout").
        now: seconds on the clock every call of this trainer uses.
        config: the thresholds.

    Returns:
        The verdict. A server already dead stays dead and is not declared again (its calls were already cancelled).
    """
    if health.num_failures == 0 or now - health.first_failure_at > config.window_s:
        health = PeerHealth(first_failure_at=now, dead_since=health.dead_since)
    health = dataclasses.replace(
        health, num_failures=health.num_failures + 1, num_timeouts=health.num_timeouts + (kind == "timeout")
    )
    if health.dead:
        return FailureVerdict(health, False, False, config.dead_ban_s, "already declared dead")
    if kind == "unreachable":
        dead = dataclasses.replace(health, dead_since=now)
        return FailureVerdict(dead, True, True, config.dead_ban_s, "unreachable: its daemon is gone")
    if kind == "timeout" and health.num_failures >= config.dead_after_timeouts:
        dead = dataclasses.replace(health, dead_since=now)
        reason = (
            f"{health.num_failures} failed calls ({health.num_timeouts} timeouts) in "
            f"{now - health.first_failure_at:.1f}s: dead for routing; its gradients wait for its record to lapse"
        )
        return FailureVerdict(dead, True, False, config.dead_ban_s, reason)
    return FailureVerdict(health, False, False, 0.0, f"{kind} ({health.num_failures} in a row)")


def judge_success(health: PeerHealth) -> tuple[PeerHealth, bool]:
    """A call succeeded: the server's failures are forgotten. Returns (new health, whether it had been declared dead:
    a false death, whose replayed gradients the server may commit too)."""
    return PeerHealth(), health.dead
