"""How many downloaders should one donor serve at once? A flash crowd simulated side by side, one seed per cap.

    nice -n 10 python scripts/bench/sim_donor_cap.py [--peers 100] [--joiners 100] [--caps 0,2,4,8,16]
        [--outer-steps 6] [--time-limit-s 600] [--json OUT.json]

Each run is ``scenarios/sim/dp-1000-flash.toml`` (a 25M-parameter model, a 200 MB state, home and datacenter links,
no churn) at ``--peers`` volunteers with ``--joiners`` arriving at once at t = 600 s, every joiner fetching from every
holder ``decide_sync`` names (``download.num_donors = 0``, as the trainer does: at most one donor per 16 MB chunk),
and ``download.max_downloaders`` = the cap (``diloco.max_downloaders``; 0 = none): a donor at the cap answers "busy"
and the joiner takes its chunks from the others. Printed per cap: the crowd's catch-up (mean, p90, max seconds from a
joiner's download start to its end), when its last member held the state (``all_s``, from the crowd's arrival),
members still waiting at the end, the most bytes one donor served the crowd, and the time per outer step of the
swarm. A cap spreads the crowd over every holder instead of the fastest few; too small a cap leaves joiners waiting
for a free donor.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from hivetrain.sim.config import load_scenario
from hivetrain.sim.dataparallel import DataParallelSim

ROOT = Path(__file__).resolve().parents[2]


def run(peers: int, joiners: int, cap: int, outer_steps: int, time_limit_s: float) -> dict[str, Any]:
    """One simulated run's summary."""
    base = load_scenario(ROOT / "scenarios/sim/dp-1000-flash.toml")
    scenario = replace(
        base,
        name=f"flash-{peers}+{joiners}-cap{cap}",
        sim=replace(base.sim, num_peers=peers, outer_steps=outer_steps),
        flash_crowd=replace(base.flash_crowd, num_joiners=joiners),
        download=replace(base.download, num_donors=0, max_downloaders=cap),
    )
    sim = DataParallelSim(scenario)
    if time_limit_s > 0:
        sim.wall_deadline = time.perf_counter() + time_limit_s
    metrics = sim.run()
    summary = dict(metrics.summary)
    summary["cap"] = cap
    summary["all_donors_busy"] = metrics.decisions.get("download.all_donors_busy", 0)
    return summary


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=100, help="volunteers before the crowd")
    parser.add_argument("--joiners", type=int, default=100, help="joiners arriving at once")
    parser.add_argument("--caps", default="0,2,4,8,16", help="downloaders per donor, comma-separated; 0 = no cap")
    parser.add_argument("--outer-steps", type=int, default=6, help="outer steps per run")
    parser.add_argument("--time-limit-s", type=float, default=600.0, help="wall seconds per run; 0 = no limit")
    parser.add_argument("--json", default="", help="also write every run's summary here")
    args = parser.parse_args()
    rows = []
    for cap in (int(x) for x in args.caps.split(",") if x):
        r = run(args.peers, args.joiners, cap, args.outer_steps, args.time_limit_s)
        rows.append(r)
        print(
            f"cap={cap:<3} catch-up mean/p90/max={_s(r['flash_catchup_s_mean'])}/{_s(r['flash_catchup_s_p90'])}/"
            f"{_s(r['flash_catchup_s_max'])}s all_s={_s(r['flash_all_caught_up_s'])} "
            f"downloads={r['flash_downloads']} still_syncing={r['flash_still_syncing']} "
            f"busiest_donor_MB={r['flash_max_donor_bytes'] / 1e6:.0f} busy_waits={r['all_donors_busy']} "
            f"steps={r['outer_steps_done']} step_s={_s(r['time_per_outer_step_s'])} wall_s={r['wall_s']:.0f}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2, sort_keys=True, default=str) + "\n")


if __name__ == "__main__":
    main()
