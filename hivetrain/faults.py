"""Deterministic fault injection at named points of production code.

Production code calls ``faults.check("averaging.before_send", round_id=..., peer=...)`` at named hook points. With
nothing armed, ``check`` is a dictionary lookup and returns. Tests and the chaos harness arm faults; every hit is
counted so a test can assert that its fault actually fired.

Hook points used by hivetrain (keep this list in sync with the code):

    averaging.before_send      a member is about to send its parts to the reducers
    averaging.mid_transfer     a member has sent some of its parts
    averaging.after_reduce     a reducer has reduced its part, before sending results back
    averaging.before_commit    a member holds the full result, before voting to commit
    averaging.vote             a member is about to send its vote to member ``to`` (a raise drops that vote)
    state.before_serve         a state donor is about to stream its state
    state.mid_download         a joiner has received part of a state download
    diloco.before_outer_step   a peer is about to average its pseudo-gradient
    swarm.server.mid_forward   a stage server computed a forward, before replying (SWARM)
    swarm.server.mid_backward  a stage server accumulated a backward, before replying (SWARM)
    checkpoint.mid_write       the coordinator is writing a checkpoint's files

Actions: ``raise`` (raise FaultInjected), ``sleep`` (block ``seconds``), ``exit`` (``os._exit``: the process dies
without cleanup, like SIGKILL), ``stop`` (SIGSTOP to itself; something else must SIGCONT it), ``call`` (run a callback
that may corrupt the context, e.g. a tensor).
"""

from __future__ import annotations

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


class FaultInjected(RuntimeError):
    """Raised at a hook point by an armed ``raise`` fault."""


@dataclass
class Fault:
    """One armed fault.

    Args:
        point: hook point name (see module docstring).
        action: what happens when it fires.
        when: fire only when every key equals the hook's context value (e.g. ``{"epoch": 2}``).
        times: fire at most this many times (0 = every time).
        skip: let this many matching hits pass first.
        seconds: for ``sleep``.
        callback: for ``call``; receives the hook's context dict.
    """

    point: str
    action: Action
    when: dict[str, Any] = field(default_factory=dict)
    times: int = 1
    skip: int = 0
    seconds: float = 0.0
    callback: Callable[[dict[str, Any]], None] | None = None
    matched: int = 0
    fired: int = 0

    def __post_init__(self) -> None:
        if self.action not in ("raise", "sleep", "exit", "stop", "call"):
            raise ValueError(f"unknown fault action {self.action!r}")
        if self.action == "call" and self.callback is None:
            raise ValueError("a 'call' fault needs a callback")
        if self.times < 0 or self.skip < 0 or self.seconds < 0:
            raise ValueError("times, skip and seconds must be >= 0")


class FaultInjector:
    """Arms faults and fires them at hook points. Thread-safe; cheap when nothing is armed."""

    def __init__(self) -> None:
        self._faults: dict[str, list[Fault]] = {}
        self._lock = threading.Lock()
        self.hits: Counter[str] = Counter()
        self.fired: list[tuple[str, str, float]] = []  # (point, action, unix time)

    def arm(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.setdefault(fault.point, []).append(fault)
        return fault

    def disarm_all(self) -> None:
        with self._lock:
            self._faults.clear()

    def fired_count(self, point: str) -> int:
        return sum(1 for p, _, _ in self.fired if p == point)

    def check(self, point: str, **context: Any) -> None:
        """Fire the first armed fault at ``point`` whose ``when`` matches ``context``; else return at once."""
        if not self._faults:
            return
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
                self.fired.append((point, fault.action, time.time()))
                break
        if chosen is not None:
            self._fire(chosen, context)

    def _fire(self, fault: Fault, context: dict[str, Any]) -> None:
        logger.warning("fault fired: %s %s", fault.point, fault.action)
        for handler in logger.handlers or logging.getLogger().handlers:
            handler.flush()  # an 'exit' fault ends the process next: make the line reach the log first
        if fault.action == "raise":
            raise FaultInjected(f"fault injected at {fault.point}")
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
"""Shared injector with nothing armed; pass a fresh FaultInjector to arm faults."""


def parse_fault_spec(spec: str) -> Fault:
    """Parse ``POINT:ACTION[:SECONDS][@KEY=VALUE,...]`` (the ``--fault`` flag used by the chaos harness).

    Example: ``averaging.mid_transfer:exit@epoch=2``. Values that look like integers are compared as integers.

    Raises:
        ValueError: a malformed spec.
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
    return Fault(point=parts[0], action=parts[1], when=when, seconds=seconds)  # type: ignore[arg-type]
