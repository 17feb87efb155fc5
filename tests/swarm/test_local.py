"""``run_local_pipeline``: a coordinator publishing a run config with ``[swarm]`` and join-swarm processes (stage
servers and a trainer) on 127.0.0.1 train tiny and write summary.json."""

from __future__ import annotations

import json

import pytest

from hivetrain.swarm.local import run_local_pipeline

from .conftest import tiny_pipeline_run

pytestmark = pytest.mark.slow


def test_local_pipeline_trains_and_writes_summary(tmp_path):
    run = tiny_pipeline_run(trainer_steps=5)
    summary = run_local_pipeline(tmp_path, run, servers_per_stage=1, trainers=1, timeout_s=240)

    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert not summary["timed_out"] and summary["exit_codes"]["trainer0"] == 0, summary["exit_codes"]
    assert summary["mode"] == "pipeline" and summary["stages"] == 3 and summary["steps"] == 5
    assert summary["microbatches"] == 10 and summary["microbatches_per_s"] > 0
    assert summary["reroutes"] == 0 and summary["failed_steps"] == 0
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert all(epoch >= 1 for epoch in summary["outer_steps"].values()), summary["outer_steps"]
    assert summary["stage_hashes_agree"] == {"0": True, "1": True, "2": True}
    assert "[swarm]" in (tmp_path / "run.toml").read_text()  # the coordinator's config, not a side file
