"""Prometheus metrics of a run, read from the dashboard's snapshot at scrape time.

A custom collector (prometheus-client's pattern for exporters that proxy another source) turns the latest
``DashboardSnapshot`` into metric families on every scrape, so counters are the coordinator's own totals rather than
increments this module would have to track. Each dashboard has its own ``CollectorRegistry``; the process-global
registry is never touched, so several coordinators (or tests) in one process do not collide.

Exposed (all prefixed ``hivetrain_``): ``up`` (1 if the snapshot could be read), ``run_info{run_id,model}``,
``model_parameters``, ``epoch``, ``eval_loss`` (nats/token, latest finite evaluation), ``tokens_per_second``,
``peers_alive`` / ``peers_known``, ``averaging_rounds_committed_total``, ``averaging_rounds_failed_total``,
``checkpoints_written_total``, ``samples_contributed_total``, ``samples_credited_total``, ``compute_seconds_total``.

A pipelined run adds ``pipeline_stages``, ``pipeline_trainers``, per stage (label ``stage``)
``pipeline_stage_servers``, ``pipeline_stage_throughput_microbatches_per_second`` (announced) and
``pipeline_stage_load`` (mean over its servers, 0..1), ``pipeline_throughput_microbatches_per_second`` (the bottleneck
stage's), ``pipeline_microbatches_per_second`` (credited, over the view's window), and the credited counters
``pipeline_microbatches_total``, ``pipeline_reroutes_total``, ``pipeline_replays_total``,
``pipeline_server_deaths_total``, ``pipeline_rebalances_total``. Peers are never labels (unbounded cardinality).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from hivetrain.coordinator.web.pipeline_view import PipelineView
from hivetrain.coordinator.web.snapshot import DashboardSnapshot

logger = logging.getLogger(__name__)

PREFIX = "hivetrain_"


class SnapshotCollector(Collector):
    """Yields the run's metrics from ``snapshot_fn()`` at each scrape.

    Args:
        snapshot_fn: returns the latest snapshot; if it raises, only ``hivetrain_up 0`` is exported.
        peer_alive_within_s: a peer counts as alive if seen within this many seconds.
    """

    def __init__(self, snapshot_fn: Callable[[], DashboardSnapshot], peer_alive_within_s: float) -> None:
        if peer_alive_within_s <= 0:
            raise ValueError(f"peer_alive_within_s must be > 0, got {peer_alive_within_s}")
        self._snapshot_fn = snapshot_fn
        self._alive_within_s = peer_alive_within_s

    def describe(self) -> list[Metric]:
        return []  # families depend on the snapshot; nothing to pre-register (and no snapshot at registration)

    def collect(self) -> Iterator[Metric]:
        try:
            snap = self._snapshot_fn()
        except Exception:  # noqa: BLE001 - a scrape must answer even when the coordinator cannot
            logger.exception("metrics: snapshot failed")
            yield GaugeMetricFamily(PREFIX + "up", "1 if the coordinator's snapshot could be read", value=0)
            return
        yield GaugeMetricFamily(PREFIX + "up", "1 if the coordinator's snapshot could be read", value=1)
        yield InfoMetricFamily(
            PREFIX + "run", "The run being trained", value={"run_id": snap.run.run_id, "model": snap.run.model_preset}
        )
        yield GaugeMetricFamily(PREFIX + "model_parameters", "Trainable parameters", value=snap.run.num_parameters)
        yield GaugeMetricFamily(PREFIX + "epoch", "Committed outer steps (epoch) of the run", value=snap.epoch)
        latest = snap.latest_loss()
        if latest is not None:
            yield GaugeMetricFamily(
                PREFIX + "eval_loss", "Latest finite eval loss, nats per token", value=latest.eval_loss
            )
        if snap.drift_curve:
            yield GaugeMetricFamily(
                PREFIX + "param_drift",
                "Latest max relative deviation of a peer's parameters from the peers' mean, max_p |θp-θ̄|/|θ̄|",
                value=snap.drift_curve[-1].drift,
            )
        yield GaugeMetricFamily(PREFIX + "tokens_per_second", "Swarm training throughput", value=snap.tokens_per_s)
        yield GaugeMetricFamily(
            PREFIX + "peers_alive",
            f"Volunteers (every role but the coordinator) seen within the last {self._alive_within_s:g} seconds",
            value=snap.num_peers_alive(self._alive_within_s),
        )
        yield GaugeMetricFamily(PREFIX + "peers_known", "Volunteers the coordinator knows", value=snap.num_volunteers())
        yield CounterMetricFamily(
            PREFIX + "averaging_rounds_committed", "Averaging rounds committed", value=snap.rounds_committed_total
        )
        yield CounterMetricFamily(
            PREFIX + "averaging_rounds_failed", "Averaging rounds failed", value=snap.rounds_failed_total
        )
        yield CounterMetricFamily(
            PREFIX + "checkpoints_written", "Checkpoints written", value=snap.checkpoints_written_total
        )
        yield CounterMetricFamily(
            PREFIX + "samples_contributed",
            "Training samples contributed by volunteers",
            value=snap.samples_contributed_total,
        )
        yield CounterMetricFamily(
            PREFIX + "samples_credited",
            "Training samples of volunteers witnessed by the members of their groups",
            value=snap.samples_credited_total,
        )
        yield CounterMetricFamily(
            PREFIX + "compute_seconds", "Compute seconds contributed by volunteers", value=snap.compute_s_total
        )
        if snap.pipeline is not None:
            yield from _pipeline_metrics(snap.pipeline)


def _pipeline_metrics(view: PipelineView) -> Iterator[Metric]:
    """The families of a pipelined run (see the module docstring)."""
    p = PREFIX + "pipeline_"
    yield GaugeMetricFamily(p + "stages", "Pipeline stages (swarm.num_stages)", value=view.num_stages)
    yield GaugeMetricFamily(p + "trainers", "Pipeline trainers reporting", value=len(view.trainers))
    servers = GaugeMetricFamily(p + "stage_servers", "Live servers of each stage", labels=["stage"])
    throughput = GaugeMetricFamily(
        p + "stage_throughput_microbatches_per_second",
        "Summed announced throughput of each stage's servers",
        labels=["stage"],
    )
    load = GaugeMetricFamily(p + "stage_load", "Mean announced load of each stage's servers, 0..1", labels=["stage"])
    for stage in view.stages:
        servers.add_metric([str(stage.index)], len(stage.servers))
        throughput.add_metric([str(stage.index)], stage.throughput_mb_per_s)
        load.add_metric([str(stage.index)], stage.mean_load)
    yield from (servers, throughput, load)
    yield GaugeMetricFamily(
        p + "throughput_microbatches_per_second",
        "Announced throughput of the bottleneck stage (min over stages)",
        value=view.pipeline_throughput_mb_per_s,
    )
    yield GaugeMetricFamily(
        p + "microbatches_per_second",
        f"Credited microbatches per second over the last {view.window_s:g} seconds",
        value=view.microbatches_per_s,
    )
    for name, value, text in (
        ("microbatches", view.microbatches_total, "Microbatches trained through every stage (credited)"),
        ("reroutes", view.reroutes_total, "Calls rerouted to another server (credited)"),
        ("replays", view.replays_total, "Gradients replayed after a server lost them (credited)"),
        ("server_deaths", view.deaths_total, "Stage servers declared dead by trainers (credited)"),
        ("rebalances", view.rebalances_total, "Stage servers moved to another stage (credited)"),
    ):
        yield CounterMetricFamily(p + name, text, value=value)


def build_registry(snapshot_fn: Callable[[], DashboardSnapshot], peer_alive_within_s: float) -> CollectorRegistry:
    """A fresh registry holding one ``SnapshotCollector`` (never the global ``REGISTRY``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot_fn, peer_alive_within_s))
    return registry


def render_metrics(registry: CollectorRegistry) -> tuple[bytes, str]:
    """(body, content type) of the Prometheus text exposition of ``registry``."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
