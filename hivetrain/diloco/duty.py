"""Lend part of a machine: train at most a fraction of wall time, and pause without leaving the swarm.

A volunteer who keeps using the machine runs ``join-swarm --duty-cycle F`` (0 < F <= 1): after every inner step that
took ``step_s`` seconds the trainer idles about ``step_s * (1/F - 1)`` seconds, so inner steps fill at most ``F`` of
wall time. The same flag lets a benchmark emulate hardware ``1/F`` times slower.

Accounting is a running budget, not a per-step sleep: ``owed_s`` holds the idle seconds still owed. Each step adds
its share; what was really idled (measured with the clock, not what was asked for) is taken off. So a sleep that
overshoots (coarse timer granularity, a loaded machine) makes the next one shorter, shares too small to sleep
precisely (under ``min_sleep_s``) are carried to the next step instead of rounded away, and slow or jittery steps
owe in proportion: the long-run ratio of step time to wall time converges to ``F``. Credit from oversleeping is
capped at ``max_credit_s``, so a process suspended in the middle of a sleep (laptop lid) does not earn a burst of
full-speed training afterwards.

Pausing: ``pause()``/``resume()``/``toggle()`` (``join-swarm`` binds SIGUSR1 to ``toggle``), or a pause file: while
the path exists the peer is paused (checked at most every ``file_check_s``). A pause takes effect after the current
inner step and blocks the train loop only: the peer's DHT record heartbeat and its data port keep running, so it
stays in the swarm and can be resumed without rejoining; its published throughput drops (it computes no samples),
so the swarm's schedule stops waiting for it. The time paused also pays what was owed (the machine rested).

The trainer's ``compute_s`` counts only the inner steps themselves: it excludes the seconds ``after_step`` returns
(duty-cycle sleeps and pauses).

``decide_sleep`` and ``settle`` are the pure accounting (seconds in, seconds out; no clock); ``DutyCycle`` adds the
clock, the waiting and the pause state, with the clock, the wait and the file check injectable so tests run instantly.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MIN_SLEEP_S = 0.005  # shorter owed idle time is carried to the next step: sleeps this short are imprecise
MAX_CREDIT_S = 1.0  # at most this much oversleep is paid back by sleeping less later
POLL_S = 0.1  # while paused, look at the pause flag this often (seconds)
FILE_CHECK_S = 0.5  # look at the pause file at most this often (seconds)


@dataclass(frozen=True)
class SleepDecision:
    """How long to idle after an inner step.

    Attributes:
        sleep_s: seconds to sleep now (0 = none; >= ``min_sleep_s`` otherwise).
        owed_s: idle seconds owed after this step and the idle time already counted, before sleeping
            (negative = credit from earlier oversleeping). Pass it to ``settle`` with the seconds really slept.
        reason: for people (logs), never parsed.
    """

    sleep_s: float
    owed_s: float
    reason: str


def decide_sleep(
    owed_s: float,
    step_s: float,
    fraction: float,
    idle_s: float = 0.0,
    min_sleep_s: float = MIN_SLEEP_S,
    max_credit_s: float = MAX_CREDIT_S,
) -> SleepDecision:
    """Idle time owed after an inner step of ``step_s`` seconds, for a duty cycle of ``fraction``.

    Args:
        owed_s: idle seconds owed before this step (negative = credit), from the previous decision or ``settle``.
        step_s: seconds the inner step took (negative values count as 0).
        fraction: the duty cycle, 0 < fraction <= 1.
        idle_s: seconds already idle since the step (a pause), taken off what is owed.
        min_sleep_s: owed time below this is carried to the next step instead of slept.
        max_credit_s: the credit (negative ``owed_s``) never exceeds this many seconds.

    Returns:
        The sleep to take now and the idle seconds owed before taking it.

    Raises:
        ValueError: ``fraction`` outside (0, 1].
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"duty cycle must be in (0, 1], got {fraction}")
    share = max(step_s, 0.0) * (1.0 / fraction - 1.0)
    owed = max(owed_s + share - max(idle_s, 0.0), -max_credit_s)
    if owed < min_sleep_s:
        why = "credit" if owed < 0 else "carried"
        return SleepDecision(0.0, owed, f"{why}: {owed * 1e3:.1f} ms owed, < {min_sleep_s * 1e3:.1f} ms")
    return SleepDecision(owed, owed, f"sleep {owed * 1e3:.1f} ms (step {step_s * 1e3:.1f} ms at duty cycle {fraction})")


def settle(owed_s: float, slept_s: float, max_credit_s: float = MAX_CREDIT_S) -> float:
    """Idle seconds still owed after really sleeping ``slept_s`` seconds (an oversleep becomes capped credit)."""
    return max(owed_s - max(slept_s, 0.0), -max_credit_s)


def _event_wait(stop: threading.Event, timeout_s: float) -> None:
    stop.wait(timeout_s)


class DutyCycle:
    """The trainer's pacing between inner steps: duty-cycle sleeps and pauses.

    ``after_step`` is called by the train loop (one thread). ``pause``, ``resume`` and ``toggle`` only assign a
    flag, so they may be called from any thread or from a signal handler (no lock is taken; the waiting loop looks
    at the flag every ``poll_s``).

    Args:
        fraction: train at most this fraction of wall time, 0 < fraction <= 1 (1 = never sleep).
        pause_file: while a file exists at this path the peer is paused ("" = no pause file).
        clock: monotonic seconds (injectable for tests).
        wait: ``wait(stop, timeout_s)`` idles up to ``timeout_s`` seconds, returning early once ``stop`` is set.
        exists: ``exists(path)`` tells whether the pause file exists.
        min_sleep_s, max_credit_s: see ``decide_sleep``.
        poll_s: while paused, seconds between looks at the pause flag.
        file_check_s: seconds between looks at the pause file (at most this often, paused or not).

    Raises:
        ValueError: ``fraction`` outside (0, 1] or a non-positive interval.
    """

    def __init__(
        self,
        fraction: float = 1.0,
        pause_file: str = "",
        *,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[threading.Event, float], None] = _event_wait,
        exists: Callable[[str], bool] = os.path.exists,
        min_sleep_s: float = MIN_SLEEP_S,
        max_credit_s: float = MAX_CREDIT_S,
        poll_s: float = POLL_S,
        file_check_s: float = FILE_CHECK_S,
    ):
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"duty cycle must be in (0, 1], got {fraction}")
        if not (poll_s > 0 and file_check_s > 0 and min_sleep_s >= 0 and max_credit_s >= 0):
            raise ValueError("poll_s and file_check_s must be > 0, min_sleep_s and max_credit_s >= 0")
        self.fraction, self.pause_file = fraction, pause_file
        self._clock, self._wait, self._exists = clock, wait, exists
        self.min_sleep_s, self.max_credit_s = min_sleep_s, max_credit_s
        self.poll_s, self.file_check_s = poll_s, file_check_s
        self._flag = False  # pause()/toggle(): a plain bool, so that a signal handler may set it
        self._file_present = False  # the pause file, as last seen
        self._file_checked_at: float | None = None
        self._owed_s = 0.0
        self.slept_s = 0.0  # duty-cycle sleeps in all, seconds
        self.paused_s = 0.0  # pauses in all, seconds

    # ---- pause state ---------------------------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        """Paused by ``pause()``/``toggle()`` or by the pause file (as last checked)."""
        return self._flag or self._file_present

    def pause(self) -> None:
        self._flag = True

    def resume(self) -> None:
        self._flag = False

    def toggle(self) -> bool:
        """Flip the pause flag (SIGUSR1). Returns whether it is now paused by the flag."""
        self._flag = not self._flag
        return self._flag

    @property
    def owed_s(self) -> float:
        """Idle seconds owed (negative = credit); see ``decide_sleep``."""
        return self._owed_s

    def _check_pause_file(self, now: float) -> None:
        if not self.pause_file:
            return
        if self._file_checked_at is not None and now - self._file_checked_at < self.file_check_s:
            return
        self._file_checked_at = now
        present = self._exists(self.pause_file)
        if present != self._file_present:
            if present:
                logger.info("paused: %s exists (remove it to resume)", self.pause_file)
            else:
                logger.info("resumed: %s was removed", self.pause_file)
        self._file_present = present

    # ---- the train loop's call -----------------------------------------------------------------------------------
    def after_step(self, step_s: float, stop: threading.Event) -> float:
        """Idle as the duty cycle and the pause state ask, after an inner step of ``step_s`` seconds.

        Blocks while paused (until resumed or ``stop`` is set, looking at the flag every ``poll_s`` and at the pause
        file every ``file_check_s``), then sleeps what the budget owes (cut short if ``stop`` is set).

        Args:
            step_s: seconds the inner step took (the step only: not the previous call's idle time).
            stop: the trainer's stop event; once set, nothing more is waited for.

        Returns:
            Seconds spent here (sleeping or paused): time the trainer must leave out of ``compute_s``.
        """
        started = self._clock()
        self._check_pause_file(started)
        paused_s = 0.0
        if self.paused and not stop.is_set():
            while self.paused and not stop.is_set():
                self._wait(stop, self.poll_s)
                self._check_pause_file(self._clock())
            paused_s = self._clock() - started
            self.paused_s += paused_s
            logger.debug("inner steps resumed after a pause of %.1fs", paused_s)
        decision = decide_sleep(
            self._owed_s, step_s, self.fraction, paused_s, min_sleep_s=self.min_sleep_s, max_credit_s=self.max_credit_s
        )
        self._owed_s = decision.owed_s
        if decision.sleep_s > 0 and not stop.is_set():
            before = self._clock()
            self._wait(stop, decision.sleep_s)
            slept = self._clock() - before
            self.slept_s += slept
            self._owed_s = settle(self._owed_s, slept, self.max_credit_s)
        return self._clock() - started
