"""``run_local_pipeline``: a coordinator publishing a run config with ``[swarm]`` and join-swarm processes (stage
servers and a trainer) on 127.0.0.1 train tiny and write summary.json."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hivetrain.config import DataConfig
from hivetrain.swarm.config import SwarmConfig
from hivetrain.swarm.local import default_run, run_local_pipeline

pytestmark = pytest.mark.slow


def test_local_pipeline_trains_and_writes_summary(tmp_path):
    run = dataclasses.replace(
        default_run("tiny", seed=0),
        data=DataConfig(seq_len=64, batch_size=4, max_corpus_bytes=2**20, num_eval_windows=4),
        diloco=dataclasses.replace(default_run("tiny", 0).diloco, inner_steps=1),
        # phases of 1 inner step x 2 microbatches: each lone stage server commits outer steps through GroupAverager
        swarm=SwarmConfig(
            num_stages=3,
            microbatch_size=2,
            microbatches_per_inner_step=2,
            announce_interval_s=0.5,
            record_ttl_s=3.0,
            trainer_steps=5,
        ),
    )
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
