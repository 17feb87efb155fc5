"""The memory-check bench (scripts/bench/memory_check.py) as CI runs it: the tiny preset on the CPU."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
import memory_check  # noqa: E402 - a bench script, not part of the package

from hivetrain.preflight import PROCESS_BYTES  # noqa: E402


def test_the_estimate_is_printed_beside_the_measurement(capsys):
    args = ["--model", "tiny", "--batch-size", "2", "--seq-len", "16", "--steps", "2", "--phases", "2", "--json"]
    assert memory_check.main(args) == 0
    out = capsys.readouterr().out
    row = json.loads(out.strip().splitlines()[-1])
    assert row["device"] == "cpu" and row["precision"] == "fp32" and row["parameters"] == 461_440
    n = row["parameters"]
    assert row["estimate_device_bytes"] > 16 * n  # parameters, gradients, AdamW and the activations
    assert row["estimate_host_bytes"] == row["estimate_device_bytes"] + 48 * n + PROCESS_BYTES  # a CPU peer
    assert row["measured_rss_growth_bytes"] >= 0
    assert row["measured_over_estimate"] == round(row["measured_rss_growth_bytes"] / row["estimate_device_bytes"], 3)
    assert len(row["losses"]) == 2 and "estimate (training device)" in out
