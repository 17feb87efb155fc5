"""``hivetrain sim`` on the bundled 100-peer scenario writes report.json with the keys the issue asks for."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hivetrain.cli.main import main

REQUIRED = ("peers", "consensus_rounds", "utilization_mean", "committed_sample_share", "peak_dht_value_bytes", "wall_s")


def test_sim_command_writes_the_report(tmp_path: Path, capsys) -> None:
    scenario = Path(__file__).resolve().parents[2] / "scenarios/sim/dp-100.toml"
    assert main(["sim", str(scenario), "--out", str(tmp_path), "--outer-steps", "1"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert all(k in report for k in REQUIRED)
    assert report["peers"] == 100 and report["outer_steps_done"] == 1
    assert 0 < report["utilization_mean"] <= 1 and 0 < report["committed_sample_share"] <= 1
    # 100 trainers start within a heartbeat, all under the level-0 key (~4 KB each); then they move to 2 shards (level
    # 1), and from one record TTL on no key holds them all
    assert report["peak_dht_value_bytes_by_key"]["sim.peers"] >= 100 * 4000
    assert 40 * 1600 <= report["peak_dht_value_bytes_steady_by_key"]["sim.peers"] < 100 * 4000
    assert (tmp_path / "drift.png").stat().st_size > 0


def test_sim_command_refuses_an_unknown_key(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[sim]\nnum_peers = 5\nspeed = 3\n")
    assert main(["sim", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "sim.speed: unknown key" in capsys.readouterr().err


def test_a_run_stopped_by_its_time_limit_still_writes_the_report_of_what_it_simulated(tmp_path: Path, capsys) -> None:
    """Issue 26 item 3: a long run stopped early leaves its partial report, saying why it stopped."""
    scenario = Path(__file__).resolve().parents[2] / "scenarios/sim/dp-100.toml"
    assert main(["sim", str(scenario), "--out", str(tmp_path), "--time-limit-s", "1e-9"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["stopped_by"] == "time_limit" and report["outer_steps_done"] == 0
    err = capsys.readouterr().err
    assert "sim: 0/" in err  # the first progress line comes at the first tick, not after 30 s
    assert "stopped by --time-limit-s after 0 of" in err and "report.json" in err


@pytest.mark.slow
def test_ctrl_c_stops_the_run_and_writes_its_partial_report(tmp_path: Path) -> None:
    """The first SIGINT ends the run at its next tick: exit 130, report.json with ``stopped_by`` = "interrupted"."""
    scenario = Path(__file__).resolve().parents[2] / "scenarios/sim/dp-100.toml"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hivetrain.cli.main", "sim", str(scenario), "--out", str(tmp_path)]
        + ["--outer-steps", "500"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = proc.stderr.readline()  # the first progress line: the run is in its tick loop
        assert first.startswith("sim: 0/500 outer steps"), first
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "stopped by Ctrl+C after" in err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["stopped_by"] == "interrupted" and report["outer_steps_done"] < 500
