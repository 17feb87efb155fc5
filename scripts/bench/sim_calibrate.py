"""Benchmark: a real local swarm against the simulation on the same settings; prints a side-by-side table.

Runs ``hivetrain local-swarm`` (tiny model, one torch thread per peer, loopback) and then ``hivetrain.sim`` with the
same peers, inner steps, batch size, model bytes, schedule and ``[averaging]`` table, and compares them over the first
K - 1 round keys (the last is distorted by peers that reached K and left), the simulation's figures as medians over
``--sim-seeds`` seeds: outer steps, committed samples (total and per peer), failed rounds, "late" verdicts, state
downloads, mean group size, time per outer step, utilization, each with its tolerance
(``hivetrain.sim.calibrate.TOLERANCES``) and PASS/FAIL.

What the simulation takes from the real run (printed as "fit"):
- measured: each peer's speed (samples / wall seconds of its inner phases, duty-cycle sleeps included;
  ``peers.compute = "list"``) and the model's bytes (4 x its parameters);
- fitted: ``peers.speed_jitter`` (spread of the phases' log-speeds), ``peers.outer_step_s`` (median time from a
  round's end to the next phase: outer step, evaluation, state check) and the per-round fixed cost on loopback
  (median over groups of the last arriver's averaging call), put in as the links' one-way latency (the all-reduce
  costs 4 latencies plus its bytes over an assumed 8 Gbit/s);
- not modelled: start-up (every simulated peer starts at 0), the run's coordinator as evidence for a resync.

    nice -n 10 python scripts/bench/sim_calibrate.py --peers 4 --target-group-size 4 --out /tmp/simcal/a
    nice -n 10 python scripts/bench/sim_calibrate.py --peers 6 --target-group-size 3 --out /tmp/simcal/b
    nice -n 10 python scripts/bench/sim_calibrate.py --peers 6 --target-group-size 3 --schedule steps \
        --duty-cycles 1,1,1,1,1,0.5 --out /tmp/simcal/c      (a slow peer: the "late" storm)
    ... --real-dir DIR   (compare an existing local-swarm output instead of running one)

Writes OUT/calibration.json (figures, fit, table). Exit code 0 whatever the verdicts (a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from hivetrain.config import load_run_config
from hivetrain.localswarm.summary import read_events
from hivetrain.sim import calibrate as cal
from hivetrain.sim.config import Scenario, parse_scenario
from hivetrain.sim.dataparallel import DataParallelSim

LOOPBACK_MBPS = 8000.0  # assumed: the tiny model's bytes take ~3 ms at this rate; the fixed cost is fitted


def run_real(args: argparse.Namespace, out: Path) -> Path:
    """Write the run config and run ``hivetrain local-swarm``; returns its output directory."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / "run-config.toml"
    config.write_text(
        f'run_id = "simcal"\nmodel = "tiny"\n[data]\nseq_len = 64\nbatch_size = {args.batch_size}\n'
        f"num_eval_windows = 4\nmax_corpus_bytes = 2_000_000\n[diloco]\ninner_steps = {args.inner_steps}\n"
        f'inner_lr = 0.003\nwarmup_steps = 5\nouter_steps = {args.outer_steps}\nschedule = "{args.schedule}"\n'
        "[averaging]\n"
        f'strategy = "butterfly"\ntarget_group_size = {args.target_group_size}\n'
        f"matchmaking_time_s = {args.matchmaking_time_s}\nround_timeout_s = {args.round_timeout_s}\n"
    )
    real = out / "real"
    hivetrain = Path(sys.executable).parent / "hivetrain"
    cmd = ["nice", "-n", "10", str(hivetrain), "local-swarm", "--peers", str(args.peers), "--out", str(real),
           "--config", str(config), "--threads-per-peer", "1", "--timeout", "900"]  # fmt: skip
    if args.duty_cycles:
        cmd += ["--duty-cycles", args.duty_cycles]
    print("uptime before:", os.getloadavg(), flush=True)
    started = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    print(f"local-swarm exit {done.returncode} in {time.time() - started:.0f} s; uptime after: {os.getloadavg()}")
    (out / "local-swarm.log").write_text(done.stdout + done.stderr)
    return real


def sim_log(sim: DataParallelSim) -> cal.RunLog:
    """Observe a simulation (before ``run``): its phases, commits, failures and downloads as a ``RunLog``. Slot k is
    initial peer k; joiners would be later slots (none here: no churn)."""
    n = sim.sc.sim.num_peers
    log = cal.RunLog(n, [0.0] * n)
    st, rounds, metrics = sim.state, sim.rounds, sim.metrics
    end_phase, commit, fail, record_download = st.end_phase, rounds._commit, rounds.fail, metrics.record_download

    def on_end_phase(slot, num_samples, compute_s, rng):
        log.phases.append(cal.Phase(slot, int(st.i["phase_epoch"][slot]), sim.env.now, num_samples, compute_s))
        end_phase(slot, num_samples, compute_s, rng)

    def on_commit(slots, averaged, epoch, state_hash, now):
        for k, slot in enumerate(slots.tolist()):
            group = state_hash if isinstance(state_hash, str) else state_hash[k]
            log.commits.append(cal.Commit(slot, epoch, now, float(st.f["weight"][slot]), len(slots), group))
        commit(slots, averaged, epoch, state_hash, now)

    def on_fail(slots, epoch, failure, now):
        log.failures += [cal.Failure(int(s), epoch, now, failure) for s in slots]
        fail(slots, epoch, failure, now)

    def on_download(slot, donors, cost, started, now, flash):
        log.downloads.append((slot, now))
        record_download(slot, donors, cost, started, now, flash)

    st.end_phase, rounds._commit, rounds.fail, metrics.record_download = on_end_phase, on_commit, on_fail, on_download
    return log


def scenario_for(real: Path, log: cal.RunLog, seed: int, jitter: bool = True) -> tuple[Scenario, dict]:
    """The simulated twin of the real run in ``real`` (its run.toml and summary.json), and the fit (``jitter``:
    the fitted per-phase speed jitter, else 0)."""
    run = load_run_config(real / "run.toml")
    summary = json.loads((real / "summary.json").read_text())
    model_bytes = 4 * int(summary["num_parameters"])
    speeds = cal.fit_speeds(log)
    round_s = cal.fit_round_s(log)
    sizes = [c.group_size for c in log.commits if c.group_size > 1] or [2]
    g = float(np.median(sizes))
    transfer_s = (2 - 2 / g) * model_bytes / (LOOPBACK_MBPS * 1e6 / 8)
    latency_s = max(0.0, (round_s - transfer_s) / 4)
    fit = {"samples_per_s": [round(s, 2) for s in speeds], "model_bytes": model_bytes,
           "outer_step_s": round(cal.fit_outer_step_s(log), 4), "round_s": round(round_s, 4),
           "speed_jitter": round(cal.fit_speed_jitter(log), 4) if jitter else 0.0,
           "latency_s": round(latency_s, 4)}  # fmt: skip
    avg = {k: v for k, v in run.to_dict()["averaging"].items()}
    raw = {
        "name": f"calibrate-{real.parent.name}",
        "sim": {"seed": seed, "num_peers": log.num_peers, "outer_steps": run.diloco.outer_steps + 1,
                "max_sim_s": 3600.0, "tick_s": 0.05, "model_bytes": model_bytes, "schedule_model": "real"},
        "peers": {"compute": "list", "samples_per_s": speeds, "datacenter_share": 1.0, "nat_share": 0.0,
                  "dc_upload_mbps": [LOOPBACK_MBPS] * 2, "dc_download_mbps": [LOOPBACK_MBPS] * 2,
                  "dc_latency_s": [latency_s] * 2, "outer_step_s": fit["outer_step_s"],
                  "speed_jitter": fit["speed_jitter"]},
        "schedule": {"schedule": run.diloco.schedule, "inner_steps": run.diloco.inner_steps,
                     "batch_size": run.diloco.samples_per_inner_step(run.data.batch_size),
                     "target_samples_per_epoch": run.diloco.target_samples_per_epoch,
                     "max_samples_per_peer": run.averaging.max_samples_per_round},
        "averaging": avg,
    }  # fmt: skip
    return parse_scenario(raw, "calibration"), fit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the real run, run config and calibration.json")
    parser.add_argument("--real-dir", default=None, help="compare this existing local-swarm output (no new run)")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--target-group-size", type=int, default=4)
    parser.add_argument("--outer-steps", type=int, default=6, help="K of the real run; K - 1 rounds are compared")
    parser.add_argument("--inner-steps", type=int, default=30, help="H (the swarm schedule's per-peer share)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--schedule", choices=("swarm", "steps"), default="swarm", help="diloco.schedule")
    parser.add_argument("--duty-cycles", default="", help="local-swarm --duty-cycles F1,F2,... (slower peers)")
    parser.add_argument("--matchmaking-time-s", type=float, default=2.0)
    parser.add_argument("--round-timeout-s", type=float, default=30.0)
    parser.add_argument("--sim-seeds", type=int, default=5, help="simulated runs (seeds 0..N-1); medians compared")
    parser.add_argument("--jitter", choices=("fit", "off"), default="fit", help="peers.speed_jitter: fitted or 0")
    args = parser.parse_args()
    out = Path(args.out)
    real = Path(args.real_dir) if args.real_dir else run_real(args, out)
    out.mkdir(parents=True, exist_ok=True)
    names = sorted((p for p in real.glob("peer*.jsonl")), key=lambda p: int(p.stem[4:]))
    rlog = cal.real_log([read_events(p) for p in names])
    runs, logs, decisions = [], [], []
    for seed in range(args.sim_seeds):
        scenario, fit = scenario_for(real, rlog, seed, jitter=args.jitter == "fit")
        num_rounds = scenario.sim.outer_steps - 2  # K - 1
        sim = DataParallelSim(scenario)
        logs.append(sim_log(sim))
        decisions.append(sim.run().summary["decisions"])
        runs.append(cal.figures(logs[-1], num_rounds))
    real_figs, sim_figs = cal.figures(rlog, num_rounds), cal.median_figures(runs)
    rows = cal.compare(real_figs, sim_figs)
    print(f"fit: {json.dumps(fit)}")
    print(f"compared round keys 0..{num_rounds - 1}; sim: median of {args.sim_seeds} seeds; windows real "
          f"{real_figs['window_s']:.1f} s, sim {sim_figs['window_s']:.1f} s")  # fmt: skip
    fmt = lambda v: "[" + ", ".join(f"{x:.0f}" for x in v) + "]" if isinstance(v, list) else f"{v:.3g}"  # noqa: E731
    print(f"| {'figure':<27} | {'real':>28} | {'sim':>28} | {'tolerance':>10} | verdict |")
    for r in rows:
        verdict = "PASS" if r.ok else "FAIL"
        print(f"| {r.name:<27} | {fmt(r.real):>28} | {fmt(r.sim):>28} | {r.tolerance:>10} | {verdict} |")
    for name in ("failed_rounds", "late_verdicts", "state_downloads"):
        print(f"sim {name} per seed: {[int(r[name]) for r in runs]}")
    print("real failures:", dict(Counter((f.round_key, f.reason) for f in rlog.failures)))
    print("sim failures (seed 0):", dict(Counter((f.round_key, f.reason) for f in logs[0].failures)))
    print("real group sizes by round:", dict(Counter((c.round_key, c.group_size) for c in rlog.commits)))
    print("sim group sizes by round (seed 0):", dict(Counter((c.round_key, c.group_size) for c in logs[0].commits)))
    print("sim decisions (seed 0):", decisions[0])
    table = [{"figure": r.name, "real": r.real, "sim": r.sim, "tolerance": r.tolerance, "ok": r.ok} for r in rows]
    result = {"real_dir": str(real), "fit": fit, "num_rounds": num_rounds, "real": real_figs, "sim": sim_figs,
              "sim_runs": runs, "table": table, "sim_decisions": decisions}  # fmt: skip
    (out / "calibration.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
