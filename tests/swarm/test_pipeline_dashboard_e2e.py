"""A real pipelined local swarm (coordinator with its dashboard, 3 stage servers, 1 trainer, all join-swarm processes
on 127.0.0.1): the coordinator's /api/pipeline reports the 3 stages with their servers and, once the trainer has
finished, exactly the microbatches its own summary file counts; Prometheus exports the same total."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

from hivetrain.swarm.local import LocalPipeline

from .conftest import tiny_pipeline_run

pytestmark = pytest.mark.slow


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"{what} within {timeout_s:.0f} s")


def test_the_dashboard_reports_a_real_pipeline(tmp_path):
    run = tiny_pipeline_run(trainer_steps=4)
    pipeline = LocalPipeline(tmp_path, run, coordinator_args=["--http-port", "0"])
    try:
        pipeline.start_bootstrap()
        log = tmp_path / "coordinator.log"
        url = _wait_for(lambda: re.search(r"dashboard: (http://\S+)", log.read_text()), 60, "no dashboard URL").group(1)
        for stage in range(3):
            pipeline.add_server(stage, f"server{stage}")
        pipeline.wait_for_servers(3, timeout_s=180)
        trainer = pipeline.add_trainer(0)
        assert pipeline.wait_trainers(timeout_s=240), "the trainer did not finish in time"
        assert trainer.popen.returncode == 0
        own = json.loads(trainer.summary_path.read_text())
        assert own["microbatches"] == 8

        def settled():  # the coordinator polls every 2 s; the trainer's last report lives 60 s
            # A periodic report sent while the trainer settled may already count every microbatch: the view has
            # settled only once the last report (the one with left_reason) has been polled too.
            view = json.loads(_get(url + "api/pipeline"))
            done = view["microbatches_total"] == own["microbatches"] and any(t["left_reason"] for t in view["trainers"])
            return view if done else None

        view = _wait_for(settled, 20, "the dashboard never showed the trainer's last report")
        assert view["num_stages"] == 3 and [s["index"] for s in view["stages"]] == [0, 1, 2]
        assert all(len(s["servers"]) == 1 and s["throughput_mb_per_s"] > 0 for s in view["stages"])
        assert (view["reroutes_total"], view["replays_total"]) == (own["reroutes"], own["replays"])
        (row,) = view["trainers"]
        assert row["peer_id"] == own["peer_id"] and row["left_reason"] == "finished"
        assert 'id="sec-pipeline"' in _get(url)
        assert "hivetrain_pipeline_microbatches_total 8.0" in _get(url + "metrics")
    finally:
        pipeline.close()
