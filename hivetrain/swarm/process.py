"""The work of a pipelined run's two roles, as a library: what ``join-swarm`` runs once it has joined a pipelined
run (``hivetrain.cli.swarm_roles``) and what tests and benchmarks call in-process.

* ``describe_model``: the uncut model's config and fingerprint (shapes only);
* ``group_averager_factory``: the per-stage averager a ``StageServer`` runs DiLoCo's outer step with;
* ``server_stats``: a stage server's figures for its summary file;
* ``run_training``: a pipeline trainer's loop (steps, held-out evaluation, settling its gradients), publishing its
  counters for the coordinator's dashboard (``trainer_report``, ``swarm/reports.py``).
"""

from __future__ import annotations

import json
import logging
import time

from transformers import LlamaConfig

from hivetrain.config import RunConfig
from hivetrain.data import vocab_size_of
from hivetrain.faults import FaultInjector
from hivetrain.model import build_run_model, resolve_model_source
from hivetrain.peers.node import PeerNode
from hivetrain.swarm.config import SwarmConfig

logger = logging.getLogger(__name__)

FINAL_REPORT_TTL_S = 60.0
"""Lifetime of a trainer's last report (seconds): coordinators poll every 10 s by default, and should see it."""


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


def group_averager_factory(
    run: RunConfig, faults: FaultInjector, listen_host: str, timeout_s: float = 30.0, announce_host: str | None = None
):
    """An ``AveragerFactory`` building hivetrain's ``GroupAverager`` for one stage.

    Args:
        listen_host: address the averager's data port binds; ``announce_host``: the one peers dial (None = found).
        timeout_s: seconds to wait for the averager to be ready.
    """

    def make(node, prefix: str):
        from hivetrain.averaging import GroupAverager

        averager = GroupAverager(
            node,
            prefix=f"{prefix}.avg",
            config=run.averaging,
            faults=faults,
            listen_host=listen_host,
            announce_host=announce_host,
        )
        averager.start()
        averager.wait_ready(timeout_s)
        return averager

    return make


def server_stats(server, started: float) -> dict:
    """A stage server's figures (stage, epoch, state hash, calls served, rebalances, outer steps); ``started`` is
    the unix time it started (for ``wall_s``)."""
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


def trainer_report(trainer, run_id: str, fingerprint: str, started_at: float, stats: dict, left_reason: str = ""):
    """The ``TrainerReport`` of ``trainer`` (a ``PipelineTrainer``) now: its counters, ``stats["steps"]`` and its
    newest ban / death reasons. Called from the reporter's thread: it only reads counters."""
    from hivetrain.swarm.reports import MAX_REASONS, TrainerReport, clip_reason

    counters = trainer.stats
    return TrainerReport(
        peer_id=trainer.node.peer_id,
        run_id=run_id,
        model_fingerprint=fingerprint,
        started_at=started_at,
        steps=stats.get("steps", 0),
        microbatches=counters.microbatches,
        reroutes=counters.reroutes,
        replays=counters.replays,
        deaths=counters.deaths,
        last_reasons=tuple(clip_reason(r) for r in counters.ban_reasons[-MAX_REASONS:]),
        left_reason=left_reason,
        updated_at=time.time(),
    )


def run_training(
    node: PeerNode,
    run: RunConfig,
    swarm: SwarmConfig,
    steps: int,
    index: int = 0,
    metrics_file: str | None = None,
    num_eval_windows: int = 8,
    wait_s: float = 120.0,
    faults: FaultInjector | None = None,
    stats: dict | None = None,
) -> dict:
    """Train for ``steps`` steps (0 = until interrupted) on the run's corpus; returns the trainer's stats.

    Args:
        index: seeds the trainer's routing (``run.seed * 1000 + index``); the data stream is seeded by the peer ID.
        metrics_file: append one JSON line per step here (None = none).
        num_eval_windows: held-out windows evaluated at the start and the end.
        wait_s: seconds to wait for every stage to be served before the first step.
        stats: fill this dict (and return it): the caller still holds the figures if training raises.

    Raises:
        PipelineStalled: the pipeline never became complete within ``wait_s`` seconds.
    """
    from hivetrain.data import load_corpus, stream_seed
    from hivetrain.swarm.reports import Reporter
    from hivetrain.swarm.trainer import PipelineStalled, PipelineTrainer

    corpus = load_corpus(run.data)
    model_config, fingerprint = describe_model(run)
    trainer = PipelineTrainer(
        node, run.run_id, swarm, model_config, fingerprint, faults or FaultInjector(), seed=run.seed * 1000 + index
    )
    stats = {} if stats is None else stats
    stats.update(peer_id=node.peer_id, completed=False, steps=0, failed_steps=0)
    metrics = open(metrics_file, "a") if metrics_file else None  # noqa: SIM115 - closed in finally
    started_at = time.time()

    def report(left_reason: str = ""):
        return trainer_report(trainer, run.run_id, fingerprint, started_at, stats, left_reason)

    reporter = Reporter(node.dht, node.owner_marker, report, swarm.announce_interval_s, swarm.record_ttl_s)
    try:
        trainer.start()
        reporter.start()
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
            stats["steps"] = step
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
        left = "finished" if stats["completed"] else "stopped before its last step"
        reporter.stop(final=report(left), final_ttl_s=FINAL_REPORT_TTL_S)
        trainer.shutdown()
        if metrics is not None:
            metrics.close()
    return stats
