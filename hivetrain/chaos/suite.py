"""Run several chaos scenarios in a row and tabulate their figures (``scripts/chaos_full``).

``python -m hivetrain.chaos.suite OUT_DIR [SCENARIO ...]``: every bundled scenario by default, each into
``OUT_DIR/<name>/``; prints a table, writes ``OUT_DIR/results.json`` and ``OUT_DIR/results.md``. Exit status 0 when
every scenario passed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from hivetrain.chaos.runner import run_scenario
from hivetrain.chaos.scenario import bundled_scenarios, load_scenario, resolve_scenario

COLUMNS = (
    ("scenario", "scenario"),
    ("passed", "passed"),
    ("steps", "outer steps committed / target"),
    ("gap_s", "longest gap without a committed step (s)"),
    ("recovery_s", "recovery per fault (s)"),
    ("lost", "samples lost"),
    ("diverged", "peers diverged"),
    ("loss", "eval loss start -> end"),
    ("wall_s", "wall time (s)"),
    ("broken", "broken invariants"),
)


def row(report: dict) -> dict:
    """One table row of a report."""
    fig = report["figures"]
    recov = [f"{f['recovery_s']:.1f}" if f.get("recovery_s") is not None else "-" for f in report["faults"]]
    if len(recov) > 6:
        recov = recov[:6] + [f"... ({len(recov)})"]
    loss = "-"
    if fig["initial_eval_loss"] is not None and fig["final_eval_loss"] is not None:
        loss = f"{fig['initial_eval_loss']:.2f} -> {fig['final_eval_loss']:.2f}"
    return {
        "scenario": report["scenario"],
        "passed": "yes" if report["passed"] else "NO",
        "steps": f"{fig['outer_steps_committed']}/{fig['target_outer_steps']}",
        "gap_s": "-" if fig["longest_gap_s"] is None else f"{fig['longest_gap_s']:.1f}",
        "recovery_s": " ".join(recov) or "-",
        "lost": str(fig["samples_lost"]),
        "diverged": str(fig["peers_diverged"]),
        "loss": loss,
        "wall_s": f"{fig['wall_s']:.0f}",
        "broken": ", ".join(k for k, ok in report["invariants"].items() if not ok) or "-",
    }


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r[k] for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m hivetrain.chaos.suite OUT_DIR [SCENARIO ...]", file=sys.stderr)
        return 2
    from hivetrain.cli.common import install_signal_handlers

    install_signal_handlers()  # SIGTERM/SIGINT unwind through the runner's cleanup (even when run in background)
    out = Path(argv[0])
    names = argv[1:] or list(bundled_scenarios())
    reports, rows = {}, []
    started = time.time()
    for name in names:
        scenario = load_scenario(resolve_scenario(name))
        print(f"=== {scenario.name}: {scenario.description}", flush=True)
        report = run_scenario(scenario, out / scenario.name, log=lambda line: print("   ", line, flush=True))
        reports[scenario.name] = report
        rows.append(row(report))
        print(f"=== {scenario.name}: {'passed' if report['passed'] else 'FAILED'} in {report['figures']['wall_s']}s")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(reports, indent=2))
    table = markdown(rows)
    (out / "results.md").write_text(table + "\n")
    print()
    print(table)
    print(
        f"\n{sum(r['passed'] == 'yes' for r in rows)} passed, {sum(r['passed'] != 'yes' for r in rows)} failed "
        f"in {time.time() - started:.0f}s; reports in {out}"
    )
    return 0 if all(r["passed"] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
