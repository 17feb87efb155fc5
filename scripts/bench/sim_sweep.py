"""Sweep the simulation over the number of peers and churn, and draw the scale figures (PNG) against N.

    nice -n 10 python scripts/bench/sim_sweep.py --out /tmp/sim-sweep [--sizes 100,300,1000,3000]
        [--churn none,moderate,heavy] [--outer-steps 6] [--time-limit-s 600] [--flash-donors 1,2,4,8]
        [--swarm-servers 20,50,100,200] [--parts dp,consensus,flash,swarm] [--docs docs/sim]

Parts:
- ``dp``: ``scenarios/sim/dp-100.toml`` (butterfly, groups of up to 64) at each size and churn level: none,
  moderate (exponential sessions, mean 1 h) or heavy (Weibull shape 0.5, mean 30 min: the ``dp-*-heavy`` files).
  Each run's ``report.json`` goes to ``OUT/runs/``; ``report.plot_sweep`` draws ``OUT/plots/<figure>.png``.
- ``consensus``: Moshpit (groups of 4, 16, 64) and gossip rounds to 1% drift against N (sizes and 10,000), also
  with 5% of the members leaving during each round, next to ceil(log_g N) (``OUT/plots/consensus_rounds.png``).
- ``flash``: ``scenarios/sim/dp-1000-flash.toml`` with K donors per joiner (``OUT/plots/flash_crowd.png``), averaging
  with ``--flash-strategy`` (default moshpit, groups of 16) and the crowd arriving at ``--flash-at-s``. With
  butterfly averaging in several groups per epoch, each group's state has its own hash and a joiner downloads only
  once one state holds the quorum ``decide_sync`` asks for; else it starts from the initial model (dev/LOG.md,
  session 7).
- ``swarm``: ``scenarios/sim/swarm-100.toml`` at each server count (4 stages; trainers scale with servers), with
  churn, without churn, and without rebalancing (``OUT/plots/swarm_throughput.png``).

A run that hits ``--time-limit-s`` (wall seconds) stops at that tick and its report says how far it got
(``outer_steps_done``, ``sim_s``); the summary table marks it. ``--docs DIR`` copies the PNGs there (the README shows
``docs/sim/*.png``). Prints one line per run (wall and CPU seconds) and writes ``OUT/sweep.json``.
``--from-runs DIR,DIR`` draws the figures from the ``runs/*/report.json`` of earlier sweeps instead of running
(a later folder's run replaces an earlier one's of the same name: rerun a few sizes longer, then redraw).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from hivetrain.sim.config import ChurnConfig, Scenario, load_scenario
from hivetrain.sim.consensus import rounds_to_consensus
from hivetrain.sim.dataparallel import DataParallelSim
from hivetrain.sim.report import plot_consensus, plot_flash, plot_pipeline, plot_sweep, write_report

ROOT = Path(__file__).resolve().parents[2]
CHURN = {
    "none": ChurnConfig(session="none"),
    "moderate": ChurnConfig(session="exponential", mean_session_s=3600.0),
    "heavy": ChurnConfig(session="weibull", weibull_shape=0.5, mean_session_s=1800.0),
}


def round_timeout_for(num_peers: int, base_s: float) -> float:
    """``averaging.round_timeout_s`` for a home-link swarm of ``num_peers`` built on ``dp-100.toml`` (600 s: one
    round of 100 MB among up to ~100 peers takes ~300 s): past 100 peers the two-stage round takes ~600 s at 1,000
    (``dp-1000.toml`` and ``dp-10000-*.toml`` use 1,200 s). The simulator refuses a scenario whose round cannot fit."""
    return base_s if num_peers <= 100 else max(base_s, 1200.0)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def run_dp(scenario: Scenario, out: Path, time_limit_s: float, label: str) -> dict[str, Any]:
    """One data-parallel run; its report (with ``label``, ``cpu_s`` and ``stopped_by_limit``)."""
    sim = DataParallelSim(scenario)
    if time_limit_s > 0:
        sim.wall_deadline = time.perf_counter() + time_limit_s
    cpu0 = time.process_time()
    metrics = sim.run()
    report = write_report(metrics, out, scenario.averaging.target_group_size, scenario.sim.seed)
    report["label"] = label
    report["cpu_s"] = time.process_time() - cpu0
    report["stopped_by_limit"] = bool(
        report["outer_steps_done"] < scenario.sim.outer_steps and report["sim_s"] < scenario.sim.max_sim_s
    )
    (out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return report


def _line(r: dict[str, Any]) -> str:
    t = r.get("time_per_outer_step_s")
    return (f"{r['scenario']:<28} N={r['peers']:<6} steps={r['outer_steps_done']:<3} sim_s={r['sim_s']:<7.0f} "
            f"util={r['utilization_mean']:.2f} committed={r['committed_sample_share']:.2f} "
            f"step_s={t if t is None else round(t)} peak_dht={r['peak_dht_value_bytes']} "
            f"wall_s={r['wall_s']:.0f} cpu_s={r['cpu_s']:.0f}{' LIMIT' if r['stopped_by_limit'] else ''}")  # fmt: skip


def sweep_dp(args, out: Path) -> list[dict[str, Any]]:
    base = load_scenario(ROOT / "scenarios/sim/dp-100.toml")
    reports = []
    for churn in args.churn.split(","):
        for n in _ints(args.sizes):
            sim = replace(base.sim, num_peers=n, outer_steps=args.outer_steps, schedule_probes=2)
            avg = replace(base.averaging, round_timeout_s=round_timeout_for(n, base.averaging.round_timeout_s))
            sc = replace(base, name=f"dp-{n}-{churn}", churn=CHURN[churn], sim=sim, averaging=avg)
            r = run_dp(sc, out / "runs" / sc.name, args.time_limit_s, f"butterfly g=64, churn {churn}")
            print(_line(r), flush=True)
            reports.append(r)
    return reports


def sweep_flash(args, out: Path) -> list[dict[str, Any]]:
    base = load_scenario(ROOT / "scenarios/sim/dp-1000-flash.toml")
    reports = []
    avg = replace(base.averaging, strategy=args.flash_strategy, target_group_size=args.flash_group_size)
    crowd = replace(base.flash_crowd, at_s=args.flash_at_s)
    for k in _ints(args.flash_donors):
        sc = replace(base, name=f"dp-1000-flash-k{k}", download=replace(base.download, num_donors=k), averaging=avg,
                     flash_crowd=crowd, sim=replace(base.sim, outer_steps=10_000,
                                                    max_sim_s=args.flash_at_s + args.flash_window_s))  # fmt: skip
        r = run_dp(sc, out / "runs" / sc.name, args.time_limit_s, f"flash K={k}")
        print(_line(r), f"flash: {r['flash_downloads']} of {r['flash_joiners']} downloaded, mean "
              f"{r['flash_catchup_s_mean']} max {r['flash_catchup_s_max']} all {r['flash_all_caught_up_s']} "
              f"still syncing {r['flash_still_syncing']} donor_max_bytes {r['flash_max_donor_bytes']}")  # fmt: skip
        reports.append(r)
    return reports


def sweep_swarm(args, out: Path) -> list[dict[str, Any]]:
    from hivetrain.sim.pipeline import PipelineSim
    from hivetrain.sim.report import write_pipeline_report

    base = load_scenario(ROOT / "scenarios/sim/swarm-100.toml")
    variants = {
        "churn 1 h, rebalance": (CHURN["moderate"], True),
        "no churn, rebalance": (CHURN["none"], True),
        "churn 1 h, no rebalance": (CHURN["moderate"], False),
    }
    reports = []
    for label, (churn, rebalance) in variants.items():
        for n in _ints(args.swarm_servers):
            trainers = max(1, round(base.pipeline.num_trainers * n / base.pipeline.num_servers))
            pipe = replace(base.pipeline, num_servers=n, num_trainers=trainers, rebalance=rebalance)
            sc = replace(base, name=f"swarm-{n}", churn=churn, pipeline=pipe)
            run_dir = out / "runs" / f"swarm-{n}-{len(reports)}"
            r = write_pipeline_report(PipelineSim(sc).run(), run_dir)
            r["label"] = label
            (run_dir / "report.json").write_text(json.dumps(r, indent=2, sort_keys=True) + "\n")
            print(f"swarm N={n} {label}: ratio {r['throughput_ratio']:.2f} rerouted {r['rerouted_share']:.3f} "
                  f"moves {r['moves']} wall_s {r['wall_s']:.0f}", flush=True)  # fmt: skip
            reports.append(r)
    return reports


def load_runs(dirs: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Reports under ``DIR/runs/*/report.json``, by part ("dp", "flash", "swarm"); later folders win per run name."""
    by_name: dict[str, dict[str, Any]] = {}
    for d in dirs:
        for path in sorted(Path(d).glob("runs/*/report.json")):
            by_name[path.parent.name] = json.loads(path.read_text())
    parts: dict[str, list[dict[str, Any]]] = {"dp": [], "flash": [], "swarm": []}
    for r in by_name.values():
        part = "swarm" if r.get("mode") == "swarm" else "flash" if "flash" in r["scenario"] else "dp"
        parts[part].append(r)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/sim-sweep")
    parser.add_argument("--sizes", default="100,300,1000,3000", help="peer counts, comma-separated")
    parser.add_argument("--churn", default="none,moderate,heavy", help="churn levels: none, moderate, heavy")
    parser.add_argument("--outer-steps", type=int, default=6, help="outer steps per data-parallel run")
    parser.add_argument("--time-limit-s", type=float, default=600.0, help="wall seconds per run; 0 = no limit")
    parser.add_argument("--flash-donors", default="1,2,4,8", help="donors per joiner K, comma-separated")
    parser.add_argument("--flash-window-s", type=float, default=2400.0, help="simulated s after the crowd arrives")
    parser.add_argument("--flash-at-s", type=float, default=1500.0, help="when the crowd arrives, simulated s")
    parser.add_argument("--flash-strategy", default="moshpit", help="averaging of the flash-crowd runs")
    parser.add_argument("--flash-group-size", type=int, default=16, help="target group size of the flash runs")
    parser.add_argument("--swarm-servers", default="20,50,100,200", help="SWARM stage servers, comma-separated")
    parser.add_argument("--consensus-sizes", default="100,300,1000,3000,10000", help="N of the consensus figure")
    parser.add_argument("--parts", default="dp,consensus,flash,swarm", help="which parts to run")
    parser.add_argument("--docs", default="", help="also copy the PNGs into this folder (e.g. docs/sim)")
    parser.add_argument("--from-runs", default="", help="redraw from these sweeps' runs/ (comma-separated); no runs")
    args = parser.parse_args()
    out = Path(args.out)
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    summary: dict[str, Any] = {}
    if args.from_runs:
        loaded = load_runs(args.from_runs.split(","))
        parts -= {p for p in ("dp", "flash", "swarm") if p in parts}
        if loaded["dp"]:
            plot_sweep(loaded["dp"], plots)
        if loaded["flash"]:
            plot_flash(loaded["flash"], plots / "flash_crowd.png")
        if loaded["swarm"]:
            plot_pipeline(loaded["swarm"], plots / "swarm_throughput.png")
        summary.update(loaded)
    if "consensus" in parts:
        runs = [rounds_to_consensus(s, n, g, seed=1, leave_prob=p)
                for s, g in (("moshpit", 4), ("moshpit", 16), ("moshpit", 64), ("gossip", 2))
                for p in (0.0, 0.05) for n in _ints(args.consensus_sizes)]  # fmt: skip
        for r in runs:
            print(f"consensus {r.strategy} g={r.group_size} N={r.num_peers} leave={r.leave_prob}: {r.rounds} rounds "
                  f"(bound {r.bound_rounds})", flush=True)  # fmt: skip
        plot_consensus(runs, plots / "consensus_rounds.png")
        summary["consensus"] = [r.__dict__ for r in runs]
    if "dp" in parts:
        summary["dp"] = sweep_dp(args, out)
        plot_sweep(summary["dp"], plots)
    if "flash" in parts:
        summary["flash"] = sweep_flash(args, out)
        plot_flash(summary["flash"], plots / "flash_crowd.png")
    if "swarm" in parts:
        summary["swarm"] = sweep_swarm(args, out)
        plot_pipeline(summary["swarm"], plots / "swarm_throughput.png")
    (out / "sweep.json").write_text(json.dumps(summary, indent=1, sort_keys=True, default=str) + "\n")
    if args.docs:
        docs = Path(args.docs)
        docs.mkdir(parents=True, exist_ok=True)
        for png in plots.glob("*.png"):
            shutil.copy(png, docs / png.name)
    print(f"wrote {out / 'sweep.json'} and {len(list(plots.glob('*.png')))} plots under {plots}")


if __name__ == "__main__":
    main()
