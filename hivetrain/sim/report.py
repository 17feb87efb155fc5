"""``DIR/report.json`` and PNG plots of simulation runs (matplotlib, Agg backend: no display needed).

``write_report`` writes one run's summary (``sim.metrics``) plus ``consensus_rounds``: the Moshpit (or gossip) rounds
the production group functions need for this scenario's peer count and group size to bring the drift below 1% of
its start (``sim.consensus.rounds_to_consensus``; 1 for butterfly up to ``target_group_size`` peers, where one exact
group is formed). ``plot_sweep`` draws figures against the number of peers from several reports, and
``plot_consensus`` the rounds-to-consensus figure next to the Moshpit bound ceil(log_g N).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hivetrain.sim.consensus import ConsensusRun, rounds_to_consensus
from hivetrain.sim.metrics import SimMetrics


def consensus_for(strategy: str, num_peers: int, group_size: int, seed: int) -> ConsensusRun:
    """Rounds to 1% consensus for this swarm's averaging (butterfly counts as Moshpit with one group per round)."""
    mixing = "gossip" if strategy == "gossip" else "moshpit"
    return rounds_to_consensus(mixing, max(num_peers, 2), max(group_size, 2), seed)


def write_report(metrics: SimMetrics, out_dir: str | Path, group_size: int, seed: int) -> dict[str, Any]:
    """Write ``report.json`` and ``drift.png`` under ``out_dir`` (created); returns the report dict."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(metrics.summary)
    run = consensus_for(report["strategy"], report["peers"], group_size, seed)
    report["consensus_rounds"] = run.rounds
    report["consensus_bound_rounds"] = run.bound_rounds
    (out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    _plot_drift(metrics, out / "drift.png")
    return report


def write_pipeline_report(summary: dict[str, Any], out_dir: str | Path) -> dict[str, Any]:
    """Write a SWARM-mode run's summary (``sim.pipeline``) as ``report.json`` under ``out_dir``; returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


def _plot_drift(metrics: SimMetrics, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if metrics.drift:
        t, _, d = zip(*metrics.drift, strict=True)
        ax.plot(t, d)
    ax.set_xlabel("simulated time, s")
    ax.set_ylabel("max_p ||θ_p − θ̄|| / ||θ̄|| (modal epoch)")
    ax.set_title(f"{metrics.summary.get('scenario', '')}: drift of the stand-in parameters")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(reports: Sequence[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """Figures against the number of peers, one line per (strategy, churn label) of ``reports``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    panels = [
        ("utilization_mean", "utilization (compute s / live s)"),
        ("committed_sample_share", "committed sample share"),
        ("time_per_outer_step_s", "time per outer step, s"),
        ("bytes_per_peer_per_step", "all-reduce bytes per peer per outer step"),
        ("peak_dht_value_bytes", "peak DHT value per key, bytes"),
        ("dht_ops_per_peer_per_step", "DHT ops per peer per outer step"),
        ("dht_read_bytes_per_peer_per_step", "DHT bytes read per peer per outer step"),
        ("wall_s", "simulation wall time, s"),
    ]
    paths = []
    for key, label in panels:
        fig, ax = plt.subplots(figsize=(6, 4))
        lines: dict[str, list[tuple[int, float]]] = {}
        for r in reports:
            if r.get(key) is not None:
                lines.setdefault(r.get("label", r["scenario"]), []).append((r["peers"], r[key]))
        for name, points in sorted(lines.items()):
            points.sort()
            ax.plot(*zip(*points, strict=True), marker="o", label=name)
        ax.set_xscale("log")
        if key.endswith("bytes") or key.endswith("_step") and "bytes" in key:
            ax.set_yscale("log")
        ax.set_xlabel("peers")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{key}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_consensus(runs: Sequence[ConsensusRun], path: str | Path) -> Path:
    """Rounds to 1% consensus against N, per strategy and group size, next to ceil(log_g N)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[tuple[str, int], list[ConsensusRun]] = {}
    for r in runs:
        series.setdefault((r.strategy, r.group_size), []).append(r)
    for (strategy, g), rs in sorted(series.items()):
        rs.sort(key=lambda r: r.num_peers)
        line = ax.plot([r.num_peers for r in rs], [r.rounds for r in rs], marker="o", label=f"{strategy} g={g}")
        if strategy == "moshpit":
            ax.plot([r.num_peers for r in rs], [r.bound_rounds for r in rs], linestyle=":",
                    color=line[0].get_color(), label=f"ceil(log_{g} N)")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("peers N")
    ax.set_ylabel("rounds until drift < 1% of its start")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
