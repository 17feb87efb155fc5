"""Evidence: the trust a trainer weighs records with, and its bans."""

from hivetrain.diloco.evidence import Evidence
from tests.records import peer_record

NOW = 1000.0


def evidence(banned_events=None):
    return Evidence(
        "me",
        "",
        exact_average=True,
        stale_after_s=30.0,
        now=lambda: NOW,
        on_ban=lambda peers, reason: (banned_events if banned_events is not None else []).append((peers, reason)),
    )


def test_an_epoch_is_published_only_with_a_quorum_of_others_and_our_own_record_never_counts():
    ev = evidence()
    one = [peer_record("a", 5, NOW, state_hash="h5"), peer_record("me", 5, NOW, state_hash="h5")]
    assert 5 not in ev.published_hashes(one)  # one other peer is no evidence; ours is not counted
    two = one + [peer_record("b", 5, NOW, state_hash="h5")]
    assert ev.published_hashes(two)[5] == "h5"


def test_banned_peers_no_longer_count_and_each_ban_is_reported_once():
    events = []
    ev = evidence(events)
    records = [peer_record(p, 5, NOW, state_hash="h5") for p in ("a", "b")]
    assert ev.published_hashes(records)[5] == "h5"
    ev.ban(["b", "me"], "served bad chunks")  # we never ban ourselves
    ev.ban(["b"], "again")
    assert events == [(["b"], "served bad chunks")] and ev.trust.banned == frozenset({"b"})
    assert 5 not in ev.published_hashes(records)


def test_a_claim_past_the_run_age_bound_is_ignored_and_a_state_adopted_there_moves_the_start_earlier():
    from hivetrain.diloco.sync_policy import decide_sync

    ev = Evidence("me", "", run_started_at=NOW - 10.0, exact_average=True, stale_after_s=30.0, now=lambda: NOW)
    bound = int((10.0 + ev.trust.quorum.max_clock_skew_s) / ev.trust.quorum.min_epoch_s)
    records = [peer_record(p, 5, NOW, state_hash="h5") for p in ("a", "b")]
    liar = peer_record("liar", 10**9, NOW, state_hash="forged")
    decision = decide_sync("me", 5, "h5", [*records, liar], NOW, stale_after_s=30.0, trust=ev.trust)
    assert decision.action == "train" and decision.ban == ("liar",)
    assert ev.published_hashes([*records, liar]) == {5: "h5"}
    # a quorum-backed state past a stale start is adopted (its holders are never banned); the start then moves
    ev.anchor(bound + 100)
    assert ev.trust.run_started_at == NOW - (bound + 100) * ev.trust.quorum.min_epoch_s
    ev.anchor(3)  # never later
    assert ev.trust.run_started_at == NOW - (bound + 100) * ev.trust.quorum.min_epoch_s


def test_without_a_run_start_nothing_is_anchored():
    ev = evidence()
    ev.anchor(10**6)
    assert ev.trust.run_started_at is None


def test_evidence_keeps_the_group_that_closed_without_us_for_its_epoch_only():
    ev = Evidence("me", "", exact_average=True, stale_after_s=30.0, now=lambda: 0.0)
    assert ev.closed_without_us(5) == frozenset()
    ev.note_closed_without_us(5, frozenset({"a", "b"}))
    assert ev.closed_without_us(5) == {"a", "b"} and ev.closed_without_us(6) == frozenset()
    ev.note_closed_without_us(4, frozenset({"c"}))  # an older epoch's group does not replace it
    assert ev.closed_without_us(5) == {"a", "b"}
    ev.note_closed_without_us(6, frozenset({"c", "d"}))
    assert ev.closed_without_us(5) == frozenset() and ev.closed_without_us(6) == {"c", "d"}
