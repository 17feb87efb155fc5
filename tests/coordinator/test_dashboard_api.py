"""Dashboard HTTP API against a real uvicorn server on 127.0.0.1: validation, secrets, metrics, failures, chart."""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
from dataclasses import replace
from email.message import Message

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hivetrain.coordinator.dashboard import DashboardServer, LossPoint, PeerRow, RunInfo, summarize_config
from hivetrain.coordinator.web.chart import nice_ticks, render_loss_svg
from tests.coordinator.conftest import RUN_CONFIG, SECRETS, SnapshotHolder, make_snapshot


def get(server: DashboardServer, path: str) -> tuple[int, Message, str]:
    try:
        with urllib.request.urlopen(server.url + path.lstrip("/"), timeout=10) as resp:
            return resp.status, resp.headers, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read().decode()


@pytest.mark.parametrize(
    "path",
    [
        "api/peers?limit=0",
        "api/peers?limit=-1",
        "api/peers?limit=1001",
        "api/peers?limit=99999999999999999999999",
        "api/peers?limit=abc",
        "api/peers?limit=1.5",
        "api/peers?offset=-1",
        "api/peers?offset=10000000000",
        "api/rounds?limit=0",
        "api/rounds?limit=1000000",
        "api/rounds?limit=",
    ],
)
def test_bad_query_values_are_rejected(dashboard: DashboardServer, path: str) -> None:
    status, _, body = get(dashboard, path)
    assert status == 422, body
    assert "detail" in json.loads(body)


def test_unknown_query_parameters_are_rejected(dashboard: DashboardServer) -> None:
    status, _, body = get(dashboard, "api/peers?limt=5")
    assert status == 400 and "limt" in body
    assert get(dashboard, "api/rounds?offset=1")[0] == 400


def test_peer_and_round_paging(dashboard: DashboardServer, holder: SnapshotHolder) -> None:
    holder.set(make_snapshot(num_epochs=30, num_peers=25))
    status, headers, body = get(dashboard, "api/peers?limit=10&offset=20")
    page = json.loads(body)
    assert status == 200 and headers["Cache-Control"] == "no-store"
    assert (page["total"], page["limit"], page["offset"], len(page["peers"])) == (25, 10, 20, 5)
    assert page["peers"][0]["peer_id"] == make_snapshot(num_peers=25).peers[20].peer_id
    assert json.loads(get(dashboard, "api/peers?offset=1000")[2])["peers"] == []
    rounds = json.loads(get(dashboard, "api/rounds?limit=3")[2])
    assert [r["epoch"] for r in rounds["rounds"]] == [29, 28, 27]


def test_status_json_holds_the_snapshot(dashboard: DashboardServer) -> None:
    status, _, body = get(dashboard, "api/status")
    data = json.loads(body)
    assert status == 200
    assert data["run"]["run_id"] == "demo-run" and data["epoch"] == 23
    assert len(data["loss_curve"]) == 24 and len(data["peers"]) == 6
    assert data["num_peers_alive"] == 5  # one peer last seen 400 s ago
    assert data["samples_contributed_total"] == sum(4000 * (i + 1) ** 2 for i in range(6))


def test_non_finite_loss_is_served_as_null_and_not_drawn(dashboard: DashboardServer, holder: SnapshotHolder) -> None:
    snap = make_snapshot()
    holder.set(replace(snap, loss_curve=(*snap.loss_curve, LossPoint(snap.taken_at, 24, math.nan))))
    data = json.loads(get(dashboard, "api/status")[2])
    assert data["loss_curve"][-1]["eval_loss"] is None
    assert data["latest_eval_loss"] == pytest.approx(snap.loss_curve[-1].eval_loss)
    assert "1 non-finite evaluation (NaN/Inf) not drawn" in get(dashboard, "")[2]


def test_no_secret_reaches_any_response(dashboard: DashboardServer) -> None:
    responses = [get(dashboard, path)[2] for path in ("", "api/status", "api/fragments", "api/peers", "metrics")]
    for body in responses:
        for secret in SECRETS:
            assert secret not in body
        assert "PRIVATE KEY" not in body and "BEGIN RSA" not in body
    assert "diloco.outer_lr" in responses[1]  # the public part of the config is shown
    # also when a caller bypasses summarize_config and hands RunInfo raw pairs
    raw = RunInfo("r", "tiny", 1, (("admin_token", "abc"), ("x", "-----BEGIN PRIVATE KEY-----"), ("seed", "1")))
    assert raw.config_summary == (("seed", "1"),)
    assert dict(summarize_config(RUN_CONFIG))["data.seq_len"] == "128"


def test_volunteer_names_are_escaped(dashboard: DashboardServer, holder: SnapshotHolder) -> None:
    snap = make_snapshot()
    evil = PeerRow("12D3KooWevil", "trainer", None, 1.0, 1, 1.0, "direct", '<script>alert("x")</script>\u202e')
    holder.set(replace(snap, peers=(evil,)))
    status, headers, html = get(dashboard, "")
    assert status == 200
    assert "<script>alert" not in html and "&lt;script&gt;alert" in html and "\u202e" not in html
    nonce = re.search(r"script-src 'nonce-([^']+)'", headers["Content-Security-Policy"]).group(1)
    assert re.findall(r"<script[^>]*>", html) == [f'<script nonce="{nonce}">']
    assert "&lt;script&gt;alert" in json.loads(get(dashboard, "api/fragments")[2])["sections"]["sec-peers"]


def test_metrics_parse_and_match_the_snapshot(dashboard: DashboardServer) -> None:
    status, headers, body = get(dashboard, "metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    samples = {s.name: s for family in text_string_to_metric_families(body) for s in family.samples}
    snap = make_snapshot()
    assert samples["hivetrain_up"].value == 1
    assert samples["hivetrain_epoch"].value == 23
    assert samples["hivetrain_eval_loss"].value == pytest.approx(snap.loss_curve[-1].eval_loss)
    assert samples["hivetrain_tokens_per_second"].value == pytest.approx(48_213.5)
    assert samples["hivetrain_peers_alive"].value == 5
    assert samples["hivetrain_averaging_rounds_committed_total"].value == 23
    assert samples["hivetrain_averaging_rounds_failed_total"].value == 1
    assert samples["hivetrain_checkpoints_written_total"].value == 4
    assert samples["hivetrain_samples_contributed_total"].value == snap.samples_contributed_total
    assert samples["hivetrain_run_info"].labels == {"run_id": "demo-run", "model": "small"}
    assert samples["hivetrain_param_drift"].value == pytest.approx(snap.drift_curve[-1].drift)


def test_snapshot_failure_is_503_and_metrics_report_down(dashboard: DashboardServer, holder: SnapshotHolder) -> None:
    holder.fail = True
    assert get(dashboard, "")[0] == 503
    assert get(dashboard, "api/status")[0] == 503
    body = get(dashboard, "metrics")[2]
    assert {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples} == {"hivetrain_up": 0}
    holder.fail = False
    assert get(dashboard, "api/status")[0] == 200


def test_two_servers_have_separate_registries_and_ports(holder: SnapshotHolder) -> None:
    other = SnapshotHolder(replace(make_snapshot(), epoch=99))
    with DashboardServer(holder) as a, DashboardServer(other) as b:
        assert a.port != b.port and a.registry is not b.registry
        assert "hivetrain_epoch 23.0" in get(a, "metrics")[2]
        assert "hivetrain_epoch 99.0" in get(b, "metrics")[2]
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(a.url, timeout=2)


def test_snapshot_ttl_bounds_calls(holder: SnapshotHolder) -> None:
    with DashboardServer(holder, refresh_interval_s=60, snapshot_ttl_s=60) as server:
        for _ in range(5):
            assert get(server, "api/status")[0] == 200
        assert holder.calls == 1


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="port"):
        DashboardServer(lambda: make_snapshot(), port=70000)
    with pytest.raises(ValueError, match="snapshot_ttl_s"):
        DashboardServer(lambda: make_snapshot(), refresh_interval_s=1, snapshot_ttl_s=5)
    with pytest.raises(RuntimeError):
        _ = DashboardServer(lambda: make_snapshot()).port
    with pytest.raises(ValueError, match="must be >= 0"):
        PeerRow("p", "trainer", None, -1.0, 0, 0.0)


def test_nice_ticks_cover_the_range() -> None:
    assert nice_ticks(2.31, 5.6) == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert nice_ticks(0, 41, max_ticks=9, integer=True, cover=False) == [0, 10, 20, 30, 40]
    assert nice_ticks(1.2001, 1.2009) == pytest.approx([1.2, 1.2002, 1.2004, 1.2006, 1.2008, 1.201])
    ticks = nice_ticks(3.0, 3.0)
    assert ticks[0] < 3.0 < ticks[-1]
    with pytest.raises(ValueError):
        nice_ticks(math.nan, 1.0)


def test_loss_chart_has_axes_labels_and_all_points() -> None:
    snap = make_snapshot()
    svg = str(render_loss_svg(snap.loss_curve))
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert "epoch (outer steps)" in svg and "eval loss (nats/token)" in svg and ">Eval loss" in svg
    assert svg.count("<circle") == len(snap.loss_curve)
    assert len(re.search(r'<polyline points="([^"]+)"', svg).group(1).split()) == len(snap.loss_curve)
    assert "No evaluations yet" in str(render_loss_svg([]))
    many = [LossPoint(0.0, e, 3.0 - e * 1e-4) for e in range(5000)]
    svg = str(render_loss_svg(many))
    drawn = re.search(r'<polyline points="([^"]+)"', svg).group(1).split()
    newest_marker = re.search(r'<circle cx="([^"]+)" cy="([^"]+)"', svg).expand(r"\1,\2")
    assert len(drawn) <= 1001 and drawn[-1] == newest_marker  # thinned, but the newest point is always drawn


def test_parameter_drift_card_shows_the_latest_epoch_only_when_peers_published_sketches(
    dashboard: DashboardServer, holder: SnapshotHolder
) -> None:
    snap = make_snapshot()
    html = get(dashboard, "")[2]
    latest = snap.drift_curve[-1]
    assert "Parameter drift" in html and f"{latest.drift:.2e}" in html
    assert f"over {latest.num_peers} peers at epoch {latest.epoch}" in html
    holder.set(replace(snap, drift_curve=()))
    assert "Parameter drift" not in get(dashboard, "")[2]
    assert "hivetrain_param_drift" not in get(dashboard, "metrics")[2]


def test_the_coordinator_is_not_counted_as_a_volunteer():
    import dataclasses

    snap = make_snapshot(num_peers=3)
    host = dataclasses.replace(snap.peers[0], peer_id="QmCoordinator", role="coordinator", public_name="")
    snap = dataclasses.replace(snap, peers=(host, *snap.peers))
    assert snap.num_volunteers() == 3 and snap.num_peers_alive(1e9) == 3
