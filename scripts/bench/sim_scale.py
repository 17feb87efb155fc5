"""Benchmark: the 10,000-peer moderate-churn data-parallel scenario, 20 outer steps; prints wall_s.

Acceptance of issue 15: under 10 minutes on the 2-core machine. Run it alone (it is CPU-bound, one core):

    nice -n 10 python scripts/bench/sim_scale.py [--scenario scenarios/sim/dp-10000-moderate.toml] [--out DIR]
        [--outer-steps N] [--time-limit-s 600] [--num-peers N] [--max-sim-s S]

``--num-peers`` and ``--max-sim-s`` measure the scaling curve: the same scenario at N peers for a fixed simulated
span (wall seconds per simulated second against N).

Writes DIR/report.json (default /tmp/sim-scale). With --time-limit-s the simulation stops at the first tick past the
limit and the report says how far it got (``outer_steps_done``, ``sim_s``): a benchmark that does not finish still
says how far it came.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from hivetrain.sim.config import load_scenario
from hivetrain.sim.dataparallel import DataParallelSim
from hivetrain.sim.report import write_report

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default=str(ROOT / "scenarios/sim/dp-10000-moderate.toml"))
    parser.add_argument("--out", default="/tmp/sim-scale")
    parser.add_argument("--outer-steps", type=int, default=None, help="override [sim].outer_steps")
    parser.add_argument("--time-limit-s", type=float, default=0.0, help="wall seconds; 0 = no limit")
    parser.add_argument("--num-peers", type=int, default=None, help="override [sim].num_peers")
    parser.add_argument("--max-sim-s", type=float, default=None, help="override [sim].max_sim_s, simulated seconds")
    args = parser.parse_args()
    scenario = load_scenario(args.scenario)
    if args.outer_steps:
        scenario = replace(scenario, sim=replace(scenario.sim, outer_steps=args.outer_steps))
    if args.num_peers:
        scenario = replace(scenario, sim=replace(scenario.sim, num_peers=args.num_peers))
    if args.max_sim_s:
        scenario = replace(scenario, sim=replace(scenario.sim, max_sim_s=args.max_sim_s))
    sim = DataParallelSim(scenario)
    if args.time_limit_s > 0:
        sim.wall_deadline = time.perf_counter() + args.time_limit_s
    cpu_started = time.process_time()
    metrics = sim.run()
    cpu_s = time.process_time() - cpu_started  # this process's CPU seconds: less noisy than wall_s on a shared box
    report = write_report(metrics, args.out, scenario.averaging.target_group_size, scenario.sim.seed)
    keys = ("scenario", "peers", "outer_steps_done", "sim_s", "utilization_mean", "committed_sample_share",
            "peak_dht_value_bytes", "dht_read_bytes_per_peer_per_step", "time_per_outer_step_s", "wall_s")  # fmt: skip
    print(json.dumps({k: report[k] for k in keys}, indent=1))
    print(json.dumps({"decisions": report["decisions"], "group_size_mean": report["group_size_mean"]}))
    print(f"wall_s {report['wall_s']:.1f} cpu_s {cpu_s:.1f}")


if __name__ == "__main__":
    main()
