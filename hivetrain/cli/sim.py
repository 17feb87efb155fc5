"""``hivetrain sim SCENARIO.toml --out DIR``: a discrete-event simulation of a volunteer swarm on this machine.

Simulated peers run hivetrain's own decision functions (schedule, matchmaking, groups, sync policy; in SWARM mode,
``[sim] mode = "swarm"``, routing, bans and rebalancing) over a modelled network; training is modelled, not run.
Writes ``DIR/report.json`` and ``DIR/drift.png`` (data-parallel) or ``DIR/report.json`` (SWARM). A data-parallel run
shows its progress (simulated time, outer steps) while it runs; stopped by ``--time-limit-s`` or Ctrl+C (once: a
second one exits at once), it still writes the report of what it simulated, with ``stopped_by`` saying why. Exit
codes: 0 done, 2 bad scenario or arguments, 130 interrupted (the partial report written).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

from hivetrain.cli.common import EXIT_BAD_INPUT, EXIT_INTERRUPTED, fail

PLAIN_PROGRESS_EVERY_S = 30.0
"""Wall seconds between progress lines when stderr is not a terminal (a log file): a 300-peer run takes ~15 min."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hivetrain sim", description=__doc__.splitlines()[0])
    parser.add_argument("scenario", help="a scenario TOML file (e.g. scenarios/sim/dp-100.toml)")
    parser.add_argument("--out", required=True, help="directory for report.json (and drift.png)")
    parser.add_argument("--seed", type=int, default=None, help="override [sim].seed (same seed = same report)")
    parser.add_argument("--outer-steps", type=int, default=None, help="override [sim].outer_steps (data-parallel mode)")
    parser.add_argument(
        "--time-limit-s",
        type=float,
        default=0.0,
        help="wall seconds after which a data-parallel run stops and reports what it simulated (0 = no limit)",
    )
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

    sim = DataParallelSim(scenario)
    if args.time_limit_s > 0:
        sim.wall_deadline = time.perf_counter() + args.time_limit_s
    with _progress(scenario.sim.outer_steps) as on_tick, _stop_on_sigint(sim):
        sim.on_tick = on_tick
        metrics = sim.run()
    report = write_report(metrics, args.out, scenario.averaging.target_group_size, scenario.sim.seed)
    keys = ("peers", "outer_steps_done", "consensus_rounds", "utilization_mean", "committed_sample_share",
            "peak_dht_value_bytes", "wall_s")  # fmt: skip
    print(json.dumps({k: report[k] for k in keys}))
    if report.get("partition"):
        print(json.dumps({"partition": report["partition"]}))
    if sim.stopped_by in ("time_limit", "interrupted"):
        print(
            f"stopped by {'--time-limit-s' if sim.stopped_by == 'time_limit' else 'Ctrl+C'} after "
            f"{report['outer_steps_done']} of {scenario.sim.outer_steps} outer steps: the report covers what was "
            f"simulated ({args.out}/report.json)",
            file=sys.stderr,
        )
    return EXIT_INTERRUPTED if sim.stopped_by == "interrupted" else 0


class _progress:
    """Progress of a data-parallel run: a rich bar of outer steps with the simulated time on a terminal, else a plain
    line every ``PLAIN_PROGRESS_EVERY_S`` wall seconds. Used as ``with _progress(total) as on_tick``."""

    def __init__(self, total: int):
        self.total, self.bar, self.task, self.last_line = total, None, None, float("-inf")  # first tick: a line

    def __enter__(self):
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("outer steps"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                TimeElapsedColumn(), console=Console(stderr=True), transient=True,
            )  # fmt: skip
            self.bar.start()
            self.task = self.bar.add_task("simulated 0 s", total=self.total)
        return self.on_tick

    def on_tick(self, sim_s: float, steps: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=min(steps, self.total), description=f"simulated {sim_s:,.0f} s")
        elif time.perf_counter() - self.last_line >= PLAIN_PROGRESS_EVERY_S:
            self.last_line = time.perf_counter()
            print(f"sim: {steps}/{self.total} outer steps, {sim_s:,.0f} simulated s", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


class _stop_on_sigint:
    """The first SIGINT ends the run at its next tick (the report is still written); a second exits at once."""

    def __init__(self, sim):
        self.sim, self.previous = sim, None

    def __enter__(self):
        def handler(_signum, _frame):
            if self.sim.stopped_by is not None or self.sim.wall_deadline == float("-inf"):
                raise SystemExit(EXIT_INTERRUPTED)  # the second one: quit now, without a report or a traceback
            print("\nstopping: writing the report of what was simulated (Ctrl+C again to quit now)", file=sys.stderr)
            self.sim.stop("interrupted")

        self.previous = signal.signal(signal.SIGINT, handler)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self.previous)
