"""CPU hogs: busy-loop processes that load the machine beside a test, the way a volunteer's game or compile does.

Each hog is a plain ``python -c`` busy loop in its own session, so a signal to a test's process group never reaches
it and the hogs never signal anyone. A hog ends by itself after ``max_duration_s`` or as soon as the process that
started it is gone (its parent PID changes), so a crashed test run leaves no hog spinning; ``CpuHogs.stop`` ends the
ones still running by PID.

Used by the ``cpu_hogs`` pytest fixture (``tests/conftest.py``) and from a shell beside a whole suite::

    python -m hivetrain.testing.hogs --count 2 --duration-s 1500 &
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

HOG_CODE = """
import os, sys, time
parent, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline and os.getppid() == parent:
    for _ in range(200_000):
        pass
"""
"""The busy loop: argv = (parent PID, max duration in seconds). It checks its clock and parent every ~10 ms of
CPU."""

DEFAULT_MAX_DURATION_S = 1200.0


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` in seconds (``/proc/PID/stat``); 0.0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return 0.0
    fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": state ppid ... utime(12) stime(13)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class CpuHogs:
    """``count`` busy-loop processes; ``start()`` launches them, ``stop()`` ends them by PID and reports.

    Args:
        count: number of hogs (each wants one full core).
        max_duration_s: a hog exits by itself after this many seconds, whatever happens to its starter.
    """

    count: int
    max_duration_s: float = DEFAULT_MAX_DURATION_S
    popens: list[subprocess.Popen] = field(default_factory=list)
    started_at: float = 0.0
    cpu_s: list[float] = field(default_factory=list)
    """CPU seconds each hog had used when ``stop()`` ended it."""
    exited_early: list[int] = field(default_factory=list)
    """PIDs of hogs that had already exited when ``stop()`` came (the load was not there to the end)."""
    stopped: bool = False

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count}")
        if self.max_duration_s <= 0:
            raise ValueError(f"max_duration_s must be > 0, got {self.max_duration_s}")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.popens]

    def start(self) -> CpuHogs:
        """Launch the hogs (returns at once; they spin until stopped, their deadline, or this process's end)."""
        assert not self.popens, "start() once"
        self.started_at = time.monotonic()
        for _ in range(self.count):
            self.popens.append(
                subprocess.Popen(
                    [sys.executable, "-c", HOG_CODE, str(os.getpid()), str(self.max_duration_s)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,  # no test's signal to its own group reaches a hog
                )
            )
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGKILL every hog still running, by PID, and reap it; records ``cpu_s`` and ``exited_early``. Only the
        first call does anything.

        Args:
            timeout_s: how long to wait for each killed hog to be reaped, seconds.
        """
        if self.stopped:
            return
        self.stopped = True
        for popen in self.popens:
            if popen.poll() is not None:
                self.exited_early.append(popen.pid)
                self.cpu_s.append(0.0)
                continue
            self.cpu_s.append(_cpu_seconds(popen.pid))
            try:
                os.kill(popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for popen in self.popens:
            try:
                popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass

    def describe(self) -> str:
        """One line: how many hogs, for how long, and the CPU they got."""
        wall_s = time.monotonic() - self.started_at if self.started_at else 0.0
        cpu = ", ".join(f"{c:.0f}" for c in self.cpu_s) or "-"
        return f"{self.count} CPU hog(s) for {wall_s:.0f} s (CPU seconds each: {cpu})"

    def __enter__(self) -> CpuHogs:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m hivetrain.testing.hogs``: run hogs in the foreground until Ctrl+C, SIGTERM or the duration ends."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=4, help="number of busy-loop processes (default 4)")
    parser.add_argument(
        "--duration-s", type=float, default=DEFAULT_MAX_DURATION_S, help="seconds until the hogs end by themselves"
    )
    args = parser.parse_args(argv)
    if args.count < 1 or args.duration_s <= 0:
        parser.error("--count must be >= 1 and --duration-s > 0")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    hogs = CpuHogs(args.count, args.duration_s)
    try:
        hogs.start()
        print(f"{args.count} CPU hog(s): PIDs {hogs.pids}, ending by themselves in {args.duration_s:g} s", flush=True)
        deadline = time.monotonic() + args.duration_s
        while time.monotonic() < deadline and any(p.poll() is None for p in hogs.popens):
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        hogs.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
