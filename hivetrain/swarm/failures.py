"""Death detection from failed calls: when a trainer stops waiting for a stage server's record to lapse. Pure; time
injected.

A stage server's DHT record lives ``record_ttl_s`` seconds after its last announcement, so a trainer that learns of a
death only from records learns it ``record_ttl_s`` + up to two announce intervals late (4-16 s in the 3 x 2 pipeline
benchmark). The trainer's own calls tell it sooner:

* **unreachable** (the server's daemon reset the stream, refused the connection, could not be dialed): on a live
  connection this is what a killed process looks like. The server is declared dead at once: banned in routing until
  its record must have lapsed, every other call in flight to it is cancelled and rerouted, and the parameter
  gradients the trainer's ledger holds there are replayed on the stage's other servers right away.
* **timeout**: a server may be slow rather than dead (a busy machine times out live servers too). Each one bans it with
  the ordinary backoff, except a call sent before the previous failure was seen (calls queued together time out
  together: one outage); ``dead_after_timeouts`` such consecutive failures (no success between, at least one a
  timeout) within ``window_s`` declare it dead for routing: its other calls in flight are cancelled and rerouted,
  but it keeps the ordinary backoff ban (not ``dead_ban_time_s``) and its ledger entries wait for its record to lapse: a
  stalled server keeps the gradients it accumulated, and replaying them while it may still commit them would count
  them twice.
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
        dead_after_timeouts: consecutive failed calls, at least one a timeout, that declare a server dead for routing
            (3: two timeouts are common on a busy machine and only cost their own reroutes).
        window_s: those failures must fall within this many seconds (a server that fails rarely is only banned).
        dead_ban_time_s: a dead server gets no call for this long, seconds: long enough for its record to lapse.
    """

    dead_after_timeouts: int = 3
    window_s: float = 8.0
    dead_ban_time_s: float = 16.0

    def __post_init__(self) -> None:
        if self.dead_after_timeouts < 1:
            raise ValueError(f"dead_after_timeouts must be >= 1, got {self.dead_after_timeouts}")
        for name in ("window_s", "dead_ban_time_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0 seconds, got {value}")

    @classmethod
    def for_swarm(cls, record_ttl_s: float, announce_interval_s: float) -> FailureConfig:
        """Windows sized by the pipeline's record lifetime: a dead server's record lapses within
        ``record_ttl_s + 2 * announce_interval_s`` of its death."""
        lapse_s = record_ttl_s + 2 * announce_interval_s
        return cls(window_s=2 * record_ttl_s, dead_ban_time_s=2 * lapse_s)


@dataclass(frozen=True)
class PeerHealth:
    """One server's recent calls as seen by one trainer (replaced, never mutated).

    Attributes:
        num_failures: consecutive failed calls since the last success, counting only calls sent after the previous
            failure was seen (independent evidence).
        first_failure_at: time of the first of them (meaningless when ``num_failures`` is 0).
        last_failure_at: time of the last of them.
        num_timeouts: how many of them timed out.
        dead_since: when it was declared dead; ``math.inf`` = not dead.
        replayed: its ledger entries were replayed when it was declared dead (unreachable): an entry added later
            (an answer it sent before dying, handled after the verdict) is replayed at once too.
    """

    num_failures: int = 0
    first_failure_at: float = 0.0
    last_failure_at: float = -math.inf
    num_timeouts: int = 0
    dead_since: float = math.inf
    replayed: bool = False

    @property
    def dead(self) -> bool:
        return self.dead_since < math.inf


@dataclass(frozen=True)
class FailureVerdict:
    """What a trainer does after a failed call.

    Attributes:
        health: the server's updated record.
        declare_dead: it just became dead: cancel and reroute every other call in flight to it.
        replay_now: replay the ledger entries held there now (only for an unreachable server).
        ban_time_s: ban it this long, seconds (an unreachable server); 0 = no ban of this length.
        strike: add one offence to its ordinary backoff ban. False when this failure is no new evidence: the server
            is already dead, or the call was sent before the last failure was seen (calls queued together time out
            together: one outage, not several; counting each doubled the ban of a loaded stage's last server until
            the stage stalled for a minute).
        reason: for people (logs, summaries).
    """

    health: PeerHealth
    declare_dead: bool
    replay_now: bool
    ban_time_s: float
    strike: bool
    reason: str


def judge_failure(
    health: PeerHealth, kind: FailureKind, now: float, config: FailureConfig, sent_at: float = -math.inf
) -> FailureVerdict:
    """Count a call of ``kind`` sent at ``sent_at`` that failed at ``now`` into ``health``; decide if it is dead.

    Args:
        health: the server's record before this failure (``PeerHealth()`` for a server never seen failing).
        kind: how the call failed (``classify_error``, or "timeout").
        now: seconds on the clock every call of this trainer uses.
        config: the thresholds.
        sent_at: when the failed call was sent, same clock; -inf = unknown (always counts).

    Returns:
        The verdict. A server already dead stays dead and is not declared again (its calls were already cancelled).
    """
    if health.dead:
        return FailureVerdict(health, False, False, 0.0, False, "already declared dead")
    if kind == "unreachable":
        dead = dataclasses.replace(health, dead_since=now, replayed=True)
        return FailureVerdict(dead, True, True, config.dead_ban_time_s, False, "unreachable: its daemon is gone")
    if health.num_failures and sent_at < health.last_failure_at and now - health.first_failure_at <= config.window_s:
        return FailureVerdict(health, False, False, 0.0, False, f"{kind}: sent before the last failure, same outage")
    if health.num_failures == 0 or now - health.first_failure_at > config.window_s:
        health = PeerHealth(first_failure_at=now)
    health = dataclasses.replace(
        health,
        num_failures=health.num_failures + 1,
        num_timeouts=health.num_timeouts + (kind == "timeout"),
        last_failure_at=now,
    )
    if health.num_timeouts and health.num_failures >= config.dead_after_timeouts:
        dead = dataclasses.replace(health, dead_since=now)
        reason = (
            f"{health.num_failures} failed calls ({health.num_timeouts} timeouts) in "
            f"{now - health.first_failure_at:.1f}s: dead for routing; its gradients wait for its record to lapse"
        )
        return FailureVerdict(dead, True, False, 0.0, True, reason)
    return FailureVerdict(health, False, False, 0.0, True, f"{kind} ({health.num_failures} in a row)")


AnswerKind = Literal["alive", "false_death", "before_death"]


def judge_answer(health: PeerHealth, answered_at: float) -> tuple[PeerHealth, AnswerKind]:
    """A call got a reply at ``answered_at``. Returns the server's new health and what the reply means:

    * "alive": its failures are forgotten (it may be banned no longer);
    * "false_death": it answered after being declared dead (its replayed gradients may be committed twice);
    * "before_death": the reply arrived before the verdict and was handled after it: the server stays dead.
    """
    if not health.dead:
        return PeerHealth(), "alive"
    if answered_at <= health.dead_since:
        return health, "before_death"
    return PeerHealth(), "false_death"
