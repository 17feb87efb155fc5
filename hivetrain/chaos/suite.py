"""Several chaos scenarios in a row, their figures in one table (``hivetrain chaos suite``, ``scripts/chaos_full``).

``run_suite(out, names)`` runs each scenario into ``out/<name>/`` and writes ``out/results.json`` (every report) and
``out/results.md`` (the table).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from hivetrain.chaos.runner import run_scenario
from hivetrain.chaos.scenario import load_scenario, resolve_scenario

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


def run_suite(out: Path, names: list[str], say: Callable[[str], None] = print) -> list[dict]:
    """Run the scenarios ``names`` (bundled names or TOML paths) one after the other; returns their table rows (a
    row's "passed" is "yes" or "NO"). Raises ValueError / FileNotFoundError for a bad scenario before running any."""
    scenarios = [load_scenario(resolve_scenario(name)) for name in names]
    reports, rows = {}, []
    started = time.time()
    for scenario in scenarios:
        say(f"=== {scenario.name}: {scenario.description}")
        report = run_scenario(scenario, out / scenario.name, log=lambda line: say(f"    {line}"))
        reports[scenario.name] = report
        rows.append(row(report))
        say(f"=== {scenario.name}: {'passed' if report['passed'] else 'FAILED'} in {report['figures']['wall_s']}s")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(reports, indent=2))
    table = markdown(rows)
    (out / "results.md").write_text(table + "\n")
    say("")
    say(table)
    say(
        f"\n{sum(r['passed'] == 'yes' for r in rows)} passed, {sum(r['passed'] != 'yes' for r in rows)} failed "
        f"in {time.time() - started:.0f}s; reports in {out}"
    )
    return rows
