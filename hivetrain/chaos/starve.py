"""CPU starvation by duty cycling: a peer's process group runs ``fraction`` of every ``period_s``, stopped otherwise.

The ``cpu_starve`` chaos fault emulates a volunteer whose machine is busy with other work (a game, a compile): the
peer gets a small share of a CPU, in bursts. SIGSTOP/SIGCONT on the peer's process group (the peer, its p2pd and DHT
processes) does it portably, without cgroups or root. Unlike ``join-swarm --duty-cycle``, which sleeps only between
inner steps, a stopped process answers nothing: heartbeats, matchmaking and the data plane stall as well.

``duty_window`` is the schedule as a pure function of time; ``DutyCycler`` is the thread that follows it. The schedule
is anchored at the start time (period ``k`` runs over ``[start + k * period_s, start + (k + fraction) * period_s)``),
so a late wake-up of the thread shortens one window instead of shifting every later one; and a run stops once the
target's running time reaches its share of the periods so far (``run_until``), so a stop sent late is paid back in
the next run: the long-run share stays ``fraction``.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DutyWindow:
    """Where a duty cycle stands at one moment.

    Attributes:
        running: whether the target should run now (SIGCONT) or be stopped (SIGSTOP).
        until_s: when this state ends, on the same clock as ``now_s``.
        period: index of the current period (0 = the first).
    """

    running: bool
    until_s: float
    period: int


def duty_window(now_s: float, start_s: float, fraction: float, period_s: float) -> DutyWindow:
    """The state of a duty cycle at ``now_s``: running for the first ``fraction`` of each period, stopped after.

    Args:
        now_s: the current time, seconds (any clock; ``start_s`` on the same one).
        start_s: when the cycle began: period 0 starts running then.
        fraction: share of each period the target runs, in (0, 1).
        period_s: length of one period, seconds (> 0).

    Returns:
        The window holding ``now_s`` (before ``start_s``: the first running window).

    Raises:
        ValueError: ``fraction`` outside (0, 1) or ``period_s`` <= 0.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    if period_s <= 0:
        raise ValueError(f"period_s must be > 0, got {period_s}")
    elapsed = max(0.0, now_s - start_s)
    period = math.floor(elapsed / period_s)
    begin = start_s + period * period_s
    run_end = begin + fraction * period_s
    if now_s < run_end:
        return DutyWindow(running=True, until_s=run_end, period=period)
    return DutyWindow(running=False, until_s=begin + period_s, period=period)


def run_until(since_s: float, start_s: float, period: int, fraction: float, period_s: float, ran_s: float) -> float:
    """When a target let run at ``since_s`` in ``period`` is stopped: once its running time since ``start_s`` (``ran_s``
    before this run, plus this run) reaches ``fraction`` of the periods up to this one's end, and never later than
    that end. A stop sent late (its thread woke late: under load, and most while the target itself runs) shortens the
    next run by as much, so the long-run share stays ``fraction`` (beside the CI suite and 2 CPU hogs the fixed
    windows let a 20% target run 25% of the time: chaos ``cpu-starve``, 2026-12-01)."""
    period_end = start_s + (period + 1) * period_s
    return min(period_end, since_s + max(0.0, fraction * (period + 1) * period_s - ran_s))


@dataclass
class CycleStats:
    """What a ``DutyCycler`` did.

    Attributes:
        stops: SIGSTOPs sent.
        conts: SIGCONTs sent (the final one included).
        running_s: seconds the target was let run (from each SIGCONT to the next SIGSTOP or the end).
        wall_s: seconds from start to stop.
        ended_by: why the cycle ended: "stopped" (``stop()``), "deadline" (its duration passed), "gone" (the target
            exited), "error" (a signal failed otherwise; the message is logged); "" while running.
    """

    stops: int = 0
    conts: int = 0
    running_s: float = 0.0
    wall_s: float = 0.0
    ended_by: str = ""

    def describe(self) -> str:
        share = self.running_s / self.wall_s if self.wall_s > 0 else 0.0
        return (
            f"{self.stops} SIGSTOP / {self.conts} SIGCONT over {self.wall_s:.1f} s, running {share:.2f} of the time "
            f"(ended: {self.ended_by or 'running'})"
        )


class DutyCycler:
    """A daemon thread that stops and continues one target on a duty cycle, and always leaves it running.

    Args:
        send_signal: sends one signal to the target (e.g. ``PeerProcess.signal_group``: the process group of a process
            the harness started). Raising ``ProcessLookupError`` means the target is gone and ends the cycle.
        fraction: share of each period the target runs, in (0, 1).
        period_s: length of one period, seconds.
        duration_s: the cycle ends by itself this many seconds after ``start()``; 0 = only by ``stop()``.
        alive: returns False once the target has exited (checked every period); the cycle then ends.
        clock: monotonic time source, seconds (injected in tests).
        name: shown in the thread's name and the log.

    The target ends running whatever happens: the thread sends SIGCONT on its way out (stop, deadline, an
    exception), and ``stop()`` sends one itself if the thread did not get that far.
    """

    def __init__(
        self,
        send_signal: Callable[[int], None],
        fraction: float,
        period_s: float,
        duration_s: float = 0.0,
        alive: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
        name: str = "target",
    ):
        duty_window(0.0, 0.0, fraction, period_s)  # ValueError on a bad fraction or period
        if duration_s < 0:
            raise ValueError(f"duration_s must be >= 0 (0 = until stopped), got {duration_s}")
        self.send_signal, self.fraction, self.period_s, self.duration_s = send_signal, fraction, period_s, duration_s
        self.alive, self.clock, self.name = alive, clock, name
        self.stats = CycleStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"cpu-starve-{name}", daemon=True)
        self._start_s = 0.0
        self._left_running = False  # set by the thread once it has left the target running

    def start(self) -> DutyCycler:
        self._start_s = self.clock()
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> CycleStats:
        """End the cycle and leave the target running; returns the stats. Safe to call more than once.

        Args:
            timeout_s: how long to wait for the thread, seconds.
        """
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        if self._thread.is_alive() or not self._left_running:
            self._send(signal.SIGCONT, count=False)  # the thread hung or failed: the target must run all the same
        return self.stats

    @property
    def running(self) -> bool:
        """Whether the cycle is still going."""
        return self._thread.is_alive()

    def _send(self, sig: int, count: bool = True) -> bool:
        try:
            self.send_signal(sig)
        except ProcessLookupError:
            return False
        if count:
            if sig == signal.SIGSTOP:
                self.stats.stops += 1
            else:
                self.stats.conts += 1
        return True

    def _run(self) -> None:
        start = self._start_s
        end = start + self.duration_s if self.duration_s > 0 else math.inf
        running, since = True, start  # the target runs when the cycle starts
        stopped_in = -1  # the period whose run window we ended (stopped until the next one)
        try:
            while True:
                now = self.clock()
                if not self.alive():  # first: a target that exited is "gone" even if stop() came right after
                    self.stats.ended_by = "gone"
                    break
                if self._stop.is_set() or now >= end:
                    self.stats.ended_by = "stopped" if self._stop.is_set() else "deadline"
                    break
                window = duty_window(now, start, self.fraction, self.period_s)
                if running:  # stop once its share is used up (``run_until``), not at the window's fixed end
                    want = now < run_until(since, start, window.period, self.fraction, self.period_s,
                                           self.stats.running_s)  # fmt: skip
                else:  # continue at the start of the next period's run window
                    want = window.running and window.period > stopped_in
                if want != running:
                    if not self._send(signal.SIGCONT if want else signal.SIGSTOP):
                        self.stats.ended_by = "gone"
                        break
                    if running:
                        self.stats.running_s += now - since
                        stopped_in = window.period
                    running, since = want, now
                if running:
                    until = run_until(since, start, window.period, self.fraction, self.period_s, self.stats.running_s)
                else:
                    until = start + (window.period + 1) * self.period_s
                self._stop.wait(max(0.0, min(until, end) - self.clock()))
        except Exception:  # noqa: BLE001 - never leave the target stopped because a signal failed
            logger.exception("cpu_starve of %s failed", self.name)
            self.stats.ended_by = "error"
        finally:
            now = self.clock()
            if running:
                self.stats.running_s += now - since
            else:
                self._send(signal.SIGCONT)  # False: the target is gone, nothing left to continue
            self.stats.wall_s = now - start
            self._left_running = True
