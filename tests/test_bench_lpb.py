"""The learning-per-byte bench (scripts/bench/diloco_vs_ddp.py): its JSON contract and the arms' simulations.

The arms are checked against each other where the math says they must agree: with one worker, DiLoCo with plain
averaging (outer lr 1, momentum 0) is one AdamW run, asynchronous SGD has no staleness and is DDP, and the eager
overlap's estimate is exactly the worker's own pseudo-gradient.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "scripts" / "bench"
DATA = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
sys.path.insert(0, str(BENCH))

from lpb_arms import Arm, Setup, _corpus, codec_config, ring_bytes, run_arm  # noqa: E402

from hivetrain.diloco.fragments import FragmentPlan  # noqa: E402
from hivetrain.model import build_config, build_model  # noqa: E402

KEYS = {"arm", "eval_loss", "eval_loss_std", "seeds", "bytes", "vs_ddp", "outer_lr", "outer_momentum"}


@pytest.mark.slow
def test_quick_json_has_one_finite_row_per_arm_and_the_readme_block_is_the_printed_table(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# intro\n<!-- lpb:quick begin -->\nold table\n<!-- lpb:quick end -->\nafter\n")
    bench = [sys.executable, str(BENCH / "diloco_vs_ddp.py"), "--quick", "--jobs", "0", "--data", str(DATA)]
    proc = subprocess.run(
        [*bench, "--json", "--readme", str(readme), "--results", str(tmp_path / "runs.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    printed = proc.stdout[proc.stdout.index("| preset") : proc.stdout.index("\nwrote the table into")]
    written = readme.read_text()
    assert written.startswith("# intro\n<!-- lpb:quick begin -->\n" + printed + "\n\nMeasured on commit ")
    assert "old table" not in written and written.endswith("<!-- lpb:quick end -->\nafter\n")
    commits = {json.loads(line)["commit"] for line in (tmp_path / "runs.jsonl").read_text().splitlines()}
    assert len(commits) == 1 and f"Measured on commit {commits.pop()} (`" in written
    missing = subprocess.run(
        [*bench, "--readme", str(tmp_path / "runs.jsonl")], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert missing.returncode == 2 and "<!-- lpb:quick begin -->" in missing.stderr  # refused before any run
    arms = {row["arm"] for row in rows}
    assert {"ddp", "async", "diloco-H10", "diloco-H5-delayed", "diloco-H5-eager"} <= arms
    for row in rows:
        assert KEYS <= row.keys(), row
        assert math.isfinite(row["eval_loss"]) and 0 < row["eval_loss"] < math.log(256), row
        assert row["bytes"] > 0
        assert (row["outer_lr"] is None) == (not row["arm"].startswith("diloco")), row
    ddp = next(r for r in rows if r["arm"] == "ddp")
    assert ddp["vs_ddp"] == 0.0
    asgd = next(r for r in rows if r["arm"] == "async")
    assert asgd["bytes"] == 2 * ddp["bytes"]  # W = 2: a push and a pull per worker step vs 2·(W−1)/W per worker


SETUP = Setup(str(DATA), "tiny", workers=1, steps=12, seq_len=32, batch_size=2, warmup_steps=2, eval_windows=4)


def test_one_worker_plain_averaging_is_one_adamw_run():
    ddp = run_arm(SETUP, Arm("ddp", 2e-3), seed=0)
    diloco = run_arm(SETUP, Arm("diloco", 2e-3, 4, 1.0, 0.0), seed=0)
    assert diloco.eval_loss == pytest.approx(ddp.eval_loss, rel=1e-4)


def test_async_without_staleness_is_ddp():
    ddp = run_arm(SETUP, Arm("ddp", 2e-3), seed=0)
    asgd = run_arm(SETUP, Arm("async", 2e-3), seed=0)
    assert asgd.eval_loss == ddp.eval_loss


def test_eager_overlap_with_one_worker_is_plain_diloco():
    off = run_arm(SETUP, Arm("diloco", 2e-3, 4, 1.0, 0.0), seed=0)
    eager = run_arm(SETUP, Arm("diloco", 2e-3, 4, 1.0, 0.0, "eager"), seed=0)
    delayed = run_arm(SETUP, Arm("diloco", 2e-3, 4, 1.0, 0.0, "delayed"), seed=0)
    assert eager.eval_loss == pytest.approx(off.eval_loss, rel=1e-4)
    assert delayed.eval_loss != pytest.approx(off.eval_loss, rel=1e-4)  # the delay changes the trajectory
    assert eager.bytes == off.bytes == delayed.bytes


def test_a_topk_arm_counts_its_sparse_parts_and_denser_results():
    setup = Setup(str(DATA), "tiny", workers=2, steps=8, seq_len=32, batch_size=2, warmup_steps=2, eval_windows=4)
    dense = run_arm(setup, Arm("diloco", 2e-3, 4, 1.0, 0.0), seed=0)
    sparse = run_arm(setup, Arm("diloco", 2e-3, 4, 1.0, 0.0, codec="topk2-2b-ef"), seed=0)
    part, result, feedback = codec_config("topk2-2b-ef", members=2)
    assert feedback and (part.k, part.value_bits) == (82, 2) and (result.k, result.value_bits) == (164, 8)
    bits = [c.frame_num_bytes(1 << 16) * 8 / (1 << 16) for c in (part, result)]
    # 2 outer steps, W = 2: per step each worker sends the other its part of one slice and its result of the other
    assert sparse.bytes == 2 * int(dense.num_parameters * sum(bits) / 8)
    assert dense.bytes == 2 * int(dense.num_parameters * 64 / 8)
    assert sparse.bytes < dense.bytes / 10 and math.isfinite(sparse.eval_loss)
    with pytest.raises(ValueError, match="error feedback is required"):
        codec_config("topk2-2b")


def test_codecs_long_tunes_each_codec_over_scaled_outer_steps_of_the_chosen_fp32_arm():
    from diloco_vs_ddp import OUTER_LR_SCALES, Sweep, plan

    fams = plan("codecs-long", str(DATA), ["topk3-2b-ef"])
    assert [f.label for f in fams] == ["tiny/1200/ddp", "tiny/1200/diloco-H40", "tiny/1200/diloco-H40-topk3-2b-ef"]
    assert all(f.setup.steps == 1200 for f in fams)
    sweep = Sweep(fams, jobs=0, results_path="")
    fp32 = fams[1]
    for i, arm in enumerate(fp32.grid):  # pretend the tuning ran: the second setting won
        sweep.done[(fp32.setup.key(), arm.key(), 0)] = {"eval_loss": 2.0 if i != 1 else 1.5}
    tuning = [arm for _, arm, seed in sweep.needed() if arm.codec]
    chosen = fp32.grid[1]
    assert [(a.codec, a.outer_lr, a.outer_momentum) for a in tuning] == [
        ("topk3-2b-ef", chosen.outer_lr * x, chosen.outer_momentum) for x in OUTER_LR_SCALES
    ]


def test_one_worker_fragments_with_plain_averaging_are_one_adamw_run_and_send_the_whole_model_per_h_steps():
    # Streaming DiLoCo: with one worker and plain averaging each fragment's outer step sets its θ to the local copy,
    # so the model trains as one AdamW run whatever F; the rounds carry 1/F of the model each, F times as often (and
    # the other F - 1 fragments one more round each after the last phase)
    ddp = run_arm(SETUP, Arm("ddp", 2e-3), seed=0)
    whole = run_arm(SETUP, Arm("diloco", 2e-3, 4, 1.0, 0.0), seed=0)
    for f in (2, 4):
        streaming = run_arm(SETUP, Arm("diloco", 2e-3, 4, 1.0, 0.0, fragments=f), seed=0)
        assert streaming.eval_loss == pytest.approx(ddp.eval_loss, rel=1e-4)
        assert streaming.bytes == whole.bytes == 0  # one worker: nothing on the wire
    setup = Setup(str(DATA), "tiny", workers=2, steps=8, seq_len=32, batch_size=2, warmup_steps=2, eval_windows=4)
    two = run_arm(setup, Arm("diloco", 2e-3, 4, 1.0, 0.0), seed=0)
    for arm in (Arm("diloco", 2e-3, 4, 1.0, 0.0, fragments=2), Arm("diloco", 2e-3, 4, 1.0, 0.0, "delayed", "", 2, 0.5)):
        streaming = run_arm(setup, arm, seed=0)
        plan = FragmentPlan.build({n: p.numel() for n, p in _tiny_model(setup).named_parameters()}, 2)
        final = ring_bytes(plan.numels[0], 2)  # 2 outer steps of each fragment, then fragment 0's last steps
        assert streaming.bytes == two.bytes + final and math.isfinite(streaming.eval_loss)
    # the delayed merge keeps only part of what the fragment learned meanwhile: another trajectory than at once
    delayed = run_arm(SETUP, Arm("diloco", 2e-3, 4, 1.0, 0.0, "delayed", "", 2, 0.5), seed=0)
    assert delayed.eval_loss != pytest.approx(ddp.eval_loss, rel=1e-4)
    with pytest.raises(ValueError, match="overlap off or delayed"):
        run_arm(SETUP, Arm("diloco", 2e-3, 4, 1.0, 0.0, "eager", "", 2), seed=0)
    assert (
        Arm("diloco", 2e-3, 40, 1.0, 0.0, "delayed", "int4-ef", 4, 0.5).family() == "diloco-H40-F4-delayed-a0.5-int4-ef"
    )


def _tiny_model(setup: Setup):
    vocab = _corpus(setup.data, setup.seq_len, setup.eval_windows).vocab_size
    return build_model(build_config("tiny", vocab, setup.seq_len), seed=0)


def test_the_fragments_plan_splits_the_chosen_fp32_arm_and_tunes_the_overlapped_one():
    from diloco_vs_ddp import Sweep, plan

    fams = plan("fragments", str(DATA), [])
    labels = [f.label for f in fams]
    assert labels == [
        "tiny/400/ddp",
        "tiny/400/diloco-H40",
        "tiny/400/diloco-H40-eager",
        "tiny/400/diloco-H40-F4",
        "tiny/400/diloco-H40-F4-delayed",
    ]
    sweep = Sweep(fams, jobs=0, results_path="")
    whole = fams[1]
    for i, arm in enumerate(whole.grid):  # pretend the tuning ran: the second setting won
        sweep.done[(whole.setup.key(), arm.key(), 0)] = {"eval_loss": 2.0 if i != 1 else 1.5}
    split = [arm for _, arm, _ in sweep.needed() if arm.fragments == 4 and arm.overlap == "off"]
    assert split and {(a.outer_lr, a.outer_momentum, a.inner_steps) for a in split} == {
        (whole.grid[1].outer_lr, whole.grid[1].outer_momentum, 40)
    }
    streaming = fams[4].grid
    assert {(a.overlap, a.fragments, a.mix) for a in streaming} == {("delayed", 4, 0.0), ("delayed", 4, 0.5)}


def test_the_small_long_plan_runs_each_arm_once_at_the_tiny_runs_choices():
    from diloco_vs_ddp import Sweep, plan

    fams = plan("small-long", str(DATA), ["topk3-2b-ef90", "int4-ef"])
    assert [f.label for f in fams] == [
        "small/2000/ddp",
        "small/2000/diloco-H40",
        "small/2000/diloco-H40-topk3-2b-ef90",
        "small/2000/diloco-H40-int4-ef",
    ]
    assert all((f.setup.preset, f.setup.steps, f.seeds) == ("small", 2000, (0,)) for f in fams)
    runs = Sweep(fams, jobs=0, results_path="").needed()
    assert len(runs) == 4  # no grid: one run per row, none waiting on another's choice
    h40, topk, int4 = (
        next(a for _, a, _ in runs if a.family() == name)
        for name in ("diloco-H40", "diloco-H40-topk3-2b-ef90", "diloco-H40-int4-ef")
    )
    assert (h40.outer_lr, h40.outer_momentum) == (1.0, 0.0)
    assert (topk.outer_lr, int4.outer_lr) == (2.0, 1.0)  # top-k's larger outer step, as tuned at tiny/1200


def test_rows_name_the_fragments_and_mixing_factor_of_their_arm_and_grid():
    from diloco_vs_ddp import Family, Sweep

    setup = Setup(str(DATA), "tiny", workers=4, steps=400)
    grid = tuple(Arm("diloco", 2e-3, 40, 1.0, 0.0, "delayed", "", 4, a) for a in (0.0, 0.5))
    sweep = Sweep([Family("tiny/400/ddp", setup, (Arm("ddp", 2e-3),), (0,)), Family("f", setup, grid, (0,))], 0, "")
    sweep.done[(setup.key(), Arm("ddp", 2e-3).key(), 0)] = {"eval_loss": 1.9, "bytes": 100, "num_parameters": 1}
    for arm, loss in zip(grid, (2.1, 2.0), strict=True):
        sweep.done[(setup.key(), arm.key(), 0)] = {"eval_loss": loss, "bytes": 10, "num_parameters": 1}
    assert not sweep.needed()
    row = next(r for r in sweep.rows() if r["arm"] == "f")
    assert (row["fragments"], row["mix"]) == (4, 0.5)
    assert [(g["mix"], g["eval_loss_seed0"]) for g in row["grid"]] == [(0.0, 2.1), (0.5, 2.0)]


def test_a_readme_block_is_replaced_between_its_markers_and_missing_markers_are_refused():
    from lpb_readme import block, replace_block

    text = "a\n<!-- lpb:x begin -->\nold\n<!-- lpb:x end -->\nb\n"
    assert replace_block(text, "x", "new\n") == "a\n<!-- lpb:x begin -->\nnew\n<!-- lpb:x end -->\nb\n"
    for bad in ("a\n", text + text, "<!-- lpb:x end -->\n<!-- lpb:x begin -->\n"):
        with pytest.raises(ValueError, match="lpb:x begin"):
            replace_block(bad, "x", "new")
    assert block("| t |", ["b2", "a1", "b2"], "cmd").endswith(
        "Measured on commit a1, b2 (`cmd`; written by the script, not by hand)."
    )


def test_the_sweep_names_the_commits_of_the_runs_its_rows_use(tmp_path):
    from diloco_vs_ddp import Family, Sweep

    setup = Setup(str(DATA), "tiny", workers=4, steps=400)
    ddp, other = Arm("ddp", 2e-3), Arm("ddp", 4e-3)
    result = {"eval_loss": 1.9, "bytes": 100, "num_parameters": 1}
    runs = tmp_path / "runs.jsonl"
    runs.write_text(
        json.dumps({"setup": setup.key(), "arm": ddp.key(), "seed": 0, "result": result, "commit": "abc"})
        + "\n"
        + json.dumps({"setup": setup.key(), "arm": other.key(), "seed": 0, "result": result})  # before commits
        + "\n"
    )
    sweep = Sweep([Family("tiny/400/ddp", setup, (ddp,), (0,))], 0, str(runs), commit="now")
    assert not sweep.needed() and sweep.commits() == {"abc"}  # the other run is in no row
    sweep = Sweep([Family("tiny/400/ddp", setup, (ddp, other), (0,))], 0, str(runs), commit="now")
    assert not sweep.needed() and sweep.commits() == {"abc", "unknown"}


def test_the_small_long_outer_lr_scale_is_read_from_the_kept_codecs_long_tuning(tmp_path):
    from diloco_vs_ddp import LONG_SETUP, long_outer_lr_scale

    def line(arm, olr, seed, loss, setup=LONG_SETUP):
        result = {"eval_loss": loss, "bytes": 1, "wall_s": 1.0, "num_parameters": 1}
        return json.dumps({"setup": setup, "arm": f"{arm}/lr0.002/olr{olr}/mu0.0", "seed": seed, "result": result})

    kept = tmp_path / "kept.jsonl"
    kept.write_text(
        "\n".join(
            [
                line("diloco-H40", 0.5, 0, 1.80),
                line("diloco-H40", 1.0, 0, 1.70),  # the fp32 pick: outer lr 1
                line("diloco-H40-topk10-2b-ef80", 1.0, 0, 1.75),
                line("diloco-H40-topk10-2b-ef80", 1.5, 0, 1.73),  # the codec's pick on seed 0
                line("diloco-H40-topk10-2b-ef80", 3.0, 1, 1.60),  # another seed: not a tuning run
                line("diloco-H40-topk10-2b-ef80", 2.0, 0, 1.50, setup="tiny/W4/S400/T64/B8/wu20"),  # other setup
                line("diloco-H40-int4-ef", 0.5, 0, 1.71),
            ]
        )
        + "\n"
    )
    assert long_outer_lr_scale("topk10-2b-ef80", kept) == 1.5
    assert long_outer_lr_scale("int4-ef", kept) == 0.5
    assert long_outer_lr_scale("topk3-2b-ef90", kept) == 2.0  # never tuned there: top-k's family scale
    assert long_outer_lr_scale("int8", kept) == 1.0
    assert long_outer_lr_scale("topk3-2b-ef90", tmp_path / "missing.jsonl") == 2.0
    kept.write_text(kept.read_text() + "not json\n")
    with pytest.raises(ValueError, match="kept.jsonl:8: not a results line"):
        long_outer_lr_scale("int4-ef", kept)
