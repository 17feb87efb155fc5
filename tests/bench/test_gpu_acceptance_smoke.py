"""The GPU acceptance script (scripts/bench/gpu_acceptance.py) at toy sizes on the CPU: known to run before a GPU is."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
import gpu_acceptance  # noqa: E402 - a bench script, not part of the package


@pytest.mark.slow
def test_every_check_runs_and_the_report_holds_the_acceptance_figures(tmp_path):
    assert gpu_acceptance.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert {k: report[k]["rc"] for k in ("inner_loop", "memory", "swarm")} == {"inner_loop": 0, "memory": 0, "swarm": 0}
    assert report["inner_loop"]["result"]["arms"]["hivetrain"]["vs_plain"] > 0
    assert report["memory"]["result"]["estimate_device_bytes"] > 0
    figures = report["swarm"]["figures"]
    assert sorted(figures["peers"]) == ["peer0", "peer1"] and figures["hashes_agree"]
    for peer in figures["peers"].values():
        assert peer["epoch"] == 2 and peer["round_s_mean"] > 0
        assert peer["outside_allreduce_s"] == pytest.approx(sum(peer["outer_overhead_s"].values()), abs=1e-3)
        assert {"pseudo_gradient", "outer_step", "state_hash"} <= set(peer["outer_overhead_s"])
