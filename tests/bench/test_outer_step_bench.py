"""The outer-step bench (scripts/bench/outer_step.py) as CI runs it: the tiny preset and a flat model on the CPU."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
import outer_step  # noqa: E402 - a bench script, not part of the package


def report(capsys, *args: str) -> dict:
    assert outer_step.main([*args, "--repeats", "1", "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_every_part_is_timed_per_million_parameters_and_summed_by_thread(capsys):
    tiny = report(capsys, "--preset", "tiny", "--eval-windows", "4", "--seq-len", "16")
    assert set(tiny["seconds"]) == {*outer_step.MAIN_THREAD, *outer_step.BACKGROUND}
    assert all(s > 0 for s in tiny["seconds"].values())
    assert tiny["trainer_thread_s"] == pytest.approx(sum(tiny["seconds"][p] for p in outer_step.MAIN_THREAD))
    part = tiny["ms_per_m"]["outer_step"]
    assert part == pytest.approx(1e3 * tiny["seconds"]["outer_step"] / tiny["params_m"])
    flat = report(capsys, "--params-m", "2", "--momentum", "0.9")
    assert flat["params_m"] == 2.0 and flat["momentum"] == 0.9 and "evaluate" not in flat["seconds"]


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        outer_step.main(["--params-m", "0"])
    assert "--params-m" in capsys.readouterr().err
