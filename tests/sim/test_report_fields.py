"""Report fields and figures of the scale sweep: consensus under churn, flash-crowd figures, partition plot."""

from __future__ import annotations

import json
import math

import pytest

from hivetrain.sim.consensus import rounds_to_consensus
from hivetrain.sim.dataparallel import DataParallelSim
from hivetrain.sim.report import (
    leave_prob_per_round,
    plot_consensus,
    plot_flash,
    plot_pipeline,
    plot_sweep,
    write_report,
)

from .conftest import tiny


def test_consensus_with_leavers():
    calm = rounds_to_consensus("moshpit", 256, 16, seed=2)
    assert calm.leave_prob == 0.0 and calm.rounds == 2  # a full 16 x 16 grid: exact in ceil(log_16 256) rounds
    # nearly every member leaves every round: no group ever completes, so the drift never falls
    stuck = rounds_to_consensus("moshpit", 256, 16, seed=2, leave_prob=0.99, max_rounds=10)
    assert stuck.rounds == 11 and stuck.end_deviation == pytest.approx(stuck.start_deviation)
    with pytest.raises(ValueError, match="leave_prob"):
        rounds_to_consensus("moshpit", 10, 4, seed=0, leave_prob=1.0)


def test_leave_prob_per_round():
    assert leave_prob_per_round(None, 3600.0) == 0.0
    assert leave_prob_per_round(100.0, None) == 0.0
    assert leave_prob_per_round(360.0, 3600.0) == pytest.approx(1 - math.exp(-0.1))


def test_report_has_churn_consensus_and_round_time(tmp_path):
    sc = tiny(churn={"session": "exponential", "mean_session_s": 600.0})
    metrics = DataParallelSim(sc).run()
    report = write_report(metrics, tmp_path, sc.averaging.target_group_size, sc.sim.seed)
    stored = json.loads((tmp_path / "report.json").read_text())
    assert stored["round_s_median"] > 0
    assert stored["consensus_leave_prob"] == pytest.approx(leave_prob_per_round(stored["round_s_median"], 600.0))
    assert stored["consensus_rounds_churn"] >= 1
    assert stored["churn"] == "exponential" and stored["mean_session_s"] == 600.0
    assert report["partition"] is None and not (tmp_path / "partition.png").exists()


def test_flash_crowd_figures(tmp_path):
    sc = tiny(sim={"outer_steps": 4}, flash_crowd={"num_joiners": 10, "at_s": 20.0}, download={"num_donors": 2})
    metrics = DataParallelSim(sc).run()
    r = metrics.summary
    flash = [d for d in metrics.downloads if d["flash"]]
    assert r["flash_downloads"] == len(flash) > 0
    assert r["flash_catchup_s_max"] == max(d["duration_s"] for d in flash)
    assert r["flash_all_caught_up_s"] == pytest.approx(max(d["ended_at"] for d in flash) - 20.0)
    assert 0 < r["flash_max_donor_bytes"] <= r["max_donor_bytes"]
    assert r["download_donors"] == 2 and r["flash_joiners"] == 10
    assert r["flash_downloads"] + r["flash_still_syncing"] <= 10
    assert all(d["num_donors"] <= 2 for d in flash)
    assert plot_flash([r], tmp_path / "flash.png").stat().st_size > 0


def test_partition_plot_and_sweep_plots(tmp_path):
    sc = tiny(sim={"num_peers": 20, "outer_steps": 100, "max_sim_s": 200.0},
              partition={"share": 0.3, "at_s": 60.0, "heal_s": 150.0})  # fmt: skip
    metrics = DataParallelSim(sc).run()
    write_report(metrics, tmp_path, sc.averaging.target_group_size, sc.sim.seed)
    assert (tmp_path / "partition.png").stat().st_size > 0
    runs = [rounds_to_consensus("moshpit", n, 4, seed=1, leave_prob=p) for n in (16, 64) for p in (0.0, 0.1)]
    assert plot_consensus(runs, tmp_path / "c.png").stat().st_size > 0
    pipe = [{"scenario": "s", "peers": n, "throughput_ratio": 0.9, "rerouted_share": 0.01, "label": "x",
             "pipeline_throughput_mb_per_s": 3.0} for n in (20, 50)]  # fmt: skip
    assert plot_pipeline(pipe, tmp_path / "p.png").stat().st_size > 0


def test_sweep_plots_skip_runs_without_an_outer_step(tmp_path):
    base = {"scenario": "s", "label": "x", "utilization_mean": 0.5, "committed_sample_share": 0.0}
    assert plot_sweep([{**base, "peers": 3000, "outer_steps_done": 0}], tmp_path) == []
    drawn = plot_sweep([{**base, "peers": 100, "outer_steps_done": 2, "stopped_by_limit": True}], tmp_path)
    assert {p.name for p in drawn} == {"utilization_mean.png", "committed_sample_share.png"}
