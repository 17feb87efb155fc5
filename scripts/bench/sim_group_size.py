"""Which averaging group keeps the most of the swarm's compute under churn? Simulated side by side, one seed.

    nice -n 10 python scripts/bench/sim_group_size.py [--sizes 100,1000] [--churn moderate,heavy]
        [--configs butterfly:8,butterfly:16,butterfly:32,butterfly:64,moshpit:16] [--outer-steps 8]
        [--time-limit-s 300] [--json OUT.json]

Each run is ``scenarios/sim/dp-100.toml`` (a 25M-parameter model, 100 inner steps of 8 samples, log-normal speeds
over 10x, home links) at N peers with the given churn (``sim_sweep.CHURN``: moderate = exponential sessions of mean
1 h, heavy = Weibull shape 0.5, mean 30 min) and one averaging configuration ``STRATEGY:TARGET_GROUP_SIZE``.
Printed per run: ``kept`` = committed share - discarded share (samples that went into a committed round and stayed in
the state the swarm keeps, over samples computed), the committed and discarded shares, where the lost samples went
(``lost_sample_shares``), the final drift, utilization and time per outer step. All-or-nothing rounds make a group's
chance to commit fall with its size times the round's duration over the mean session; several butterfly groups per
epoch fork the state, which the next ``decide_sync`` discards but for one group. This bench weighs the two.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_sweep import CHURN, round_timeout_for  # noqa: E402

from hivetrain.sim.config import load_scenario  # noqa: E402
from hivetrain.sim.dataparallel import DataParallelSim  # noqa: E402


def run(n: int, churn: str, strategy: str, group_size: int, outer_steps: int, time_limit_s: float) -> dict[str, Any]:
    """One simulated run's report, with ``kept`` added."""
    base = load_scenario(ROOT / "scenarios/sim/dp-100.toml")
    sim_cfg = replace(base.sim, num_peers=n, outer_steps=outer_steps, schedule_probes=2)
    timeout_s = round_timeout_for(n, base.averaging.round_timeout_s)
    averaging = replace(base.averaging, strategy=strategy, target_group_size=group_size, round_timeout_s=timeout_s)
    scenario = replace(
        base, name=f"dp-{n}-{churn}-{strategy}{group_size}", churn=CHURN[churn], sim=sim_cfg, averaging=averaging
    )
    sim = DataParallelSim(scenario)
    if time_limit_s > 0:
        sim.wall_deadline = time.perf_counter() + time_limit_s
    summary = dict(sim.run().summary)
    summary["kept"] = summary["committed_sample_share"] - summary["discarded_sample_share"]
    summary["config"] = f"{strategy}:{group_size}"
    summary["churn_label"] = churn
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100,1000", help="peer counts, comma-separated")
    parser.add_argument("--churn", default="moderate,heavy", help="churn levels: none, moderate, heavy")
    parser.add_argument("--configs", default="butterfly:8,butterfly:16,butterfly:32,butterfly:64,moshpit:16")
    parser.add_argument("--outer-steps", type=int, default=8, help="outer steps per run")
    parser.add_argument("--time-limit-s", type=float, default=300.0, help="wall seconds per run; 0 = no limit")
    parser.add_argument("--json", default="", help="also write every run's summary here")
    args = parser.parse_args()
    rows = []
    for n in (int(x) for x in args.sizes.split(",") if x):
        for churn in args.churn.split(","):
            for config in args.configs.split(","):
                strategy, size = config.split(":")
                r = run(n, churn, strategy, int(size), args.outer_steps, args.time_limit_s)
                rows.append(r)
                lost = ", ".join(f"{k} {v:.2f}" for k, v in r["lost_sample_shares"].items() if k != "unaccounted")
                step_s = r["time_per_outer_step_s"]
                print(
                    f"N={n:<5} churn={churn:<8} {config:<13} steps={r['outer_steps_done']:<2} kept={r['kept']:.2f} "
                    f"committed={r['committed_sample_share']:.2f} discarded={r['discarded_sample_share']:.2f} "
                    f"drift={r['drift_final']:.3g} util={r['utilization_mean']:.2f} "
                    f"step_s={step_s if step_s is None else round(step_s)} wall_s={r['wall_s']:.0f} lost: {lost}",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2, sort_keys=True, default=str) + "\n")


if __name__ == "__main__":
    main()
