"""``hivetrain chaos run SCENARIO --out DIR``, ``chaos suite OUT_DIR [SCENARIO ...]`` and ``chaos list``:
fault-injection scenarios on this machine.

``run`` launches a coordinator and peers as real processes, applies the scenario's faults, and writes
``DIR/report.json``, ``DIR/summary.txt`` and ``DIR/plot.png``. ``suite`` runs several (every bundled scenario by
default) one after the other, each into ``OUT_DIR/<name>/``, and prints their figures as one table (also
``OUT_DIR/results.md``, every report in ``OUT_DIR/results.json``). Exit codes: 0 every invariant held (in every
scenario), 1 an invariant broke, 2 bad scenario or arguments, 130 interrupted (everything started is stopped first).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hivetrain.cli.common import EXIT_BAD_INPUT, EXIT_INTERRUPTED, Interrupted, fail, install_signal_handlers

EXIT_BROKEN = 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hivetrain chaos", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one scenario and write its report")
    run.add_argument("scenario", help="a scenario TOML file, or the name of a bundled scenario (see `chaos list`)")
    run.add_argument("--out", required=True, help="directory for logs, metrics, report.json, summary.txt, plot.png")
    run.add_argument(
        "--config",
        default=None,
        help="run config TOML to test instead of the scenario's [run] table (e.g. the config you will launch with)",
    )
    run.add_argument("-q", "--quiet", action="store_true", help="print only the summary")
    suite = sub.add_parser("suite", help="run several scenarios in a row and tabulate their figures")
    suite.add_argument("out", help="directory: one subdirectory per scenario, results.json and results.md")
    suite.add_argument("scenarios", nargs="*", help="scenario names or TOML files (default: every bundled scenario)")
    sub.add_parser("list", help="list the bundled scenarios, one line each")
    return parser


def _load(args: argparse.Namespace):
    from hivetrain.chaos.scenario import load_scenario, parse_scenario, resolve_scenario

    scenario = load_scenario(resolve_scenario(args.scenario))
    if args.config:
        from hivetrain.config import load_run_config

        run = load_run_config(args.config).to_dict()
        # keep the scenario's length: a scenario's faults are timed against its own number of outer steps
        run["diloco"]["outer_steps"] = scenario.run_config().diloco.outer_steps
        scenario = parse_scenario(
            {**scenario.model_dump(mode="json"), "run": run}, f"{args.scenario} with {args.config}"
        )
    return scenario


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "list":
        return _list()
    install_signal_handlers()  # SIGTERM/SIGINT unwind through the runner's cleanup (even when run in background)
    if args.command == "suite":
        return _suite(args)
    try:
        scenario = _load(args)
    except (ValueError, FileNotFoundError) as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    from hivetrain.chaos.report import format_summary
    from hivetrain.chaos.runner import run_scenario

    out = Path(args.out)
    try:
        report = run_scenario(scenario, out, log=(lambda line: None) if args.quiet else print)
    except Interrupted:
        print("interrupted: every process started was stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(format_summary(report))
    print(f"\nreport: {out / 'report.json'}  plot: {out / 'plot.png'}  logs: {out}")
    return 0 if report["passed"] else EXIT_BROKEN


def _suite(args: argparse.Namespace) -> int:
    from hivetrain.chaos.scenario import bundled_scenarios
    from hivetrain.chaos.suite import run_suite

    try:
        names = args.scenarios or list(bundled_scenarios())
        rows = run_suite(Path(args.out), names, lambda line: print(line, flush=True))
    except (ValueError, FileNotFoundError) as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    except Interrupted:
        print("interrupted: every process started was stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0 if all(r["passed"] == "yes" for r in rows) else EXIT_BROKEN


def _list() -> int:
    from hivetrain.chaos.scenario import bundled_scenarios, load_scenario

    for name, path in bundled_scenarios().items():
        try:
            scenario = load_scenario(path)
            print(f"{name:<28} {scenario.peers} peers, <= {scenario.max_duration_s:>4.0f}s  {scenario.description}")
        except ValueError as exc:
            print(f"{name:<28} INVALID: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
