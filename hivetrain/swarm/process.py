"""Entry points of the real processes a pipelined swarm runs: ``python -m hivetrain.swarm.server`` / ``.trainer``.

Both read one JSON config file (``write_process_config``: the ``RunConfig`` and the ``SwarmConfig``), start a DHT
node bootstrapping from ``--initial-peers`` and run until done (trainer) or SIGTERM (server). Each writes a JSON
stats file (``--stats-file``) on exit; the trainer also appends one JSON line per step to ``--metrics-file``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

import torch
from pydantic import TypeAdapter
from transformers import LlamaConfig

from hivetrain.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    Interrupted,
    add_node_arguments,
    fail,
    install_signal_handlers,
    node_config,
    setup_logging,
)
from hivetrain.config import RunConfig, to_plain
from hivetrain.data import vocab_size_of
from hivetrain.faults import FaultInjector, parse_fault_spec
from hivetrain.model import build_run_model, resolve_model_source
from hivetrain.peers.node import PeerNode
from hivetrain.swarm.config import SwarmConfig

logger = logging.getLogger(__name__)


def write_process_config(path: Path, run: RunConfig, swarm: SwarmConfig) -> None:
    path.write_text(json.dumps({"run": run.to_dict(), "swarm": to_plain(dataclasses.asdict(swarm))}, indent=2))


def read_process_config(path: Path) -> tuple[RunConfig, SwarmConfig]:
    """Raises ValueError (naming the field) for an invalid file, FileNotFoundError if it is missing."""
    raw = json.loads(Path(path).read_text())
    if set(raw) != {"run", "swarm"}:
        raise ValueError(f"{path}: expected keys 'run' and 'swarm', got {sorted(raw)}")
    return RunConfig.from_dict(raw["run"]), TypeAdapter(SwarmConfig).validate_python(raw["swarm"])


def describe_model(run: RunConfig) -> tuple[LlamaConfig, str]:
    """The uncut model's config and fingerprint (shapes only: built on the meta device, no memory)."""
    if resolve_model_source(run.model).kind == "pretrained":
        raise ValueError(
            f"model {run.model!r}: SWARM pipeline stages start from fresh weights only; give a config.json (or a "
            "directory without weights) or train the pretrained model with join-swarm (DiLoCo)"
        )
    config, _, fingerprint = build_run_model(run, vocab_size_of(run.data), meta=True)
    if not isinstance(config, LlamaConfig):
        raise ValueError(
            f"model {run.model!r} is a {config.model_type} model; SWARM pipeline stages cut Llama models only"
        )
    config._attn_implementation = "sdpa"
    return config, fingerprint


def group_averager_factory(run: RunConfig, faults: FaultInjector, listen_host: str, timeout_s: float = 30.0):
    """An ``AveragerFactory`` building hivetrain's ``GroupAverager`` for one stage."""

    def make(node, prefix: str):
        from hivetrain.averaging import GroupAverager

        averager = GroupAverager(
            node, prefix=f"{prefix}.avg", config=run.averaging, faults=faults, listen_host=listen_host
        )
        averager.start()
        averager.wait_ready(timeout_s)
        return averager

    return make


def _common_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="JSON process config (run + swarm), see write_process_config")
    parser.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs of running peers")
    parser.add_argument("--stats-file", default=None, help="write a JSON stats file here on exit")
    parser.add_argument("--fault", action="append", default=[], help="POINT:ACTION[:SECONDS][@KEY=VALUE,...]")
    parser.add_argument("--verbose", action="store_true")
    add_node_arguments(parser)
    return parser


def server_main(argv: list[str] | None = None) -> int:
    """Run a stage server until SIGTERM/SIGINT."""
    from hivetrain.peers.node import start_node
    from hivetrain.swarm.server import StageServer

    parser = _common_parser("Serve one stage of a pipelined (SWARM) model.")
    parser.add_argument("--stage", default="auto", help="stage index, or 'auto' = the least-served stage")
    parser.add_argument("--listen-host", default="0.0.0.0", help="address the stage averager's data port binds")
    parser.add_argument("--address-file", default=None, help="write this server's multiaddrs here once serving")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    install_signal_handlers()
    try:
        run, swarm = read_process_config(Path(args.config))
        faults = FaultInjector()
        for spec in args.fault:
            faults.arm(parse_fault_spec(spec))
        stage = None if args.stage == "auto" else int(args.stage)
        model_config, fingerprint = describe_model(run)
        node = start_node(dataclasses.replace(node_config(args, args.initial_peers), run_ids=(run.run_id,)))
    except (ValueError, FileNotFoundError) as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    server = None
    started = time.time()
    try:
        if swarm.num_threads:
            torch.set_num_threads(swarm.num_threads)
        factory = group_averager_factory(run, faults, args.listen_host) if swarm.average_stage else None
        server = StageServer(node, run, swarm, model_config, fingerprint, stage, faults, factory)
        server.start()
        if args.address_file:
            Path(args.address_file).write_text("\n".join(node.visible_maddrs()))
        while True:
            time.sleep(1.0)
    except Interrupted:
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - report and exit non-zero
        logger.exception("stage server failed")
        return fail(repr(exc), EXIT_FAILED)
    finally:
        if server is not None:
            server.shutdown()  # first: an outer step in progress gets to finish (bounded), and the stats count it
            if args.stats_file:
                Path(args.stats_file).write_text(json.dumps(server_stats(server, started), indent=2))
        node.shutdown()


def server_stats(server, started: float) -> dict:
    rt = server.runtime
    return {
        "peer_id": server.node.peer_id,
        "stage": rt.spec.index if rt else None,
        "epoch": rt.state.epoch if rt else 0,
        "state_hash": rt.state.state_hash() if rt else "",
        "forward": rt.num_forward if rt else 0,
        "backward": rt.num_backward if rt else 0,
        "expired": rt.num_expired if rt else 0,
        "throughput": rt.throughput() if rt else 0.0,
        "rebalances": server.rebalances,
        "rebalance_reasons": server.rebalance_reasons,
        "state_downloads": server.state_downloads,
        "outer_steps": dict(server.outer_steps),
        "wall_s": time.time() - started,
    }


def trainer_main(argv: list[str] | None = None) -> int:
    """Train through the stage servers for ``--steps`` steps (or until SIGTERM); 0 on success."""
    from hivetrain.peers.node import start_node

    parser = _common_parser("Train a pipelined (SWARM) model through its stage servers.")
    parser.add_argument("--steps", type=int, required=True, help="trainer steps to run (0 = until interrupted)")
    parser.add_argument("--metrics-file", default=None, help="append one JSON line per step here")
    parser.add_argument("--eval-windows", type=int, default=8, help="held-out windows evaluated at start and end")
    parser.add_argument("--index", type=int, default=0, help="this trainer's index (seeds its data stream)")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    install_signal_handlers()
    try:
        run, swarm = read_process_config(Path(args.config))
        node = start_node(dataclasses.replace(node_config(args, args.initial_peers), run_ids=(run.run_id,)))
    except (ValueError, FileNotFoundError) as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    stats: dict = {}
    try:
        if swarm.num_threads:
            torch.set_num_threads(swarm.num_threads)
        stats = run_training(node, run, swarm, args.steps, args.index, args.metrics_file, args.eval_windows)
        return EXIT_OK if stats.get("completed") else EXIT_FAILED
    except Interrupted:
        stats["interrupted"] = True
        return EXIT_INTERRUPTED
    finally:
        if args.stats_file:
            Path(args.stats_file).write_text(json.dumps(stats, indent=2, default=str))
        node.shutdown()


def run_training(
    node: PeerNode,
    run: RunConfig,
    swarm: SwarmConfig,
    steps: int,
    index: int = 0,
    metrics_file: str | None = None,
    num_eval_windows: int = 8,
    wait_s: float = 120.0,
) -> dict:
    """Train for ``steps`` steps (0 = until interrupted) on the run's corpus; returns the trainer's stats.

    Raises:
        PipelineStalled: the pipeline never became complete within ``wait_s`` seconds.
    """
    from hivetrain.data import load_corpus, stream_seed
    from hivetrain.swarm.trainer import PipelineStalled, PipelineTrainer

    corpus = load_corpus(run.data)
    model_config, fingerprint = describe_model(run)
    trainer = PipelineTrainer(node, run.run_id, swarm, model_config, fingerprint, seed=run.seed * 1000 + index)
    stats: dict = {"peer_id": node.peer_id, "completed": False, "steps": 0, "failed_steps": 0}
    metrics = open(metrics_file, "a") if metrics_file else None  # noqa: SIM115 - closed in finally
    try:
        trainer.start()
        trainer.wait_for_stages(wait_s)
        eval_windows = corpus.eval_windows(run.data.seq_len, num_eval_windows)
        stats["initial_eval_loss"] = trainer.evaluate(eval_windows)
        batches = corpus.train_batches(run.data.seq_len, run.data.batch_size, stream_seed(run.seed, node.peer_id))
        started = time.time()
        step = 0
        while steps == 0 or step < steps:
            try:
                result = trainer.step(next(batches))
            except PipelineStalled as exc:
                stats["failed_steps"] += 1
                logger.warning("step failed: %s", exc)
                if stats["failed_steps"] > max(3, steps // 4):
                    raise
                continue
            step += 1
            event = {
                "event": "step",
                "t": time.time(),
                "step": step,
                "loss": result.loss,
                "microbatches": result.num_microbatches,
                "reroutes": result.reroutes,
                "duration_s": result.duration_s,
            }
            if metrics is not None:
                metrics.write(json.dumps(event) + "\n")
                metrics.flush()
        stats["train_wall_s"] = time.time() - started
        stats["settled"] = trainer.settle(timeout_s=3 * swarm.record_ttl_s)
        stats["final_eval_loss"] = trainer.evaluate(eval_windows)
        stats["steps"] = step
        stats["completed"] = True
    finally:
        stats.update(trainer.summary())
        trainer.shutdown()
        if metrics is not None:
            metrics.close()
    return stats


if __name__ == "__main__":  # pragma: no cover
    sys.exit(server_main())
