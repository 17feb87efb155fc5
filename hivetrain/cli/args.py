"""The command lines' parsers, kept free of torch, transformers and hivemind: ``--help`` and a wrong flag answer
before the heavy imports (``hivetrain.cli.main`` parses with these first, then imports the command's module).

Nothing here may import torch, transformers or hivemind: ``tests/test_cli_fast_start.py`` checks it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JOIN_SWARM_DESCRIPTION = (
    "``join-swarm ADDRESS [ADDRESS ...]``: join a run and train with DiLoCo until the run ends or Ctrl+C."
)
COORDINATOR_DESCRIPTION = (
    "``hivetrain coordinator --config run.toml``: host the run's bootstrap peer, state copy, checkpoints and dashboard."
)
LOCAL_SWARM_DESCRIPTION = (
    "``hivetrain local-swarm --peers N --out DIR``: a coordinator and N join-swarm processes on 127.0.0.1."
)
REVOKED_SUFFIX = ".revoked.json"
"""Suffix of the invite-only run's revocation list, beside the coordinator's identity file."""

MODEL_HELP = (
    "the model: a preset (tiny, small, base), a transformers config.json (fresh weights), or a model directory "
    "(config.json + safetensors) to continue from"
)


def duty_cycle_arg(text: str) -> float:
    """argparse type of ``--duty-cycle``: a fraction of wall time in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a fraction of wall time in (0, 1]") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a fraction of wall time in (0, 1] (e.g. 0.5), got {text}")
    return value


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


@dataclass(frozen=True)
class RunOverride:
    """A flag that sets one field of the run config (``hivetrain.config.apply_overrides``)."""

    flag: str
    field: str
    """The run config field it sets, dotted (``diloco.inner_steps``)."""
    help: str
    type: Callable[[str], Any] | None = None
    nargs: str | None = None

    @property
    def dest(self) -> str:
        """The argparse attribute the flag parses into (``--inner-steps`` -> ``inner_steps``)."""
        return self.flag.removeprefix("--").replace("-", "_")


RUN_OVERRIDES = (
    RunOverride("--run-id", "run_id", "name of the run in the DHT"),
    RunOverride("--model", "model", MODEL_HELP),
    RunOverride("--inner-steps", "diloco.inner_steps", "H, inner steps per outer step", type=int),
    RunOverride("--outer-steps", "diloco.outer_steps", "stop after this many outer steps (0 = never)", type=int),
    RunOverride(
        "--data",
        "data.paths",
        "text files, directories or globs (default: this machine's Python stdlib sources)",
        nargs="+",
    ),
    RunOverride("--seq-len", "data.seq_len", "tokens per training window", type=int),
    RunOverride(
        "--batch-size", "data.batch_size", "windows per microbatch (diloco.grad_accum_steps per inner step)", type=int
    ),
)
"""Every flag that overrides a run config field, each defined once, in ``--help`` order. Unset (None) = the config's
value (``cli.common.run_overrides``)."""


def add_run_override_arguments(
    parser: argparse.ArgumentParser,
    title: str = "run config overrides (only with --config; the coordinator's config wins)",
    flags: Collection[str] | None = None,
    helps: Mapping[str, str] | None = None,
) -> None:
    """Add the run-override flags (``RUN_OVERRIDES``) to ``parser``, in a group named ``title``.

    Args:
        flags: the flags this command takes (``{"--model", "--data"}``); None = all of them.
        helps: a help text per flag, replacing the shared one where this command treats the flag differently.

    Raises:
        ValueError: ``flags`` or ``helps`` name a flag that ``RUN_OVERRIDES`` does not hold.
    """
    unknown = (set(flags or ()) | set(helps or {})) - {o.flag for o in RUN_OVERRIDES}
    if unknown:
        raise ValueError(f"not run-override flags: {sorted(unknown)}")
    group = parser.add_argument_group(title)
    for override in RUN_OVERRIDES:
        if flags is None or override.flag in flags:
            group.add_argument(
                override.flag,
                type=override.type,
                nargs=override.nargs,
                default=None,
                help=(helps or {}).get(override.flag, override.help),
            )


def add_role_arguments(parser: argparse.ArgumentParser) -> None:
    """``--role`` and ``--stage``: only for pipelined runs (a run config with ``[swarm]``)."""
    group = parser.add_argument_group("pipelined runs (a run config with [swarm]; see README: SWARM pipelines)")
    group.add_argument(
        "--role",
        choices=["auto", "server", "trainer"],
        default=None,
        help="serve a stage or train through the pipeline; auto (default) = serve while a stage has fewer than "
        "swarm.min_servers_per_stage servers, else train if this machine holds the run's data",
    )
    group.add_argument(
        "--stage", type=int, default=None, help="the stage to serve, 0..num_stages-1 (default: the bottleneck stage)"
    )


def join_swarm_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="join-swarm", description=JOIN_SWARM_DESCRIPTION)
    parser.add_argument(
        "addresses", nargs="*", help="multiaddrs of the coordinator or other peers (/ip4/HOST/tcp/PORT/p2p/PEERID)"
    )
    parser.add_argument(
        "--config", default=None, help="run config TOML; without it the coordinator's signed config is used"
    )
    parser.add_argument(
        "--config-timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the coordinator's config to appear in the DHT",
    )
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default=None,
        help="where inner steps run (default auto = cuda if available; a pipelined run's stage servers default to "
        "the run's swarm.device)",
    )
    parser.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0 = torch's default)")
    parser.add_argument(
        "--node-sharding",
        choices=["auto", "ddp", "fsdp"],
        default="auto",
        help="under torchrun --nproc-per-node N: ddp = every rank holds the whole model; fsdp = each holds 1/N of the "
        "parameters, gradients and AdamW state (FSDP2), for a model that does not fit one GPU; auto = fsdp on GPUs "
        "when the memory preflight finds the model does not fit one whole, else ddp",
    )
    parser.add_argument(
        "--model-path",
        default=None,
        metavar="PATH",
        help="this machine's copy of the run's model files (config.json or model directory) when they are not at "
        "the path the run config names; verified against the run by the model fingerprint (weights' sha256)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check this machine against the run (reachability, device, speed, link rates) and print its predicted "
        "contribution, then exit without joining",
    )
    parser.add_argument("--json", action="store_true", help="with --check: print the checks as JSON")
    parser.add_argument(
        "--skip-memory-check",
        action="store_true",
        help="train even if the memory preflight estimates that the model does not fit on the device",
    )
    parser.add_argument("--metrics-file", default=None, help="append JSON-lines metrics here")
    parser.add_argument("--summary-file", default=None, help="write a JSON summary here when the peer stops")
    parser.add_argument(
        "--dht-lost-timeout",
        type=float,
        default=60.0,
        help="seconds without a working DHT (e.g. p2pd died) before the peer gives up and exits",
    )
    parser.add_argument("--public-name", default="", help="name shown on the contributors' board (<= 64 chars)")
    parser.add_argument(
        "--join-token",
        default="",
        metavar="TOKEN|@FILE",
        help="join token of an invite-only run (from `hivetrain coordinator invite YOUR_PEER_ID`), or @FILE holding "
        "it; valid only with the --identity-path it was made for",
    )
    share = parser.add_argument_group("sharing this machine (see README: Sharing your machine)")
    share.add_argument(
        "--duty-cycle",
        type=duty_cycle_arg,
        default=1.0,
        metavar="F",
        help="train at most this fraction of wall time, 0 < F <= 1, sleeping between inner steps (1 = never sleep)",
    )
    share.add_argument(
        "--pause-file",
        default="",
        metavar="PATH",
        help="pause inner steps while this file exists (checked every 0.5 s; the peer stays in the swarm). "
        "SIGUSR1 also pauses and resumes",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    add_role_arguments(parser)
    add_node_arguments(parser)
    add_run_override_arguments(parser)
    return parser


def coordinator_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hivetrain coordinator",
        description=COORDINATOR_DESCRIPTION,
        epilog="subcommands: 'hivetrain coordinator invite PEER_ID --config run.toml' signs a join token for an "
        "invite-only run; 'hivetrain coordinator revoke PEER_ID' voids that peer's tokens (each has its own --help)",
    )
    parser.add_argument("--config", default=None, help="run config TOML (default: built-in defaults)")
    parser.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        help="peers of the running swarm to bootstrap from (e.g. after a restart on a new address)",
    )
    parser.add_argument(
        "--address-file", default=None, help="write the multiaddrs volunteers should use here, one per line, once ready"
    )
    parser.add_argument(
        "--metrics-file",
        default=None,
        help="append JSON lines here: each state the coordinator adopts or refuses, each checkpoint it writes",
    )
    parser.add_argument(
        "--refresh-interval",
        type=float,
        default=10.0,
        help="seconds between re-publishing the config and reading the swarm",
    )
    state = parser.add_argument_group("state copy and checkpoints")
    state.add_argument(
        "--no-state",
        action="store_true",
        help="only bootstrap and publish the config: keep no state copy, serve none, write no checkpoint",
    )
    state.add_argument(
        "--checkpoint-dir",
        default=None,
        help="directory for checkpoints (safetensors + manifest); restored from on restart",
    )
    state.add_argument("--checkpoint-every", type=int, default=1, help="checkpoint every N epochs (0 = never)")
    state.add_argument("--keep-checkpoints", type=int, default=3, help="keep the newest K complete checkpoints")
    parser.add_argument(
        "--revocations",
        default=None,
        help="invite-only runs: the revocation list to publish, re-read at every refresh (default: the identity "
        f"file + {REVOKED_SUFFIX!r}, where `hivetrain coordinator revoke PEER_ID` writes)",
    )
    web = parser.add_argument_group("dashboard")
    web.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve the dashboard, JSON API and /metrics on this port (0 = any free port; unset = off)",
    )
    web.add_argument(
        "--http-host", default="127.0.0.1", help="dashboard bind address (0.0.0.0 to publish it; it exposes no secret)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    add_node_arguments(parser)
    add_run_override_arguments(parser)
    parser.set_defaults(identity_path="coordinator.key")
    return parser


def duty_cycles_arg(text: str) -> list[float]:
    """argparse type of ``--duty-cycles``: comma-separated fractions of wall time, each in (0, 1]."""
    try:
        return [duty_cycle_arg(part.strip()) for part in text.split(",")]
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"each value {exc}") from None


def local_swarm_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hivetrain local-swarm", description=LOCAL_SWARM_DESCRIPTION)
    parser.add_argument("--peers", type=int, default=None, help="number of training peers (>= 1; default 3)")
    parser.add_argument("--out", required=True, help="directory for logs, metrics and summary.json")
    parser.add_argument("--config", default=None, help="run config TOML (default: built-in defaults)")
    parser.add_argument("--threads-per-peer", type=int, default=1, help="torch CPU threads of each peer")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before everything is stopped")
    parser.add_argument("--peer-args", default="", help="extra join-swarm arguments for every peer (one string)")
    parser.add_argument(
        "--duty-cycles",
        type=duty_cycles_arg,
        default=None,
        metavar="F1,F2,...",
        help="each peer's join-swarm --duty-cycle, one per peer (e.g. 1,0.5,0.25: peers 2x and 4x slower)",
    )
    parser.add_argument(
        "--dashboard-port",
        type=int,
        default=None,
        help="serve the coordinator's dashboard on 127.0.0.1:PORT (0 = any free port)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging in peers")
    pipe = parser.add_argument_group("SWARM pipeline (for models too big for one volunteer; see README)")
    pipe.add_argument(
        "--pipeline",
        type=int,
        default=0,
        metavar="STAGES",
        help="cut the model into this many stages served by separate processes (0 = the config's [swarm] table if "
        "it has one, else data-parallel DiLoCo)",
    )
    pipe.add_argument("--servers-per-stage", type=int, default=None, help="stage servers per stage (default 2)")
    pipe.add_argument(
        "--trainers", type=int, default=None, help="pipeline trainer processes, they hold the data (default 2)"
    )
    pipe.add_argument(
        "--steps", type=int, default=None, help="steps per pipeline trainer (default: swarm.trainer_steps, or 30)"
    )
    add_run_override_arguments(
        parser,
        "run config overrides (over --config, if given)",
        flags={"--model", "--inner-steps", "--outer-steps", "--data"},
        helps={"--outer-steps": "K, outer steps to train (default: the config's, or 5 if it trains forever)"},
    )
    return parser


def export_parser() -> argparse.ArgumentParser:
    """``hivetrain export CKPT --out DIR`` (``hivetrain.cli.export.main``)."""
    from hivetrain.config import MODEL_PRESETS  # pydantic, not torch

    parser = argparse.ArgumentParser(
        prog="hivetrain export",
        description="Export a checkpoint's parameters as a transformers model directory (from_pretrained-ready).",
    )
    parser.add_argument("checkpoint", type=Path, help="a checkpoint directory (epoch-N) or a checkpoint store root")
    parser.add_argument("--out", type=Path, required=True, help="output directory to create")
    parser.add_argument("--preset", choices=MODEL_PRESETS, help="model preset; default: the run config's model")
    parser.add_argument(
        "--model",
        metavar="PATH",
        help="this machine's copy of the run's model files (config.json or model directory) when they are not at "
        "the path the run config names",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="tokenizer directory to write into --out; default: the run's data.tokenizer, or bytes if it has none",
    )
    parser.add_argument(
        "--max-seq-len",
        type=int,
        help="positions in a preset's exported config, tokens; default: the run's data.seq_len",
    )
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    return parser
