"""The chaos run's picture: eval loss and committed outer steps over time, with the faults marked (PNG, Agg)."""

from __future__ import annotations

from pathlib import Path

from hivetrain.chaos.facts import PeerRun, eval_series

_SPAN_KINDS = {"pause", "cpu_starve", "kill_coordinator", "partition", "churn"}


def plot_run(report: dict, peers: list[PeerRun], path: Path, title: str | None = None) -> Path:
    """Write the plot of a chaos run to ``path`` (PNG) and return it.

    Top axis: eval loss of every peer (nats/token) against seconds since start; a byzantine peer is dashed.
    Bottom axis: the swarm's committed outer steps (epochs) as a step line. Faults are vertical lines labelled with
    the fault and shaded while they last (pause, coordinator down, partition, churn).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_steps) = plt.subplots(
        2, 1, figsize=(11, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]}, constrained_layout=True
    )
    for peer in peers:
        series = eval_series(peer)
        if not series:
            continue
        xs, ys = zip(*series, strict=False)
        style = "--" if peer.byzantine else "-"
        label = peer.name + (f" ({peer.byzantine})" if peer.byzantine else "") + (" †" if peer.killed else "")
        ax_loss.plot(xs, ys, style, marker=".", linewidth=1.2, markersize=4, label=label, alpha=0.85)
    ax_loss.set_ylabel("eval loss (nats/token)")
    ax_loss.grid(alpha=0.3)

    commits = report.get("commits", [])
    if commits:
        xs = [0.0] + [c["t_s"] for c in commits] + [report["figures"]["wall_s"]]
        ys = [0] + [c["epoch"] for c in commits] + [commits[-1]["epoch"]]
        ax_steps.step(xs, ys, where="post", color="black", linewidth=1.8, label="committed outer steps")
    ax_steps.axhline(
        report["figures"]["target_outer_steps"], color="grey", linestyle=":", linewidth=1, label="target outer steps"
    )
    ax_steps.set_ylabel("outer steps committed")
    ax_steps.set_xlabel("time since start (s)")
    ax_steps.grid(alpha=0.3)

    colors = plt.get_cmap("tab10")
    labelled = 0
    for i, fault in enumerate(report.get("faults", [])):
        fired = fault.get("fired_at_s")
        if fired is None:
            continue
        color = colors(i % 10)
        small = fault["kind"].startswith("churn:")
        for ax in (ax_loss, ax_steps):
            ax.axvline(fired, color=color, linestyle="-" if not small else ":", linewidth=1.0 if small else 1.6)
            end = fault.get("ended_at_s")
            if fault["kind"] in _SPAN_KINDS and end is not None and end > fired:
                ax.axvspan(fired, end, color=color, alpha=0.12)
        if not small or labelled < 12:
            labelled += 1
            ax_steps.annotate(
                fault["label"],
                xy=(fired, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, -4 - 11 * (labelled % 4)),
                textcoords="offset points",
                fontsize=7 if small else 8,
                color=color,
                va="top",
                rotation=0,
            )
    ax_loss.legend(loc="upper right", fontsize=8, ncol=2)
    ax_steps.legend(loc="lower right", fontsize=8)
    verdict = "PASSED" if report.get("passed") else "FAILED"
    fig.suptitle(title or f"chaos scenario {report.get('scenario')}: {verdict}", fontsize=12)
    ax_loss.set_title(report.get("description", ""), fontsize=9)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
