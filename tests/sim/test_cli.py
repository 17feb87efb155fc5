"""``hivetrain sim`` on the bundled 100-peer scenario writes report.json with the keys the issue asks for."""

from __future__ import annotations

import json
from pathlib import Path

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
