"""A pipelined run on the dashboard (real uvicorn on 127.0.0.1): the page's pipeline card, /api/pipeline and
/api/status, the live fragment, and the Prometheus families; a data-parallel run shows none of it."""

from __future__ import annotations

import json
import time
from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families

from hivetrain.coordinator.dashboard import DashboardServer
from hivetrain.coordinator.pipeline import PipelineObserver
from hivetrain.swarm.announce import StageRecord
from hivetrain.swarm.reports import Move, RebalanceReport, TrainerReport
from tests.coordinator.conftest import SnapshotHolder, make_snapshot
from tests.coordinator.test_dashboard_api import get

FP = "f" * 16


def pipeline_view(now: float):
    """3 stages (stage 2 served by one server), 2 trainers with 60 and 30 microbatches, one rebalance."""
    obs = PipelineObserver(3, 4, FP)
    stages = [
        StageRecord(
            peer_id=f"12D3KooWServer{s}{k}",
            run_id="r",
            model_fingerprint=FP,
            stage=s,
            num_stages=3,
            throughput=2.0 + s + k,
            load=0.25 * (k + 1),
            queue_len=k,
            updated_at=now - 1,
        )
        for s in range(3)
        for k in range(2 if s < 2 else 1)
    ]
    reasons = ("stage 1 12D3KooWServ: dead: unreachable <script>alert(1)</script>",)

    def trainer(peer: str, at: float, mb: int) -> TrainerReport:
        return TrainerReport(
            peer_id=peer,
            run_id="r",
            model_fingerprint=FP,
            started_at=now - 20,
            microbatches=mb,
            reroutes=mb // 10,
            replays=mb // 30,
            deaths=1 if mb else 0,
            last_reasons=reasons if mb else (),
            updated_at=at,
        )

    move = Move(at=now - 3, from_stage=0, to_stage=2, reason="stage throughputs [5, 7, 4]: moving 0 -> 2 (+25%)")
    rebalance = RebalanceReport(
        peer_id="12D3KooWServer20",
        run_id="r",
        model_fingerprint=FP,
        stage=2,
        started_at=now - 20,
        rebalances=1,
        moves=(move,),
        last_decision="stage 2 is the bottleneck (4.00 mb/s)",
        updated_at=now - 1,
    )
    obs.observe(
        stages, [trainer("12D3KooWTrainerA", now - 12, 0), trainer("12D3KooWTrainerB", now - 12, 0)], [], now - 10
    )
    obs.observe(
        stages, [trainer("12D3KooWTrainerA", now - 1, 60), trainer("12D3KooWTrainerB", now - 1, 30)], [rebalance], now
    )
    return obs.view(now)


def _pipelined(holder: SnapshotHolder) -> None:
    now = time.time()
    holder.set(replace(make_snapshot(now=now), pipeline=pipeline_view(now)))


def test_the_page_shows_the_pipeline_card(dashboard: DashboardServer, holder: SnapshotHolder) -> None:
    _pipelined(holder)
    status, _, html = get(dashboard, "/")
    assert status == 200
    assert 'id="sec-pipeline"' in html and "Microbatches/s" in html
    assert "9.00" in html  # 90 credited microbatches over the 10 s between the two polls
    for text in ("Stages", "Reroutes", "Replays", "Rebalances", "bottleneck", "moving 0 -&gt; 2 (+25%)"):
        assert text in html, text
    assert "stage 2 is the bottleneck (4.00 mb/s)" in html  # a server's last rebalance check
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "api/pipeline" in html
    fragments = json.loads(get(dashboard, "api/fragments")[2])["sections"]
    assert "Microbatches/s" in fragments["sec-pipeline"]


def test_api_pipeline_and_status_carry_the_same_data(dashboard: DashboardServer, holder: SnapshotHolder) -> None:
    _pipelined(holder)
    status, headers, body = get(dashboard, "api/pipeline")
    data = json.loads(body)
    assert status == 200 and headers["Cache-Control"] == "no-store"
    assert data["num_stages"] == 3 and data["num_servers"] == 5
    assert [len(s["servers"]) for s in data["stages"]] == [2, 2, 1]
    assert [s["bottleneck"] for s in data["stages"]] == [False, False, True]
    assert data["stages"][0]["servers"][1]["load"] == 0.5 and data["stages"][0]["mean_load"] == 0.375
    assert (data["microbatches_total"], data["reroutes_total"], data["replays_total"]) == (90, 9, 3)
    assert (data["deaths_total"], data["rebalances_total"]) == (2, 1)
    assert abs(data["microbatches_per_s"] - 9.0) < 1e-9
    assert data["rebalances"][0]["reason"].startswith("stage throughputs")
    assert {t["peer_id"]: t["microbatches"] for t in data["trainers"]} == {
        "12D3KooWTrainerA": 60,
        "12D3KooWTrainerB": 30,
    }
    whole = json.loads(get(dashboard, "api/status")[2])
    assert whole["pipeline"]["microbatches_total"] == 90 and whole["pipeline"]["stages"] == data["stages"]


def test_prometheus_exposes_the_pipeline(dashboard: DashboardServer, holder: SnapshotHolder) -> None:
    _pipelined(holder)
    families = {f.name: f for f in text_string_to_metric_families(get(dashboard, "metrics")[2])}
    value = {name: families[name].samples[0].value for name in families if len(families[name].samples) == 1}
    assert value["hivetrain_pipeline_stages"] == 3 and value["hivetrain_pipeline_trainers"] == 2
    assert abs(value["hivetrain_pipeline_microbatches_per_second"] - 9.0) < 1e-9
    assert value["hivetrain_pipeline_throughput_microbatches_per_second"] == 4.0  # stage 2's one server
    totals = {s.name: s.value for f in families.values() for s in f.samples if s.name.endswith("_total")}
    assert totals["hivetrain_pipeline_microbatches_total"] == 90
    assert totals["hivetrain_pipeline_reroutes_total"] == 9 and totals["hivetrain_pipeline_replays_total"] == 3
    assert totals["hivetrain_pipeline_server_deaths_total"] == 2 and totals["hivetrain_pipeline_rebalances_total"] == 1
    by_stage = {s.labels["stage"]: s.value for s in families["hivetrain_pipeline_stage_servers"].samples}
    assert by_stage == {"0": 2, "1": 2, "2": 1}
    load = {s.labels["stage"]: s.value for s in families["hivetrain_pipeline_stage_load"].samples}
    assert load["0"] == 0.375 and load["2"] == 0.25
    throughput = families["hivetrain_pipeline_stage_throughput_microbatches_per_second"].samples
    assert {s.labels["stage"]: s.value for s in throughput} == {"0": 5.0, "1": 7.0, "2": 4.0}


def test_a_data_parallel_run_shows_no_pipeline(dashboard: DashboardServer) -> None:
    assert 'id="sec-pipeline"' not in get(dashboard, "/")[2]
    assert get(dashboard, "api/pipeline")[0] == 404
    assert json.loads(get(dashboard, "api/status")[2])["pipeline"] is None
    assert "hivetrain_pipeline_" not in get(dashboard, "metrics")[2]
