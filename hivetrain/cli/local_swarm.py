"""``hivetrain local-swarm --peers N --out DIR``: a coordinator and N join-swarm processes on 127.0.0.1.

Waits until the peers finish K outer steps, prints a summary table and writes ``DIR/summary.json`` (README,
"local-swarm output"): which peers left, when and why; whether the state hashes agree among how many peers; the
DDP-equivalent bytes of the inner steps run; each peer's compute. Exits 0 only if every peer finished (see
``run_exit_code``).

``--pipeline STAGES`` (or a ``--config`` with a ``[swarm]`` table) runs a SWARM pipeline instead: the same coordinator
and join-swarm processes, as stage servers and pipeline trainers (``pipeline_plan`` maps every flag or refuses it).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tomli_w
from rich.console import Console
from rich.table import Table

from hivetrain.cli.args import local_swarm_parser as build_parser
from hivetrain.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    Interrupted,
    fail,
    install_signal_handlers,
    run_overrides,
    setup_logging,
)
from hivetrain.config import RunConfig, apply_overrides, load_run_config
from hivetrain.localswarm.launcher import LocalSwarm
from hivetrain.localswarm.summary import PeerFiles, build_summary, read_events

logger = logging.getLogger("hivetrain.local_swarm")


PIPELINE_ONLY_FLAGS = {"servers_per_stage": "--servers-per-stage", "trainers": "--trainers", "steps": "--steps"}
PIPELINE_REFUSED_FLAGS = {
    "peers": "--peers: a pipelined local swarm runs --servers-per-stage x STAGES servers and --trainers trainers",
    "outer_steps": "--outer-steps: a pipelined run is as long as its trainers' --steps (each stage takes an outer "
    "step every diloco.inner_steps inner steps)",
    "duty_cycles": "--duty-cycles: stage servers and pipeline trainers do not throttle themselves",
}
DEFAULT_PIPELINE_STEPS = 30
DEFAULT_SERVERS_PER_STAGE = 2
DEFAULT_TRAINERS = 2


@dataclass(frozen=True)
class PipelinePlan:
    """What ``local-swarm`` starts for a pipelined run: every flag lands in one of these fields or is refused
    (``pipeline_plan``)."""

    run: RunConfig
    servers_per_stage: int
    trainers: int
    threads_per_process: int
    timeout_s: float
    verbose: bool
    extra_args: tuple[str, ...]
    coordinator_args: tuple[str, ...]


def is_pipelined(args: argparse.Namespace) -> bool:
    """Whether ``local-swarm`` runs a pipeline: ``--pipeline N`` or a ``--config`` with a ``[swarm]`` table.

    Raises:
        ValueError, FileNotFoundError: an unreadable or invalid ``--config``.
    """
    return bool(args.pipeline) or (args.config is not None and load_run_config(args.config).pipelined)


def pipeline_plan(args: argparse.Namespace) -> PipelinePlan:
    """Map local-swarm's flags onto a pipelined run: ``--config`` (its ``[swarm]`` table, if any, is the base;
    without one the ``default_run`` demo settings), ``--pipeline`` -> ``swarm.num_stages``, ``--model``,
    ``--inner-steps`` -> ``diloco.inner_steps``, ``--data`` -> ``data.paths``, ``--steps`` -> ``swarm.trainer_steps``,
    ``--peer-args`` -> every join-swarm process, ``--dashboard-port`` -> the coordinator's ``--http-port``, ``-v`` ->
    ``--verbose`` everywhere. ``--peers``, ``--outer-steps`` and ``--duty-cycles`` are refused.

    Raises:
        ValueError: a refused flag (the message names it and why), counts below 1, or an invalid config.
        FileNotFoundError: ``--config`` does not exist.
    """
    from hivetrain.swarm.local import default_run

    for dest, why in PIPELINE_REFUSED_FLAGS.items():
        if getattr(args, dest) is not None:
            raise ValueError(f"not with a pipeline: {why}")
    for dest, flag in (("servers_per_stage", "--servers-per-stage"), ("trainers", "--trainers"), ("steps", "--steps")):
        value = getattr(args, dest)
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.pipeline < 0:
        raise ValueError(f"--pipeline must be >= 0 stages, got {args.pipeline}")
    base = load_run_config(args.config) if args.config is not None else default_run("tiny", seed=0)
    steps = args.steps or base.swarm.trainer_steps or DEFAULT_PIPELINE_STEPS
    overrides = {**run_overrides(args), "swarm.num_stages": args.pipeline or None, "swarm.trainer_steps": steps}
    run = RunConfig.from_dict(apply_overrides(base.to_dict(), overrides))
    coordinator_args = ("--http-port", str(args.dashboard_port)) if args.dashboard_port is not None else ()
    return PipelinePlan(
        run=run,
        servers_per_stage=args.servers_per_stage or DEFAULT_SERVERS_PER_STAGE,
        trainers=args.trainers or DEFAULT_TRAINERS,
        threads_per_process=args.threads_per_peer,
        timeout_s=args.timeout,
        verbose=args.verbose,
        extra_args=tuple(args.peer_args.split()),
        coordinator_args=coordinator_args,
    )


def run_pipeline(args: argparse.Namespace) -> int:
    """A local SWARM pipeline (``hivetrain.swarm.local``): a coordinator and join-swarm processes."""
    from hivetrain.swarm.local import run_local_pipeline

    console = Console(stderr=True)
    try:
        plan = pipeline_plan(args)
        from hivetrain.data import resolve_files

        resolve_files(plan.run.data.paths)
        summary = run_local_pipeline(
            Path(args.out),
            plan.run,
            plan.servers_per_stage,
            plan.trainers,
            threads_per_process=plan.threads_per_process,
            timeout_s=plan.timeout_s,
            verbose=plan.verbose,
            extra_args=plan.extra_args,
            coordinator_args=plan.coordinator_args,
        )
    except (ValueError, FileNotFoundError) as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    except Interrupted:
        return EXIT_INTERRUPTED
    except RuntimeError as exc:
        return fail(str(exc), EXIT_FAILED)
    table = Table(title="local pipeline summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if isinstance(value, (int, float, str, bool)) or value is None:
            table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    table.add_row("outer steps per stage", str(summary.get("outer_steps")))
    table.add_row("servers of a stage at one epoch hold one state", str(summary.get("stage_hashes_agree")))
    console.print(table)
    console.print(f"summary written to {Path(args.out) / 'summary.json'}")
    trainers_ok = all(summary["exit_codes"].get(f"trainer{i}") == 0 for i in range(plan.trainers))
    return 0 if trainers_ok and not summary.get("timed_out") else EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(False)
    install_signal_handlers()
    if args.threads_per_peer < 1 or args.timeout <= 0:
        return fail("--threads-per-peer must be >= 1 and --timeout > 0", EXIT_BAD_INPUT)
    try:
        pipelined = is_pipelined(args)
    except (ValueError, FileNotFoundError) as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    if pipelined:
        return run_pipeline(args)
    given = [flag for dest, flag in PIPELINE_ONLY_FLAGS.items() if getattr(args, dest) is not None]
    if given:
        why = "only for a pipeline (--pipeline STAGES or a config with [swarm])"
        return fail(f"{', '.join(given)}: {why}", EXIT_BAD_INPUT)
    args.peers = 3 if args.peers is None else args.peers
    if (
        args.peers < 1
        or (args.outer_steps is not None and args.outer_steps < 1)
        or args.threads_per_peer < 1
        or args.timeout <= 0
    ):
        return fail("--peers, --outer-steps and --threads-per-peer must be >= 1 and --timeout > 0", EXIT_BAD_INPUT)
    if args.duty_cycles is not None and len(args.duty_cycles) != args.peers:
        return fail(
            f"--duty-cycles gives {len(args.duty_cycles)} value(s) for {args.peers} peer(s): give one per peer",
            EXIT_BAD_INPUT,
        )
    out = Path(args.out)
    try:
        overrides = run_overrides(args)
        config = load_run_config(args.config, overrides)
        if config.diloco.outer_steps == 0:  # a local swarm must end: train K=5 unless told otherwise
            config = load_run_config(args.config, {**overrides, "diloco.outer_steps": 5})
        from hivetrain.data import resolve_files

        resolve_files(config.data.paths)
    except (ValueError, FileNotFoundError) as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "run.toml"
    config_path.write_text(tomli_w.dumps(config.to_dict()))

    console = Console(stderr=True)
    swarm = LocalSwarm(out, config_path, threads_per_peer=args.threads_per_peer, verbose=args.verbose)
    started = time.time()
    seen: dict[str, int] = {}
    try:
        # moshpit/gossip peers hold different states by design: there is no one state to checkpoint
        coordinator_args = ["--checkpoint-dir", str(out / "checkpoints")] if config.averaging.exact_average else []
        if args.dashboard_port is not None:
            coordinator_args += ["--http-port", str(args.dashboard_port)]
        address = swarm.start_coordinator(extra_args=coordinator_args)
        console.print(
            f"coordinator up at [bold]{address}[/]; starting {args.peers} peer(s), "
            f"model {config.model}, H={config.diloco.inner_steps}, K={config.diloco.outer_steps}"
        )
        for i in range(args.peers):
            duty = ["--duty-cycle", str(args.duty_cycles[i])] if args.duty_cycles else []
            swarm.add_peer([*args.peer_args.split(), *duty])

        def poll() -> None:
            for peer in swarm.peers:
                events = [e for e in read_events(peer.metrics_path) if e["event"] in ("outer_step", "eval")]
                for e in events[seen.get(peer.name, 0) :]:
                    if e["event"] == "eval":  # an evaluation that ran beside the next phase (diloco.eval_overlap)
                        console.print(f"{peer.name}: epoch {e['epoch']}  eval loss {e['eval_loss']:.3f} (background)")
                        continue
                    loss = f"{e['eval_loss']:.3f}" if e.get("eval_loss") is not None else "-"
                    console.print(
                        f"{peer.name}: epoch {e['epoch']}  eval loss {loss}  group {e['group_size']}  "
                        f"state {e['state_hash'][:10]}  (+{time.time() - started:.0f}s)"
                    )
                seen[peer.name] = len(events)

        finished = swarm.wait_peers(args.timeout, poll=poll)
        poll()
    except Interrupted:
        swarm.close()
        return EXIT_INTERRUPTED
    except RuntimeError as exc:
        swarm.close()
        return fail(str(exc), EXIT_FAILED)
    stopped = {p.name for p in swarm.peers if p.alive()}  # still running at the deadline
    swarm.close()
    summary = build_summary(
        [PeerFiles.of(p, stopped=p.name in stopped) for p in swarm.peers],
        config.diloco.inner_steps,
        wall_s=time.time() - started,
        batch_size=config.diloco.samples_per_inner_step(config.data.batch_size),
        started_at=started,
        exact_average=config.averaging.exact_average,
    )
    summary["timed_out"] = not finished
    summary["exit_codes"] = {p.name: p.popen.returncode for p in swarm.peers}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _print_summary(console, summary, out)
    return run_exit_code(summary)


def run_exit_code(summary: dict) -> int:
    """0 only when the run finished in time, every peer exited 0 (none left with an error or was stopped) and no
    two peers held different states at one epoch; else EXIT_FAILED."""
    failed = (
        summary.get("timed_out")
        or any(code != 0 for code in summary.get("exit_codes", {}).values())
        or summary.get("peers_left")
        or summary.get("hash_agreement", {}).get("verdict") == "no"
    )
    return EXIT_FAILED if failed else 0


def _print_summary(console: Console, summary: dict, out: Path) -> None:
    table = Table(title="local swarm summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else str(v)  # noqa: E731
    for key in (
        "outer_steps",
        "initial_eval_loss",
        "final_eval_loss",
        "wall_s",
        "bytes_sent_total",
        "inner_steps_total",
        "bytes_ddp_equivalent",
        "rounds_failed",
        "state_downloads",
    ):
        table.add_row(key, fmt(summary.get(key)))
    if summary.get("bytes_sent_total", 0) > 0 and summary.get("bytes_ddp_equivalent", 0) > 0:
        table.add_row(
            "DDP bytes / DiLoCo bytes", f"{summary['bytes_ddp_equivalent'] / summary['bytes_sent_total']:.1f}x"
        )
    table.add_row("state hashes agree at every epoch", summary["hash_agreement"]["text"])
    drift = summary.get("param_drift") or {}
    if drift:
        last_epoch = max(drift, key=int)
        table.add_row(
            "parameter drift max_p |θp-θ̄|/|θ̄| (last epoch / worst)",
            f"{drift[last_epoch]:.2e} / {max(drift.values()):.2e}",
        )
    per_peer = summary.get("per_peer") or {}
    if per_peer:
        table.add_row(
            "compute utilization (compute_s / wall_s)",
            ", ".join(
                f"{name} {'-' if p['compute_utilization'] is None else format(p['compute_utilization'], '.2f')}"
                for name, p in per_peer.items()
            ),
        )
        table.add_row(
            "samples committed / computed",
            ", ".join(f"{name} {p['samples_committed']}/{p['samples_computed']}" for name, p in per_peer.items()),
        )
    table.add_row("peers that left", str(len(summary.get("peers_left", []))))
    console.print(table)
    if summary.get("peers_left"):
        left = Table(title="peers that left")
        for column in ("peer", "exit code", "last epoch", "at (s)", "reason"):
            left.add_column(column)
        for p in summary["peers_left"]:
            at = "-" if p["at_s"] is None else f"{p['at_s']:.0f}"
            left.add_row(p["name"], str(p["exit_code"]), str(p["epoch"]), at, p["reason"])
        console.print(left)
    console.print(f"summary written to {out / 'summary.json'}; peer logs in {out}")


if __name__ == "__main__":
    sys.exit(main())
