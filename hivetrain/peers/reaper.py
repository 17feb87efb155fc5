"""A watchdog that ends a peer's helper processes (DHT process, p2pd) if the peer itself dies without cleanup.

``kill -9`` of a peer, an out-of-memory kill or ``os._exit`` skip every ``finally``; hivemind's DHT child process and
its p2pd daemon would then live on, holding ports, on a volunteer's machine. ``start_reaper()`` launches
``python -m hivetrain.peers.reaper --parent PID``, which records the parent's descendants every ``interval_s`` and,
once the parent is gone, SIGKILLs the recorded ones that still exist (matched by PID *and* creation time, so a reused
PID is never touched), then exits. When the parent exits normally it has already stopped them; the reaper just exits.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import psutil


def start_reaper(interval_s: float = 0.5) -> subprocess.Popen:
    """Start the watchdog for the current process. It stops by itself after this process ends."""
    return subprocess.Popen(
        [sys.executable, "-m", "hivetrain.peers.reaper", "--parent", str(os.getpid()), "--interval", str(interval_s)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def watch(parent_pid: int, interval_s: float) -> int:
    """Returns the number of processes it had to kill."""
    me = os.getpid()
    try:
        parent = psutil.Process(parent_pid)
    except psutil.NoSuchProcess:
        return 0
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a SIGTERM to the peer's group must not stop the watchdog first
    known: dict[int, float] = {}
    while True:
        try:
            if not parent.is_running() or parent.status() == psutil.STATUS_ZOMBIE:
                break
            for child in parent.children(recursive=True):
                if child.pid != me:
                    known[child.pid] = child.create_time()
        except psutil.NoSuchProcess:
            break
        time.sleep(interval_s)
    killed = 0
    for pid, created in known.items():
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - created) < 1e-3 and proc.is_running():
                proc.kill()
                killed += 1
        except psutil.NoSuchProcess:
            continue
    return killed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parent", type=int, required=True, help="PID to watch")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between checks")
    args = parser.parse_args()
    watch(args.parent, args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
