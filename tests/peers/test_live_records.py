"""``live_records``: the one rule for which peer records count (issue 27, item 3). Each clause on its own."""

from hivetrain.peers.records import PeerRecord, live_records

NOW = 1_000.0


def _record(peer_id: str, *, age_s: float = 1.0, role: str = "trainer", **fields) -> PeerRecord:
    base = dict(version="0.1.0", run_id="run", model_fingerprint="fp", epoch=3, throughput=10.0)
    return PeerRecord(peer_id=peer_id, role=role, updated_at=NOW - age_s, **{**base, **fields})


def _ids(records) -> list[str]:
    return [r.peer_id for r in records]


def test_a_fresh_trainer_counts_and_a_record_past_the_ttl_does_not():
    records = [_record("fresh", age_s=29.0), _record("stale", age_s=31.0)]
    assert _ids(live_records(records, NOW, 30.0)) == ["fresh"]
    assert _ids(live_records(records, NOW, None)) == ["fresh", "stale"]  # no age limit
    assert _ids(live_records(records, None, 30.0)) == ["fresh", "stale"]


def test_role_filters_and_none_takes_every_role():
    records = [_record("t"), _record("c", role="coordinator")]
    assert _ids(live_records(records, NOW, 30.0)) == ["t"]
    assert _ids(live_records(records, NOW, 30.0, role="coordinator")) == ["c"]
    assert _ids(live_records(records, NOW, 30.0, role=None)) == ["t", "c"]


def test_banned_and_excluded_peers_do_not_count():
    records = [_record("a"), _record("b"), _record("me")]
    assert _ids(live_records(records, NOW, 30.0, banned={"a"}, exclude={"me"})) == ["b"]


def test_paused_peers_count_unless_the_caller_drops_them():
    records = [_record("working"), _record("paused", paused=True)]
    assert _ids(live_records(records, NOW, 30.0)) == ["working", "paused"]
    assert _ids(live_records(records, NOW, 30.0, paused=False)) == ["working"]


def test_a_departed_peers_last_record_counts_only_when_asked():
    records = [_record("here"), _record("gone", left_reason="stopped")]
    assert _ids(live_records(records, NOW, 30.0)) == ["here"]
    assert _ids(live_records(records, NOW, 30.0, departed=True)) == ["here", "gone"]
