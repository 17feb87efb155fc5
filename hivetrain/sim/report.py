"""``DIR/report.json`` and PNG plots of simulation runs (matplotlib, Agg backend: no display needed).

``write_report`` writes one run's summary (``sim.metrics``) plus ``consensus_rounds``: the Moshpit (or gossip) rounds
the production group functions need for this scenario's peer count and group size to bring the drift below 1% of
its start (``sim.consensus.rounds_to_consensus``; 1 for butterfly up to ``target_group_size`` peers, where one exact
group is formed), and under churn ``consensus_rounds_churn``: the same with each member leaving during a round with
``consensus_leave_prob`` = 1 - exp(-round_s_median / mean_session_s) (the run's median group round and the scenario's
mean session; exponential, also for Weibull sessions: an approximation). ``plot_sweep`` draws figures against the
number of peers from several reports, and ``plot_consensus`` the rounds-to-consensus figure next to the Moshpit
bound ceil(log_g N) (with and without churn), ``plot_flash`` a flash crowd's catch-up time and busiest donor
against the number of donors K, ``plot_pipeline`` SWARM throughput (and its ideal) and rerouted share against
servers, and ``write_report`` adds ``partition.png`` (each
side's median epoch and the drift over all peers around a split) when the scenario has a ``[partition]``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hivetrain.sim.consensus import ConsensusRun, rounds_to_consensus
from hivetrain.sim.metrics import SimMetrics


def consensus_for(strategy: str, num_peers: int, group_size: int, seed: int, leave_prob: float = 0.0) -> ConsensusRun:
    """Rounds to 1% consensus for this swarm's averaging (butterfly counts as Moshpit with one group per round)."""
    mixing = "gossip" if strategy == "gossip" else "moshpit"
    return rounds_to_consensus(mixing, max(num_peers, 2), max(group_size, 2), seed, leave_prob=leave_prob)


def leave_prob_per_round(round_s: float | None, mean_session_s: float | None) -> float:
    """Probability that a member leaves during one group round of ``round_s`` seconds, for exponential sessions of
    mean ``mean_session_s`` seconds (0 without churn or without a finished round)."""
    if not round_s or not mean_session_s:
        return 0.0
    return float(min(1.0 - math.exp(-round_s / mean_session_s), 0.999))


def write_report(metrics: SimMetrics, out_dir: str | Path, group_size: int, seed: int) -> dict[str, Any]:
    """Write ``report.json`` and ``drift.png`` under ``out_dir`` (created); returns the report dict."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(metrics.summary)
    run = consensus_for(report["strategy"], report["peers"], group_size, seed)
    report["consensus_rounds"] = run.rounds
    report["consensus_bound_rounds"] = run.bound_rounds
    p = leave_prob_per_round(report.get("round_s_median"), report.get("mean_session_s"))
    report["consensus_leave_prob"] = p
    report["consensus_rounds_churn"] = (
        consensus_for(report["strategy"], report["peers"], group_size, seed, p).rounds if p > 0 else run.rounds
    )
    (out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    _plot_drift(metrics, out / "drift.png")
    if metrics.partition_history:
        plot_partition(metrics.partition_history, report["partition"], out / "partition.png", report["scenario"])
    return report


def write_pipeline_report(summary: dict[str, Any], out_dir: str | Path) -> dict[str, Any]:
    """Write a SWARM-mode run's summary (``sim.pipeline``) as ``report.json`` under ``out_dir``; returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_drift(metrics: SimMetrics, path: Path) -> None:
    plt = _pyplot()

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


def plot_partition(history: Sequence[tuple[float, ...]], summary: dict[str, Any], path: str | Path, title: str) -> Path:
    """Each side's median epoch and the drift over all live peers against time, the split shaded.

    Args:
        history: ``PartitionTracker.history`` rows (time_s, side-0 median epoch, side-1 median epoch, lineage-0
            share, drift). summary: the report's ``partition`` dict (``at_s``, ``heal_s``).
    """
    plt = _pyplot()
    t, e0, e1, share0, drift = (list(c) for c in zip(*history, strict=True))
    fig, (ax, ax3, ax2) = plt.subplots(3, 1, figsize=(7, 6.5), sharex=True)
    ax.plot(t, e0, label="side 0 (median epoch)")
    ax.plot(t, e1, label="side 1 (cut off)")
    for a in (ax, ax3, ax2):
        a.axvspan(summary["at_s"], min(summary["heal_s"], t[-1]), color="0.9")
    ax3.plot(t, share0)
    ax3.set_ylim(0, 1.05)
    ax3.set_ylabel("share holding\nside 0's model")
    ax.set_ylabel("outer step (epoch)")
    ax.legend(fontsize=7)
    ax.set_title(f"{title}: split at {summary['at_s']:.0f} s, healed at {summary['heal_s']:.0f} s")
    ax2.plot(t, drift)
    ax2.set_ylabel("drift, all live\npeers (any epoch)")
    ax2.set_xlabel("simulated time, s")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return Path(path)


def plot_flash(reports: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """A flash crowd against the number of donors K per joiner (``download_donors``): catch-up time of the finished
    downloads (mean, p90), the joiners still waiting or downloading when the run ended, and the most bytes one donor
    served."""
    plt = _pyplot()
    rs = sorted((r for r in reports if r.get("flash_downloads")), key=lambda r: r["download_donors"])
    k = [r["download_donors"] for r in rs]
    fig, (ax, ax1, ax2) = plt.subplots(1, 3, figsize=(11, 3.6))
    for key, label in (("flash_catchup_s_mean", "mean"), ("flash_catchup_s_p90", "p90")):
        ax.plot(k, [r[key] for r in rs], marker="o", label=label)
    ax.set_ylabel("catch-up (state download), s")
    ax.legend(fontsize=7)
    ax1.plot(k, [r.get("flash_still_syncing", 0) for r in rs], marker="o")
    ax1.set_ylabel("joiners not caught up at the end")
    ax2.plot(k, [r["flash_max_donor_bytes"] / 1e9 for r in rs], marker="o")
    ax2.set_ylabel("most bytes one donor served, GB")
    for a in (ax, ax1, ax2):
        a.set_xscale("log", base=2)
        a.set_xlabel("donors per joiner K")
    if rs:
        r0 = rs[0]
        fig.suptitle(f"flash crowd: {r0.get('flash_joiners', r0['flash_downloads'])} joiners onto {r0['peers']} peers"
                     f" (run ends at {r0['sim_s']:.0f} simulated s)", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return Path(path)


def plot_pipeline(reports: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """SWARM-mode runs against the number of servers, one line per ``label``: pipeline throughput, its ratio to the
    ideal (the slowest stage's summed speed under the placement of the moment) and the share of microbatches
    rerouted."""
    plt = _pyplot()
    fig, (ax0, ax, ax2) = plt.subplots(1, 3, figsize=(12, 3.6))
    lines: dict[str, list[dict[str, Any]]] = {}
    for r in reports:
        lines.setdefault(r.get("label", r["scenario"]), []).append(r)
    for name, rs in sorted(lines.items()):
        rs.sort(key=lambda r: r["peers"])
        n = [r["peers"] for r in rs]
        ax0.plot(n, [r["pipeline_throughput_mb_per_s"] for r in rs], marker="o", label=name)
        ax.plot(n, [r["throughput_ratio"] or 0.0 for r in rs], marker="o", label=name)
        ax2.plot(n, [r["rerouted_share"] for r in rs], marker="o", label=name)
    ax.axhline(1.0, color="0.5", linestyle=":", label="ideal (slowest stage)")
    ax0.set_ylabel("pipeline throughput, microbatches/s")
    ax.set_ylabel("throughput / ideal")
    ax2.set_ylabel("share of microbatches rerouted")
    ticks = sorted({r["peers"] for r in reports})
    for a in (ax0, ax, ax2):
        a.set_xscale("log")
        a.set_xticks(ticks, [str(n) for n in ticks])
        a.minorticks_off()
        a.set_xlabel("stage servers")
        a.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return Path(path)


def plot_sweep(reports: Sequence[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """Figures against the number of peers, one line per (strategy, churn label) of ``reports``. Runs that committed
    no outer step are left out; runs a time limit stopped (``stopped_by_limit``) are drawn with a cross."""
    plt = _pyplot()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    panels = [
        ("utilization_mean", "utilization (compute s / live s)"),
        ("committed_sample_share", "committed sample share"),
        ("time_per_outer_step_s", "time per outer step, s"),
        ("bytes_per_peer_per_step", "all-reduce bytes per peer per outer step"),
        ("peak_dht_value_bytes", "peak DHT value per key, bytes"),
        ("peak_dht_value_bytes_steady", "peak DHT value per key after one record TTL, bytes"),
        ("dht_ops_per_peer_per_step", "DHT ops per peer per outer step"),
        ("dht_read_bytes_per_peer_per_step", "DHT bytes read per peer per outer step"),
        ("round_s_median", "one group all-reduce, s (median)"),
        ("consensus_rounds_churn", "Moshpit rounds to 1% drift, with churn"),
        ("wall_s", "simulation wall time, s"),
    ]
    paths = []
    for key, label in panels:
        fig, ax = plt.subplots(figsize=(6, 4))
        lines: dict[str, list[tuple[int, float, bool]]] = {}
        for r in reports:
            if r.get(key) is not None and r.get("outer_steps_done", 1) > 0:
                point = (r["peers"], r[key], bool(r.get("stopped_by_limit")))
                lines.setdefault(r.get("label", r["scenario"]), []).append(point)
        if not lines:  # no run committed an outer step: nothing to draw
            plt.close(fig)
            continue
        for name, points in sorted(lines.items()):
            points.sort()
            line = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
            cut = [p for p in points if p[2]]
            if cut:
                ax.plot([p[0] for p in cut], [p[1] for p in cut], "x", color=line[0].get_color(), markersize=11)
        if any(r.get("stopped_by_limit") for r in reports):
            ax.plot([], [], "x", color="0.3", label="stopped by the time limit (partial)")
        ax.set_xscale("log")
        if key.endswith("bytes") or key.endswith("_step") and "bytes" in key:
            ax.set_yscale("log")
        if key in ("utilization_mean", "committed_sample_share"):
            ax.set_ylim(0, 1.05)
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
    """Rounds to 1% consensus against N, per strategy, group size and leave probability, next to ceil(log_g N)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[tuple[str, int, float], list[ConsensusRun]] = {}
    for r in runs:
        series.setdefault((r.strategy, r.group_size, r.leave_prob), []).append(r)
    for (strategy, g, leave), rs in sorted(series.items()):
        rs.sort(key=lambda r: r.num_peers)
        label = f"{strategy} g={g}" if strategy == "moshpit" else strategy
        label += f", {leave:.0%} leave per round" if leave else ""
        style = "--" if leave else "-"
        line = ax.plot([r.num_peers for r in rs], [r.rounds for r in rs], marker="o", linestyle=style, label=label)
        if strategy == "moshpit" and not leave:
            ax.plot([r.num_peers for r in rs], [r.bound_rounds for r in rs], linestyle=":",
                    color=line[0].get_color(), label=f"ceil(log_{g} N)")  # fmt: skip
    never = [r for r in runs if r.end_deviation > 0.01 * r.start_deviation]
    if never:  # ``rounds_to_consensus`` reports max_rounds + 1 for "not reached"
        ax.axhline(min(r.rounds for r in never), color="0.6", linewidth=0.8, label="not reached (round limit)")
    ax.set_xscale("log")
    ax.set_xlabel("peers N")
    ax.set_ylabel("rounds until drift < 1% of its start")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
