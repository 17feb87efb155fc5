"""The dashboard names the peers that left, when and why: from a last record carrying ``left_reason``, or from a
record that expired without one (pure observer: records and times in; the page through a real dashboard server)."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import replace

from hivetrain.coordinator.dashboard import DashboardServer, LeftPeerRow, RunInfo
from hivetrain.coordinator.observer import MAX_LEFT, SwarmObserver
from tests.coordinator.conftest import SnapshotHolder, make_snapshot
from tests.records import peer_record

DHT_LOST = "lost the DHT: could not read the swarm for 72s (did the p2pd daemon die?)"


def rec(peer: str, epoch: int, updated_at: float, **kw):
    return peer_record(peer, epoch, updated_at, **{"throughput": 10.0, **kw})


def observer() -> SwarmObserver:
    return SwarmObserver(RunInfo("r", "tiny", 1000), seq_len=64)


def test_a_peer_that_said_why_is_listed_as_left_with_its_reason_and_not_as_a_peer():
    obs = observer()
    obs.observe([rec("a", 1, 100.0), rec("b", 1, 100.0, public_name="bob")], now=100.0)
    obs.observe([rec("a", 2, 110.0), rec("b", 1, 108.0, left_reason=DHT_LOST, public_name="bob")], now=110.0)
    snap = obs.snapshot(now=111.0)
    assert [p.peer_id for p in snap.peers] == ["a"], "a peer that left is not shown among the live peers"
    assert snap.tokens_per_s == 10.0 * 64
    assert snap.peers_left == (LeftPeerRow("b", "trainer", "bob", 1, 108.0, DHT_LOST),)
    obs.observe([rec("a", 3, 120.0)], now=140.0)  # b's last record expired: it keeps the reason it gave
    assert obs.snapshot(now=141.0).peers_left[0].reason == DHT_LOST


def test_a_peer_whose_record_expired_without_a_reason_is_listed_as_record_expired():
    obs = observer()
    obs.observe([rec("a", 4, 100.0), rec("b", 4, 100.0), rec("c", 0, 100.0, role="coordinator")], now=100.0)
    obs.observe([rec("a", 5, 130.0), rec("c", 0, 130.0, role="coordinator")], now=130.0)
    (left,) = obs.snapshot(now=131.0).peers_left
    assert (left.peer_id, left.epoch, left.last_seen_at, left.reason) == ("b", 4, 100.0, "record expired")
    obs.observe([rec("a", 5, 135.0), rec("b", 5, 135.0)], now=135.0)  # back (rejoined, or one poll missed it)
    assert obs.snapshot(now=136.0).peers_left == ()


def test_memory_of_peers_that_left_is_bounded():
    obs = observer()
    for i in range(MAX_LEFT + 50):
        obs.observe([rec(f"p{i}", 1, float(i), left_reason="interrupted")], now=float(i))
    left = obs.snapshot(now=1e6).peers_left
    assert len(left) == MAX_LEFT and left[0].peer_id == f"p{MAX_LEFT + 49}", "newest first, oldest forgotten"


def test_the_page_and_api_show_peers_that_left_escaped(dashboard: DashboardServer, holder: SnapshotHolder) -> None:
    snap = make_snapshot()
    evil = LeftPeerRow("12D3KooWgone", "trainer", "mallory", 7, snap.taken_at - 90, '<img src=x onerror="x()">')
    plain = LeftPeerRow("12D3KooWlost", "trainer", "", 5, snap.taken_at - 30, DHT_LOST)
    holder.set(replace(snap, peers_left=(plain, evil)))
    with urllib.request.urlopen(dashboard.url, timeout=10) as resp:
        html = resp.read().decode()
    assert "Peers that left" in html and "lost the DHT: could not read the swarm" in html and "mallory" in html
    assert "<img src=x" not in html and "&lt;img src=x" in html
    with urllib.request.urlopen(dashboard.url + "api/status", timeout=10) as resp:
        status = json.loads(resp.read())
    assert [p["reason"] for p in status["peers_left"]] == [DHT_LOST, '<img src=x onerror="x()">']
    assert status["peers_left"][0]["epoch"] == 5
