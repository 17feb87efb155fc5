#!/usr/bin/env python3
"""Learning per byte: DiLoCo vs tuned data parallelism, overlapped DiLoCo and asynchronous SGD, same samples.

Every arm trains the same model from the same initial parameters on the same per-worker data streams for the same
number of samples, W workers simulated one after another in one process (``lpb_arms.py`` says what each arm does
and how bytes are counted). The bench is a sweep of *families* (rows of the table): each family tunes its
hyper-parameters on seed 0 over a small grid, then runs its best setting on the other seeds; a family may take
its grid from another family's best (the long runs reuse the short runs' choices). Runs go to ``--jobs`` worker
processes; ``--results FILE`` keeps every finished run (JSON lines) so an interrupted sweep resumes where it was.

Plans (``--plan``):
  quick    smoke run (< 1 min): tiny model, 2 workers, 20 steps of 4 windows of 32 tokens, one seed, every arm.
  default  the README's Performance table (~35 min on 2 free cores; at nice 19 beside other work, longer). 4
           workers, 8 windows of 64 tokens per worker per step, inner lr 2e-3, 20 warmup steps, cosine decay over
           the run. Tiny preset, 400 steps: DDP lr ∈ {1,2,4}e-3; DiLoCo H = 40 (10 outer steps) over outer lr
           {0.5,0.7,1.0} × momentum {0,0.5,0.9}; H = 20 and H = 10 over (1,0), (0.7,0.5), (0.7,0.9); overlap
           delayed and eager at H = 40 over outer lr {1,0.7,0.5,0.3} with momentum 0; async SGD lr ∈
           {0.25,0.5,1,2}e-3; the config defaults (``DilocoConfig``) and the paper's 0.7/0.9 at H = 40. 1200
           steps: DDP at the 400-step lr; DiLoCo H = 10 (120 outer steps) over the 3 settings, the defaults and
           0.7/0.9. Three seeds per row. Small preset, 200 steps, one seed: DDP at lr 2e-3; DiLoCo H = 20 over the
           3 settings, the defaults and 0.7/0.9.
  full     every grid everywhere, 3 seeds (hours).
  codecs   the tiny/400 DDP and DiLoCo H = 40 rows of "default" (H = 40 over its 3 settings), then each ``--codecs``
           arm at H = 40's best setting, 3 seeds: the learning-per-byte table of the wire formats (issue 25).
  codecs-long  the same at 1,200 steps (30 outer steps at H = 40; DDP at lr 2e-3, the 400-step choice), each codec
           arm tuned over H = 40's best outer lr x {1, 1.5, 2, 3}.
  small-long  one seed on the small preset (10x the tiny model's parameters) for 2,000 steps, so the trend with size
           and length is visible (~50 min per run on a free core): DDP at lr 2e-3, DiLoCo H = 40 at the defaults (outer
           lr 1, no momentum: H = 40's pick on tiny at 400 and 1,200 steps), each ``--codecs`` arm at H = 40's outer
           lr times the scale the tiny/1200 tuning chose for it (read from ``dev/bench/lpb-codecs-long.jsonl``; a
           codec not tuned there: 2 for topk, 1 otherwise): no grid, one seed.
  fragments  Streaming DiLoCo (``diloco/fragments.py``) on the tiny/400 setup of "default": DDP, DiLoCo H = 40 and
           its eager overlap tuned as there; F = 4 fragments at H = 40's best setting (synchronous rounds of 1/4 of
           the model every 10 steps); F = 4 with each fragment's round overlapping the next 10 steps ("delayed"
           merge), over outer lr {1, 0.5} x mixing factor α {0, 0.5}. 3 seeds per row.

``--readme README.md`` writes the table into the README between the plan's markers (``lpb_readme.py``), with the
commits its runs were measured on; ``--results`` files record each run's commit. ``--json`` prints, as its last
line, a JSON list with one object per row: arm, preset, steps, inner_steps, eval_loss (mean over seeds),
eval_loss_std (sample std; null for one seed), seeds, bytes (whole run, all parties), bytes_vs_ddp, vs_ddp (relative
loss gap to the best DDP row of the same preset and steps), lr, outer_lr, outer_momentum, fragments, mix (null where
not applicable) and grid (seed-0 loss of every setting tried).

Example: nice -n 19 scripts/bench/diloco_vs_ddp.py --results /tmp/lpb.jsonl --json

The runs behind the README's tables are kept in ``dev/bench/lpb-<plan>.jsonl`` (from 2026-12-03 on): passing that file
as ``--results`` reuses them, so a table is regenerated (``--readme``) or extended by new arms without rerunning its
baselines. Runs are deterministic per (setup, arm, seed) on one machine; a change to a training path invalidates them
(delete the file's lines for the arms it touches).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lpb_readme  # noqa: E402
from lpb_arms import Arm, Setup, codec_config, run_arm  # noqa: E402

from hivetrain.diloco.config import DilocoConfig  # noqa: E402

DEFAULT_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinyshakespeare.txt"
OUTER_GRID = tuple((lr, mu) for lr in (0.5, 0.7, 1.0) for mu in (0.0, 0.5, 0.9))
OVERLAP_GRID = ((1.0, 0.0), (0.7, 0.0), (0.5, 0.0), (0.3, 0.0))  # a one-epoch delay wants a smaller step, no momentum
PLANS = ("quick", "default", "full", "codecs", "codecs-long", "small-long", "fragments")
OUTER_LR_SCALES = (1.0, 1.5, 2.0, 3.0)  # "codecs-long": a sparse update may want a larger outer step than fp32's


@dataclass(frozen=True)
class Family:
    """One row: a grid tuned on ``seeds[0]``, its best setting run on every seed.

    ``after``/``derive``: the grid is ``derive(best arm of family after)`` once that family has chosen.
    """

    label: str
    setup: Setup
    grid: tuple[Arm, ...] = ()
    seeds: tuple[int, ...] = (0, 1, 2)
    after: str = ""
    derive: Callable[[Arm], tuple[Arm, ...]] = field(default=lambda arm: (arm,), compare=False)


def diloco_grid(lr: float, h: int, settings, overlap: str = "off") -> tuple[Arm, ...]:
    return tuple(Arm("diloco", lr, h, olr, mu, overlap) for olr, mu in settings)


def defaults_arm(lr: float, h: int) -> Arm:
    cfg = DilocoConfig()
    return Arm("diloco", lr, h, cfg.outer_lr, cfg.outer_momentum)


def paper_arm(lr: float, h: int) -> Arm:
    """Douillard et al. 2023's outer Nesterov lr 0.7, momentum 0.9 (hivetrain's defaults until 2026-11-25)."""
    return Arm("diloco", lr, h, 0.7, 0.9)


def plan(name: str, data: str, codecs: list[str]) -> list[Family]:
    """The families of a plan (see the module docstring)."""
    lr = 2e-3
    three = ((1.0, 0.0), (0.7, 0.5), (0.7, 0.9))
    if name == "quick":
        s = Setup(data, "tiny", workers=2, steps=20, seq_len=32, batch_size=4, warmup_steps=4, eval_windows=8)
        one = ((1.0, 0.5),)
        return [
            Family("ddp", s, (Arm("ddp", lr),), (0,)),
            Family("diloco-H10", s, diloco_grid(lr, 10, one), (0,)),
            Family("diloco-H10-defaults", s, (defaults_arm(lr, 10),), (0,)),
            Family("diloco-H5-delayed", s, diloco_grid(lr, 5, one, "delayed"), (0,)),
            Family("diloco-H5-eager", s, diloco_grid(lr, 5, one, "eager"), (0,)),
            Family("async", s, (Arm("async", 1e-3),), (0,)),
        ] + [Family(f"diloco-H10-{c}", s, (), (0,), "diloco-H10", _codec(c)) for c in codecs]
    if name == "codecs":  # DDP and DiLoCo H = 40 tuned as in "default", then each codec at H = 40's best, 3 seeds
        short = Setup(data, "tiny", workers=4, steps=400, seq_len=64, batch_size=8, warmup_steps=20)
        fams = [
            Family("tiny/400/ddp", short, tuple(Arm("ddp", x) for x in (1e-3, 2e-3, 4e-3))),
            Family("tiny/400/diloco-H40", short, diloco_grid(lr, 40, three)),
        ]
        return fams + [
            Family(f"tiny/400/diloco-H40-{c}", short, after="tiny/400/diloco-H40", derive=_codec(c)) for c in codecs
        ]
    if name == "codecs-long":  # 1,200 steps: 30 outer steps at H = 40, where error feedback has time to send
        long = Setup(data, "tiny", workers=4, steps=1200, seq_len=64, batch_size=8, warmup_steps=20)
        fams = [
            Family("tiny/1200/ddp", long, (Arm("ddp", lr),)),  # the 400-step tuning's lr (1e-3 and 4e-3 lost)
            Family("tiny/1200/diloco-H40", long, diloco_grid(lr, 40, three)),
        ]
        return fams + [
            Family(f"tiny/1200/diloco-H40-{c}", long, after="tiny/1200/diloco-H40", derive=_codec(c, OUTER_LR_SCALES))
            for c in codecs
        ]
    if name == "small-long":  # the trend with size and length, one seed: no tuning at this size
        s = Setup(data, "small", workers=4, steps=2000, seq_len=64, batch_size=8, warmup_steps=20)
        h40 = defaults_arm(lr, 40)
        return [
            Family("small/2000/ddp", s, (Arm("ddp", lr),), (0,)),
            Family("small/2000/diloco-H40", s, (h40,), (0,)),
        ] + [Family(f"small/2000/diloco-H40-{c}", s, _codec(c, (long_outer_lr_scale(c),))(h40), (0,)) for c in codecs]
    if name == "fragments":  # Streaming DiLoCo, F = 4 at H = 40, against whole-model rounds with and without overlap
        short = Setup(data, "tiny", workers=4, steps=400, seq_len=64, batch_size=8, warmup_steps=20)
        streaming = tuple(
            Arm("diloco", lr, 40, olr, 0.0, "delayed", "", 4, a) for olr in (1.0, 0.5) for a in (0.0, 0.5)
        )
        return [
            Family("tiny/400/ddp", short, tuple(Arm("ddp", x) for x in (1e-3, 2e-3, 4e-3))),
            Family("tiny/400/diloco-H40", short, diloco_grid(lr, 40, three)),
            Family("tiny/400/diloco-H40-eager", short, diloco_grid(lr, 40, OVERLAP_GRID, "eager")),
            Family("tiny/400/diloco-H40-F4", short, after="tiny/400/diloco-H40", derive=_fragments(4)),
            Family("tiny/400/diloco-H40-F4-delayed", short, streaming),
        ]
    if name not in ("default", "full"):
        raise ValueError(f"unknown plan {name!r}")
    full = name == "full"
    short = Setup(data, "tiny", workers=4, steps=400, seq_len=64, batch_size=8, warmup_steps=20)
    long = replace(short, steps=1200)
    small = replace(short, preset="small", steps=200)
    ddp_grid = tuple(Arm("ddp", x) for x in (1e-3, 2e-3, 4e-3))
    outer_few = OUTER_GRID if full else three
    fams = [
        Family("tiny/400/ddp", short, ddp_grid),
        Family("tiny/400/diloco-H40", short, diloco_grid(lr, 40, OUTER_GRID)),
        Family("tiny/400/diloco-H40-defaults", short, (defaults_arm(lr, 40),)),
        Family("tiny/400/diloco-H40-paper", short, (paper_arm(lr, 40),)),
        Family("tiny/400/diloco-H20", short, diloco_grid(lr, 20, outer_few)),
        Family("tiny/400/diloco-H10", short, diloco_grid(lr, 10, OUTER_GRID if full else three)),
        Family("tiny/400/diloco-H40-delayed", short, diloco_grid(lr, 40, OVERLAP_GRID, "delayed")),
        Family("tiny/400/diloco-H40-eager", short, diloco_grid(lr, 40, OVERLAP_GRID, "eager")),
        Family("tiny/400/async", short, tuple(Arm("async", x) for x in (2.5e-4, 5e-4, 1e-3, 2e-3))),
    ]
    fams += [Family(f"tiny/400/diloco-H40-{c}", short, after="tiny/400/diloco-H40", derive=_codec(c)) for c in codecs]
    fams += [
        Family("tiny/1200/ddp", long, ddp_grid) if full else Family("tiny/1200/ddp", long, after="tiny/400/ddp"),
        Family("tiny/1200/diloco-H10", long, diloco_grid(lr, 10, outer_few)),
        Family("tiny/1200/diloco-H10-defaults", long, (defaults_arm(lr, 10),)),
        Family("tiny/1200/diloco-H10-paper", long, (paper_arm(lr, 10),)),
    ]
    seeds = (0, 1, 2) if full else (0,)  # budget: the small preset runs one seed, DDP at the tiny lr
    fams += [
        Family("small/200/ddp", small, ddp_grid if full else (Arm("ddp", lr),), seeds),
        Family("small/200/diloco-H20", small, diloco_grid(lr, 20, outer_few), seeds),
        Family("small/200/diloco-H20-defaults", small, (defaults_arm(lr, 20),), seeds),
        Family("small/200/diloco-H20-paper", small, (paper_arm(lr, 20),), seeds),
    ]
    return fams


def _codec(name: str, outer_lr_scales: tuple[float, ...] = (1.0,)) -> Callable[[Arm], tuple[Arm, ...]]:
    """The codec arm at the chosen fp32 arm's setting, its outer lr scaled by each of ``outer_lr_scales`` (tuned)."""
    return lambda arm: tuple(replace(arm, codec=name, outer_lr=arm.outer_lr * x) for x in outer_lr_scales)


KEPT_LONG = Path(__file__).resolve().parents[2] / "dev" / "bench" / "lpb-codecs-long.jsonl"
LONG_SETUP = "tiny/W4/S1200/T64/B8/wu20"  # the codecs-long plan's Setup.key()


def long_outer_lr_scale(codec: str, kept: Path = KEPT_LONG) -> float:
    """The outer lr scale the tiny/1200 tuning ("codecs-long") chose for ``codec``, read from the kept runs.

    The pick is the seed-0 run of ``diloco-H40-<codec>`` with the lowest eval loss in ``kept`` (a results file of
    this script), divided by the outer lr of the best seed-0 fp32 ``diloco-H40`` run there. A codec never tuned
    there gets its family's scale from dev/LOG.md session 39 (2 for top-k, whose sparse updates want a larger outer
    step; 1 for the dense formats). Raises ``ValueError`` if ``kept`` holds a line that is not JSON.
    """
    fallback = 2.0 if codec.startswith("topk") else 1.0
    if not kept.is_file():
        return fallback
    best: dict[str, tuple[float, float]] = {}  # arm family -> (seed-0 loss, outer lr) of its best run
    for number, line in enumerate(kept.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{kept}:{number}: not a results line ({exc})") from exc
        family, _, rest = row["arm"].partition("/")
        if row["setup"] != LONG_SETUP or row["seed"] != 0 or "/olr" not in rest:
            continue
        point = (row["result"]["eval_loss"], float(rest.split("/olr")[1].split("/")[0]))
        if family not in best or point < best[family]:
            best[family] = point
    if f"diloco-H40-{codec}" not in best or "diloco-H40" not in best:
        return fallback
    return best[f"diloco-H40-{codec}"][1] / best["diloco-H40"][1]


def _fragments(num: int) -> Callable[[Arm], tuple[Arm, ...]]:
    """The chosen whole-model arm with its rounds split into ``num`` fragments (Streaming DiLoCo, synchronous)."""
    return lambda arm: (replace(arm, fragments=num),)


RunKey = tuple[str, str, int]


def run_key(setup: Setup, arm: Arm, seed: int) -> RunKey:
    return (setup.key(), arm.key(), seed)


def _work(setup: Setup, arm: Arm, seed: int) -> dict:
    try:
        return asdict(run_arm(setup, arm, seed))
    except FloatingPointError as exc:
        return {"eval_loss": math.inf, "bytes": 0, "wall_s": 0.0, "num_parameters": 0, "error": str(exc)}


class Sweep:
    """Runs the families' tuning and seed runs on a process pool, as soon as each run's inputs are known."""

    def __init__(self, families: list[Family], jobs: int, results_path: str, commit: str = "unknown"):
        self.families = {f.label: f for f in families}
        self.grid: dict[str, tuple[Arm, ...]] = {f.label: f.grid for f in families if not f.after}
        self.best: dict[str, Arm] = {}
        self.done: dict[RunKey, dict] = {}
        self.commit_of: dict[RunKey, str] = {}  # the commit each run was measured on (results files say)
        self.jobs, self.results_path, self.commit = jobs, results_path, commit
        if results_path and Path(results_path).is_file():
            for line in Path(results_path).read_text().splitlines():
                row = json.loads(line)
                key = (row["setup"], row["arm"], row["seed"])
                self.done[key], self.commit_of[key] = row["result"], row.get("commit", "unknown")

    def needed(self) -> list[tuple[Setup, Arm, int]]:
        """Runs whose inputs are known and whose result is not; updates the families' choices on the way."""
        out = []
        for label, fam in self.families.items():
            if label not in self.grid and fam.after in self.best:
                self.grid[label] = fam.derive(self.best[fam.after])
            if label not in self.grid:
                continue
            tuning = [(fam.setup, arm, fam.seeds[0]) for arm in self.grid[label]]
            missing = [r for r in tuning if run_key(*r) not in self.done]
            if missing:
                out += missing
                continue
            losses = [self.done[run_key(*r)]["eval_loss"] for r in tuning]
            self.best[label] = self.grid[label][min(range(len(losses)), key=losses.__getitem__)]
            out += [
                (fam.setup, self.best[label], s)
                for s in fam.seeds[1:]
                if run_key(fam.setup, self.best[label], s) not in self.done
            ]
        return out

    def run(self, log) -> None:
        started = time.monotonic()

        def record(key: RunKey, result: dict) -> None:
            self.done[key], self.commit_of[key] = result, self.commit
            if self.results_path:
                line = {"setup": key[0], "arm": key[1], "seed": key[2], "result": result, "commit": self.commit}
                with open(self.results_path, "a") as fh:
                    fh.write(json.dumps(line) + "\n")
            log(
                f"[{time.monotonic() - started:7.0f}s] {key[0]} {key[1]} seed {key[2]}: "
                f"eval {result['eval_loss']:.4f} ({result['wall_s']:.0f}s)"
            )

        if self.jobs == 0:  # in this process, one run after another (tests, profiling)
            while todo := self.needed():
                for setup, arm, seed in dict.fromkeys(todo):
                    record(run_key(setup, arm, seed), _work(setup, arm, seed))
            return
        inflight: dict[RunKey, Future] = {}
        with ProcessPoolExecutor(max_workers=self.jobs, mp_context=mp.get_context("spawn")) as pool:
            while True:
                for setup, arm, seed in self.needed():
                    key = run_key(setup, arm, seed)
                    if key not in inflight:
                        inflight[key] = pool.submit(_work, setup, arm, seed)
                if not inflight:
                    return
                finished, _ = wait(inflight.values(), return_when=FIRST_COMPLETED)
                for key in [k for k, f in inflight.items() if f in finished]:
                    record(key, inflight.pop(key).result())

    def commits(self) -> set[str]:
        """The commits of every run the rows use (each row's grid on seed 0 and its best setting on every seed)."""
        used = set()
        for label, fam in self.families.items():
            if label in self.best:
                used |= {run_key(fam.setup, a, fam.seeds[0]) for a in self.grid[label]}
                used |= {run_key(fam.setup, self.best[label], s) for s in fam.seeds}
        return {self.commit_of.get(k, "unknown") for k in used}

    def rows(self) -> list[dict]:
        """One summary per family (best setting, all seeds), with vs_ddp against the best DDP row of its setup."""
        rows = []
        for label, fam in self.families.items():
            if label not in self.best:
                continue
            arm = self.best[label]
            results = [self.done[run_key(fam.setup, arm, s)] for s in fam.seeds]
            losses = [r["eval_loss"] for r in results]
            rows.append(
                {
                    "arm": label.split("/", 2)[-1] if "/" in label else label,
                    "preset": fam.setup.preset,
                    "steps": fam.setup.steps,
                    "workers": fam.setup.workers,
                    "inner_steps": arm.inner_steps or None,
                    "overlap": arm.overlap if arm.kind == "diloco" else None,
                    "codec": arm.codec or None,
                    "lr": arm.lr,
                    "outer_lr": arm.outer_lr,
                    "outer_momentum": arm.outer_momentum,
                    "fragments": arm.fragments if arm.kind == "diloco" else None,
                    "mix": arm.mix if arm.kind == "diloco" else None,
                    "eval_loss": statistics.fmean(losses),
                    "eval_loss_std": statistics.stdev(losses) if len(losses) > 1 else None,
                    "eval_loss_min": min(losses),
                    "eval_loss_max": max(losses),
                    "seeds": list(fam.seeds),
                    "bytes": results[0]["bytes"],
                    "num_parameters": results[0]["num_parameters"],
                    "grid": [
                        {
                            "lr": a.lr,
                            "outer_lr": a.outer_lr,
                            "outer_momentum": a.outer_momentum,
                            "mix": a.mix if a.kind == "diloco" else None,
                            "eval_loss_seed0": self.done[run_key(fam.setup, a, fam.seeds[0])]["eval_loss"],
                        }
                        for a in self.grid[label]
                    ],
                }
            )
        for row in rows:
            ddp = [r for r in rows if r["arm"] == "ddp" and (r["preset"], r["steps"]) == (row["preset"], row["steps"])]
            base = min(ddp, key=lambda r: r["eval_loss"]) if ddp else None
            row["vs_ddp"] = (row["eval_loss"] - base["eval_loss"]) / base["eval_loss"] if base else None
            row["bytes_vs_ddp"] = row["bytes"] / base["bytes"] if base and base["bytes"] else None
        return rows


def table(rows: list[dict]) -> str:
    """Markdown table of the rows (the README's Performance section)."""
    head = "| preset | steps | arm | lr | outer lr / μ | eval loss (mean ± std, n) | vs tuned DDP | bytes vs DDP |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        outer = f"{r['outer_lr']} / {r['outer_momentum']}" if r["outer_lr"] is not None else "—"
        std = f" ± {r['eval_loss_std']:.3f}" if r["eval_loss_std"] is not None else ""
        vs = f"{100 * r['vs_ddp']:+.1f}%" if r["vs_ddp"] is not None else "—"
        lines.append(
            f"| {r['preset']} | {r['steps']} | {r['arm']} | {r['lr']:g} | {outer} | "
            f"{r['eval_loss']:.3f}{std} (n={len(r['seeds'])}) | {vs} | {_ratio(r['bytes_vs_ddp'])} |"
        )
    return "\n".join(lines)


def _ratio(ratio: float | None) -> str:
    if ratio is None:
        return "—"
    if abs(ratio - 1) < 1e-9:
        return "1"
    return f"{ratio:.3g}x" if ratio >= 1 else f"1/{1 / ratio:.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="text file (default: shared tinyshakespeare.txt)")
    parser.add_argument("--plan", default="default", choices=PLANS, help="which sweep")
    parser.add_argument("--quick", action="store_true", help="same as --plan quick (smoke run, < 1 min)")
    parser.add_argument(
        "--jobs", type=int, default=2, help="worker processes (one torch thread each); 0 = in this process"
    )
    parser.add_argument("--results", default="", help="JSON-lines file of finished runs, reused and appended to")
    parser.add_argument(
        "--codecs", default="", help="also DiLoCo H=40 with these codecs, e.g. int4,int4-ef,topk2-2b-ef"
    )
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list on the last line")
    parser.add_argument(
        "--readme",
        default="",
        help="write the table between this file's '<!-- lpb:PLAN begin/end -->' markers (lpb_readme.py)",
    )
    args = parser.parse_args()
    if not Path(args.data).is_file():
        parser.error(f"--data {args.data}: no such file")
    name = "quick" if args.quick else args.plan
    readme = Path(args.readme) if args.readme else None
    if readme is not None:
        try:
            lpb_readme.replace_block(readme.read_text(), name, "")
        except (OSError, ValueError) as exc:  # before hours of runs, not after
            parser.error(f"--readme {readme}: {exc}")
    codecs = [c for c in args.codecs.split(",") if c]
    for c in codecs:
        try:
            codec_config(c)
        except ValueError as exc:
            parser.error(f"--codecs: {exc}")
    commit = lpb_readme.current_commit(Path(__file__).resolve().parents[2])
    sweep = Sweep(plan(name, args.data, codecs), args.jobs, args.results, commit)
    started = time.monotonic()
    sweep.run(lambda line: print(line, file=sys.stderr, flush=True))
    rows = sweep.rows()
    print(table(rows))
    if readme is not None:
        command = " ".join(["scripts/bench/diloco_vs_ddp.py", *sys.argv[1:]])
        lpb_readme.write(readme, name, table(rows), sweep.commits(), command)
        print(f"wrote the table into {readme} (block lpb:{name})")
    print(f"sweep wall time {time.monotonic() - started:.0f}s, {len(sweep.done)} runs known")
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
