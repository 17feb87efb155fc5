"""Thread stacks on demand: ``kill -USR1 PID`` makes a hivetrain process write every thread's Python stack to its
stderr (its log) and go on. For a process that seems stuck: where each thread waits. Processes forked after
``enable`` (hivemind's DHT process) inherit it: a DHT process that does not start in time is asked for its stacks
before it is stopped (``peers.node.start_node``), and the chaos harness asks every process still running at a
scenario's time limit (``chaos.runner``). Standard library only."""

from __future__ import annotations

import faulthandler
import signal
import sys

_enabled = False


def enable() -> None:
    """Register the SIGUSR1 handler (``faulthandler``, all threads, to stderr). Idempotent. Does nothing when stderr
    is not a file (a CLI entry point called in-process, its output captured): faulthandler writes to a descriptor."""
    global _enabled
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: no fileno()
        return
    _enabled = True


def enabled() -> bool:
    """Whether this process (or the one it was forked from) called ``enable``: SIGUSR1 then dumps stacks instead of
    ending the process (a handler faulthandler installs is not visible to ``signal.getsignal``)."""
    return _enabled
