"""The inner-loop bench (scripts/bench/inner_loop.py) as CI runs it: the tiny preset on the CPU, every arm."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
import inner_loop  # noqa: E402 - a bench script, not part of the package

from hivetrain.model import build_config, build_model  # noqa: E402


@pytest.mark.slow  # every arm trains, and the compiled one is traced first: ~10 s
def test_every_arm_trains_and_is_reported_beside_the_compiled_loop(capsys):
    args = ["--preset", "tiny", "--batch-size", "2", "--seq-len", "16", "--steps", "4", "--warmup-steps", "2"]
    # aot_eager: the compiled arm is traced by dynamo and AOTAutograd without inductor's ~25 s of code generation on
    # a cold cache (inductor on the CPU is tested in tests/diloco/test_inner_speed.py and the compiled e2e swarm)
    args += ["--compile-backend", "aot_eager"]
    assert inner_loop.main([*args, "--json", "--peak-tflops", "1"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["device"] == "cpu" and report["precision"] == "fp32"
    arms = report["arms"]
    assert sorted(arms) == sorted(inner_loop.ARMS)
    assert arms["compiled-fused"]["vs_compiled-fused"] == 1.0 and arms["plain"]["vs_plain"] == 1.0
    for arm in arms.values():
        assert arm["tokens_per_s"] > 0 and arm["mfu"] > 0 and arm["peak_memory_gb"] is None
        assert arm["vs_plain"] == pytest.approx(arm["tokens_per_s"] / arms["plain"]["tokens_per_s"])
    for arm in inner_loop.ARMS:  # the table names every arm
        assert any(line.startswith(arm + " ") for line in out.splitlines()), arm


def test_flops_per_token_count_the_matmuls_and_attention_not_the_embedding():
    model = build_model(build_config("tiny", vocab_size=256, max_seq_len=65), seed=0)
    n = sum(p.numel() for p in model.parameters())
    embedding = 256 * 128
    assert inner_loop.flops_per_token(model, 64) == 6 * (n - embedding) + 12 * 2 * 128 * 64
    assert inner_loop.peak_flops(__import__("torch").device("cpu"), 0.0) is None


def test_bad_arguments_are_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        inner_loop.main(["--arms", "plain,turbo"])
    assert "turbo" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        inner_loop.main(["--device", "gpu0"])
    assert "not a torch device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        inner_loop.main(["--compile-backend", "warp-drive"])
    err = capsys.readouterr().err
    assert "warp-drive" in err and "inductor" in err  # the choices are named
