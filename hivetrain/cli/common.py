"""Pieces shared by the command-line entry points: logging, signals, node flags and run-config overrides."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hivetrain.cli.args import RUN_OVERRIDES

if TYPE_CHECKING:
    from hivetrain.peers.node import NodeConfig

EXIT_OK, EXIT_BAD_INPUT, EXIT_INCOMPATIBLE, EXIT_FAILED, EXIT_INTERRUPTED = 0, 2, 3, 4, 130


class Interrupted(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT so that blocking calls unwind and cleanup runs."""


def install_signal_handlers() -> None:
    """SIGINT and SIGTERM raise Interrupted in the main thread (once; a second signal exits at once). SIGUSR1 writes
    every thread's Python stack to stderr (the log) and goes on: ``kill -USR1 PID`` shows where a peer that seems
    stuck is waiting (the chaos harness sends it to every process still running at a scenario's time limit)."""
    from hivetrain.peers import stacks

    stacks.enable()
    state = {"count": 0}
    main_pid = os.getpid()

    def handler(signum, _frame):
        if os.getpid() != main_pid:  # a forked helper (hivemind's DHT process) inherited us: die as it expects
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        state["count"] += 1
        if state["count"] > 1:
            os._exit(EXIT_INTERRUPTED)
        raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def install_pause_handler(toggle: Callable[[], bool]) -> object:
    """SIGUSR1 calls ``toggle()`` (e.g. ``DutyCycle.toggle``: pause or resume inner steps without leaving the swarm)
    and logs the new state. ``toggle`` must be signal-safe (take no lock). Returns the previous handler.

    A forked helper that inherited the handler (hivemind's DHT process) ignores the signal instead of dying of it.
    """
    main_pid = os.getpid()
    log = logging.getLogger("hivetrain.cli")

    def handler(_signum, _frame):
        if os.getpid() != main_pid:
            return
        if toggle():
            log.info("paused (SIGUSR1 again to resume): inner steps stop after the current one; still in the swarm")
        else:
            log.info("resumed")

    return signal.signal(signal.SIGUSR1, handler)


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING if not verbose else logging.INFO)


def node_config(args: argparse.Namespace, initial_peers: list[str]) -> NodeConfig:
    """Raises ValueError for malformed addresses (the message names the address)."""
    from hivetrain.peers.node import NodeConfig

    return NodeConfig(
        initial_peers=tuple(initial_peers),
        host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs),
        identity_path=args.identity_path,
        startup_timeout_s=args.bootstrap_timeout,
        client_mode=args.client_mode,
    )


def run_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The run config overrides the command line gives: ``{"diloco.inner_steps": 20, ...}``, one per flag of
    ``cli.args.RUN_OVERRIDES``; None where the flag was not given or the command has none (``apply_overrides`` skips
    those)."""
    return {o.field: getattr(args, o.dest, None) for o in RUN_OVERRIDES}


def fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def data_plane_hosts(args) -> tuple[str, str | None]:
    """(listen host, announce host or None) of a peer's data plane, from ``--host-maddrs`` and ``--announce-maddrs``."""
    from hivetrain.peers.node import ip_of

    listen = next(filter(None, map(ip_of, args.host_maddrs)), "0.0.0.0")
    announce = next(filter(None, map(ip_of, args.announce_maddrs)), None)
    return listen, announce
