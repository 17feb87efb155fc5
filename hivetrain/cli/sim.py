"""``hivetrain sim SCENARIO.toml --out DIR``: a discrete-event simulation of a volunteer swarm on this machine.

Simulated peers run hivetrain's own decision functions (schedule, matchmaking, groups, sync policy; in SWARM mode,
``[sim] mode = "swarm"``, routing, bans and rebalancing) over a modelled network; training is modelled, not run.
Writes ``DIR/report.json`` and ``DIR/drift.png`` (data-parallel) or ``DIR/report.json`` (SWARM). Exit codes: 0 done,
2 bad scenario or arguments.
"""

from __future__ import annotations

import argparse
import json

from hivetrain.cli.common import EXIT_BAD_INPUT, fail


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hivetrain sim", description=__doc__.splitlines()[0])
    parser.add_argument("scenario", help="a scenario TOML file (e.g. scenarios/sim/dp-100.toml)")
    parser.add_argument("--out", required=True, help="directory for report.json (and drift.png)")
    parser.add_argument("--seed", type=int, default=None, help="override [sim].seed (same seed = same report)")
    parser.add_argument("--outer-steps", type=int, default=None, help="override [sim].outer_steps (data-parallel mode)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dataclasses import replace

    from hivetrain.sim.config import load_scenario

    try:
        scenario = load_scenario(args.scenario)
        if args.seed is not None:
            scenario = replace(scenario, sim=replace(scenario.sim, seed=args.seed))
        if args.outer_steps is not None:
            scenario = replace(scenario, sim=replace(scenario.sim, outer_steps=args.outer_steps))
    except (ValueError, FileNotFoundError) as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    if scenario.sim.mode == "swarm":
        from hivetrain.sim.pipeline import PipelineSim
        from hivetrain.sim.report import write_pipeline_report

        report = write_pipeline_report(PipelineSim(scenario).run(), args.out)
        keys = ("peers", "num_stages", "pipeline_throughput_mb_per_s", "ideal_throughput_mb_per_s", "rerouted_share",
                "moves", "wall_s")  # fmt: skip
        print(json.dumps({k: report[k] for k in keys}))
        return 0
    from hivetrain.sim.dataparallel import DataParallelSim
    from hivetrain.sim.report import write_report

    metrics = DataParallelSim(scenario).run()
    report = write_report(metrics, args.out, scenario.averaging.target_group_size, scenario.sim.seed)
    keys = ("peers", "outer_steps_done", "consensus_rounds", "utilization_mean", "committed_sample_share",
            "peak_dht_value_bytes", "wall_s")  # fmt: skip
    print(json.dumps({k: report[k] for k in keys}))
    if report.get("partition"):
        print(json.dumps({"partition": report["partition"]}))
    return 0
