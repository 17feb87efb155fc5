"""Pieces shared by the command-line entry points: logging, signals, node flags and run-config overrides."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable

from hivetrain.peers.node import NodeConfig

EXIT_OK, EXIT_BAD_INPUT, EXIT_INCOMPATIBLE, EXIT_FAILED, EXIT_INTERRUPTED = 0, 2, 3, 4, 130


class Interrupted(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT so that blocking calls unwind and cleanup runs."""


MODEL_HELP = (
    "the model: a preset (tiny, small, base), a transformers config.json (fresh weights), or a model directory "
    "(config.json + safetensors) to continue from"
)


def install_signal_handlers() -> None:
    """SIGINT and SIGTERM raise Interrupted in the main thread (once; a second signal exits at once)."""
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


def duty_cycle_arg(text: str) -> float:
    """argparse type of ``--duty-cycle``: a fraction of wall time in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a fraction of wall time in (0, 1]") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a fraction of wall time in (0, 1] (e.g. 0.5), got {text}")
    return value


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING if not verbose else logging.INFO)


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("network")
    group.add_argument(
        "--identity-path",
        default=None,
        help="private key file of this peer (created if missing); keeps the peer ID across restarts",
    )
    group.add_argument(
        "--host-maddrs",
        nargs="+",
        default=["/ip4/0.0.0.0/tcp/0"],
        help="multiaddrs to listen on (tcp/0 = any free port)",
    )
    group.add_argument(
        "--announce-maddrs",
        nargs="+",
        default=[],
        help="multiaddrs others should dial (public IP/port when behind NAT with port forwarding)",
    )
    group.add_argument(
        "--client-mode", action="store_true", help="accept no incoming connections (behind NAT without port forwarding)"
    )
    group.add_argument(
        "--bootstrap-timeout", type=float, default=30.0, help="seconds to wait for an initial peer before giving up"
    )


def node_config(args: argparse.Namespace, initial_peers: list[str]) -> NodeConfig:
    """Raises ValueError for malformed addresses (the message names the address)."""
    return NodeConfig(
        initial_peers=tuple(initial_peers),
        host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs),
        identity_path=args.identity_path,
        startup_timeout_s=args.bootstrap_timeout,
        client_mode=args.client_mode,
    )


def add_run_override_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("run config overrides (only with --config; the coordinator's config wins)")
    group.add_argument("--run-id", default=None, help="name of the run in the DHT")
    group.add_argument(
        "--model",
        default=None,
        help=MODEL_HELP,
    )
    group.add_argument("--inner-steps", type=int, default=None, help="H, inner steps per outer step")
    group.add_argument("--outer-steps", type=int, default=None, help="stop after this many outer steps (0 = never)")
    group.add_argument(
        "--data",
        nargs="+",
        default=None,
        help="text files, directories or globs (default: this machine's Python stdlib sources)",
    )
    group.add_argument("--seq-len", type=int, default=None, help="tokens per training window")
    group.add_argument(
        "--batch-size", type=int, default=None, help="windows per microbatch (diloco.grad_accum_steps per inner step)"
    )


def run_overrides(args: argparse.Namespace) -> dict:
    return {
        "run_id": args.run_id,
        "model": args.model,
        "diloco.inner_steps": args.inner_steps,
        "diloco.outer_steps": args.outer_steps,
        "data.paths": args.data,
        "data.seq_len": args.seq_len,
        "data.batch_size": args.batch_size,
    }


def fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code
