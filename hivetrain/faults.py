"""Deterministic fault injection at named points of production code.

Production code calls ``faults.check(HookPoint.AVERAGING_BEFORE_SEND, round_id=..., peer=...)`` at named hook
points. Every hook point is a member of ``HookPoint`` (production code, scenarios and tests import it); a name that
is not one is refused (``ValueError`` listing the valid ones) when a fault is armed and at every ``check``, armed or
not, so a misspelt hook fails its first test instead of never firing. With nothing armed, ``check`` is a set lookup
and returns. Tests and the chaos harness arm faults; every hit is counted so a test can assert that its fault
actually fired, and an ``on_fire`` callback hears of every firing (the DiLoCo trainer writes it to its metrics file
as a ``fault_fired`` event, which the chaos harness reads).

Actions: ``raise`` (raise FaultInjected), ``sleep`` (block ``seconds``), ``exit`` (``os._exit``: the process dies
without cleanup, like SIGKILL), ``stop`` (SIGSTOP to itself; something else must SIGCONT it), ``call`` (run a callback
that may corrupt the context, e.g. a tensor, or replace entries of it: ``check`` returns the context as the callback
left it).
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

logger = logging.getLogger(__name__)

Action = Literal["raise", "sleep", "exit", "stop", "call"]


class HookPoint(str, enum.Enum):
    """The named points where production code calls ``FaultInjector.check``; each member's value is its name.

    A member is a ``str`` (``HookPoint.AVERAGING_VOTE == "averaging.vote"``), so a call site that still passes the
    name validates too. Each docstring says when the hook runs and the keys of its context.
    """

    __str__ = str.__str__  # "averaging.vote", also on Python 3.10 (no enum.StrEnum there)

    AVERAGING_BEFORE_SEND = "averaging.before_send"
    """A member is about to send its parts to the reducers (``averaging.allreduce``). Context: ``epoch``, ``peer``,
    ``round_id``, ``subround``, ``stage`` (the round's place in the averaging call: "group" for one group, "row",
    "column", "confirm" or "fetch" in the two-stage round), ``flat`` (our fp32 vector) and ``frames`` (peer id ->
    [meta dict, payload buffers]), which a "call" fault may corrupt in place (a hostile peer's wire)."""
    AVERAGING_MID_TRANSFER = "averaging.mid_transfer"
    """A member has sent half of its first part of an attempt (from a sender thread). Context: ``epoch``, ``peer``,
    ``round_id``, ``subround``, ``stage`` (as before_send)."""
    AVERAGING_AFTER_REDUCE = "averaging.after_reduce"
    """A reducer has reduced its part, before sending results back. Context: as before_send, ``reduced`` (the fp32
    slice) instead of ``flat``/``frames``."""
    AVERAGING_HAVE = "averaging.have"
    """A member is about to send its HAVE frame (whose parts of its slice it holds) to member ``to``
    (``averaging.allreduce``); a "raise" fault drops that one frame (a member dying while its HAVE frames leave
    reaches some members and not others). Context: as before_commit, plus ``to`` (the member's peer id)."""
    AVERAGING_BEFORE_COMMIT = "averaging.before_commit"
    """A member holds the full result, before voting to commit. Context: ``epoch``, ``peer``, ``round_id``,
    ``subround``, ``stage`` (as before_send)."""
    AVERAGING_VOTE = "averaging.vote"
    """A member is about to send its commit vote to member ``to`` (``agreement.CommitVote.commit``); a "raise" fault
    drops that one vote (the two-phase-commit gap: the others commit, ``to`` fails with ``voted`` set). Context: as
    before_commit, plus ``to`` (the member's peer id)."""
    STATE_BEFORE_SERVE = "state.before_serve"
    """A state donor is about to stream its state. Context: ``epoch``, ``meta`` (the manifest reply dict, which a
    "call" fault may alter)."""
    STATE_MID_DOWNLOAD = "state.mid_download"
    """A joiner has received part of a state download. Context: ``epoch``, ``index`` (the chunk just received)."""
    DILOCO_BEFORE_OUTER_STEP = "diloco.before_outer_step"
    """A peer is about to average its pseudo-gradient (each attempt of a round). Context: ``epoch``, ``peer``."""
    DILOCO_ROUND_INPUT = "diloco.round_input"
    """What a peer averages, just after before_outer_step. Context: ``epoch``, ``peer``, ``tensors`` (list of fp32
    CPU tensors in ``state.params`` order: Δ, or θ for moshpit/gossip) and ``weight`` (float, samples); a "call"
    fault may replace both (a byzantine peer's input, ``hivetrain.testing.byzantine``). The peer's own copy is
    unchanged."""
    DILOCO_STATE_SERVER = "diloco.state_server"
    """A DiLoCo peer builds the server joiners download its state from (once, at construction). Context: ``server``
    (the ``diloco.state_sync.StateServer`` it will run), ``get_state`` (returns its current ``TrainingState`` or None)
    and ``faults`` (this injector); a "call" fault may replace ``server`` (a hostile donor)."""
    DILOCO_RECORD = "diloco.record"
    """A DiLoCo peer built the record it is about to publish. Context: ``record`` (a ``PeerRecord``), which a "call"
    fault may replace (a peer lying about its epoch)."""
    SWARM_SERVER_MID_FORWARD = "swarm.server.mid_forward"
    """A stage server computed a forward, before replying (SWARM). Context: ``stage``, ``microbatch_id``, ``peer``."""
    SWARM_SERVER_MID_BACKWARD = "swarm.server.mid_backward"
    """A stage server accumulated a backward, before replying (SWARM). Context: as mid_forward."""
    CHECKPOINT_MID_WRITE = "checkpoint.mid_write"
    """The coordinator is writing a checkpoint's files. Context: ``epoch``, ``path`` (the temporary directory)."""


_POINT_NAMES = frozenset(p.value for p in HookPoint)


def hook_point(name: str) -> HookPoint:
    """The ``HookPoint`` named ``name`` (a member passes through).

    Raises:
        ValueError: ``name`` is not a hook point; the message lists the valid ones.
    """
    try:
        return HookPoint(name)
    except ValueError:
        valid = ", ".join(p.value for p in HookPoint)
        raise ValueError(f"unknown hook point {name!r}; valid hook points: {valid}") from None


OnFire = Callable[[HookPoint, str, dict[str, Any]], None]
"""``on_fire(point, action, context)``: told of every firing, before its action runs (an ``exit`` ends the process
next)."""


class FaultInjected(RuntimeError):
    """Raised at a hook point by an armed ``raise`` fault."""


@dataclass
class Fault:
    """One armed fault.

    Args:
        point: the hook point (a ``HookPoint``, or its name: converted).
        action: what happens when it fires.
        when: fire only when every key equals the hook's context value (e.g. ``{"epoch": 2}``).
        times: fire at most this many times (0 = every time).
        skip: let this many matching hits pass first.
        seconds: for ``sleep``.
        callback: for ``call``; receives the hook's context dict (and may change or replace its entries).

    Raises:
        ValueError: an unknown point (the message lists the valid ones) or action, a ``call`` without callback,
            a negative count.
    """

    point: HookPoint
    action: Action
    when: dict[str, Any] = field(default_factory=dict)
    times: int = 1
    skip: int = 0
    seconds: float = 0.0
    callback: Callable[[dict[str, Any]], None] | None = None
    matched: int = 0
    fired: int = 0

    def __post_init__(self) -> None:
        self.point = hook_point(self.point)
        if self.action not in ("raise", "sleep", "exit", "stop", "call"):
            raise ValueError(f"unknown fault action {self.action!r}; valid: raise, sleep, exit, stop, call")
        if self.action == "call" and self.callback is None:
            raise ValueError("a 'call' fault needs a callback")
        if self.times < 0 or self.skip < 0 or self.seconds < 0:
            raise ValueError("times, skip and seconds must be >= 0")


class FaultInjector:
    """Arms faults and fires them at hook points. Thread-safe; cheap when nothing is armed.

    Args:
        on_fire: called with (point, action, the hook's context) on every firing, from the thread that hit the hook,
            before the action runs; settable later (``injector.on_fire = ...``). An exception it raises is logged and
            does not change what the fault does.
    """

    def __init__(self, on_fire: OnFire | None = None) -> None:
        self._faults: dict[str, list[Fault]] = {}
        self._lock = threading.Lock()
        self.on_fire = on_fire
        self.hits: Counter[str] = Counter()
        self.fired: list[tuple[str, str, float]] = []  # (point, action, unix time)

    def arm(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.setdefault(fault.point.value, []).append(fault)
        return fault

    def disarm_all(self) -> None:
        with self._lock:
            self._faults.clear()

    def fired_count(self, point: HookPoint | str) -> int:
        return sum(1 for p, _, _ in self.fired if p == point)

    def check(self, point: HookPoint | str, **context: Any) -> dict[str, Any]:
        """Fire the first armed fault at ``point`` whose ``when`` matches ``context``; else return at once.

        Returns:
            ``context``, as a ``call`` fault's callback left it (the same dict it received).

        Raises:
            ValueError: ``point`` is not a ``HookPoint`` (checked even with nothing armed).
            FaultInjected: a ``raise`` fault fired.
        """
        if point not in _POINT_NAMES:
            hook_point(point)  # raises, naming the valid points
        if not self._faults:
            return context
        with self._lock:
            self.hits[point] += 1
            chosen = None
            for fault in self._faults.get(point, ()):
                if fault.times and fault.fired >= fault.times:
                    continue
                if any(context.get(k) != v for k, v in fault.when.items()):
                    continue
                fault.matched += 1
                if fault.matched <= fault.skip:
                    continue
                fault.fired += 1
                chosen = fault
                self.fired.append((fault.point.value, fault.action, time.time()))
                break
        if chosen is not None:
            self._fire(chosen, context)
        return context

    def _fire(self, fault: Fault, context: dict[str, Any]) -> None:
        logger.warning("fault fired: %s %s", fault.point.value, fault.action)
        if self.on_fire is not None:
            try:
                self.on_fire(fault.point, fault.action, context)
            except Exception:  # noqa: BLE001 - telemetry must not change what the fault does
                logger.exception("fault on_fire callback failed at %s", fault.point.value)
        for handler in logger.handlers or logging.getLogger().handlers:
            handler.flush()  # an 'exit' fault ends the process next: make the line reach the log first
        if fault.action == "raise":
            raise FaultInjected(f"fault injected at {fault.point.value}")
        if fault.action == "sleep":
            time.sleep(fault.seconds)
        elif fault.action == "exit":
            os._exit(137)
        elif fault.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.action == "call":
            assert fault.callback is not None
            fault.callback(context)


NO_FAULTS = FaultInjector()
"""Shared injector with nothing armed; pass a fresh FaultInjector to arm faults (never arm this one, nor give it an
``on_fire``)."""


def parse_fault_spec(spec: str) -> Fault:
    """Parse ``POINT:ACTION[:SECONDS][@KEY=VALUE,...]`` (the ``--fault`` flag used by the chaos harness).

    Example: ``averaging.mid_transfer:exit@epoch=2``. Values that look like integers are compared as integers.

    Raises:
        ValueError: a malformed spec, or an unknown point or action (the message lists the valid ones).
    """
    head, _, cond = spec.partition("@")
    parts = head.split(":")
    if len(parts) not in (2, 3) or not parts[0]:
        raise ValueError(f"fault spec {spec!r}: expected POINT:ACTION[:SECONDS][@KEY=VALUE,...]")
    when: dict[str, Any] = {}
    for item in filter(None, cond.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"fault spec {spec!r}: condition {item!r} is not KEY=VALUE")
        when[key] = int(value) if value.lstrip("-").isdigit() else value
    seconds = float(parts[2]) if len(parts) == 3 else 0.0
    try:
        return Fault(point=parts[0], action=parts[1], when=when, seconds=seconds)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"fault spec {spec!r}: {exc}") from None
