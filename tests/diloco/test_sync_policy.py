"""Pure decisions: when a peer downloads state, and when it may apply a round of one."""

from hivetrain.diloco.sync_policy import (
    RoundView,
    decide_after_round,
    decide_sync,
    keep_carried,
    may_commit_alone,
    published_hashes,
)
from tests.records import peer_record

NOW = 1000.0


def rec(peer, epoch, digest, role="trainer", age=0.0):
    return peer_record(peer, epoch, NOW - age, role=role, state_hash=digest)


def test_in_sync_keeps_training():
    d = decide_sync("me", 3, "h3", [rec("a", 3, "h3"), rec("b", 3, "h3")], NOW, 30)
    assert d.action == "train"


def test_behind_downloads_from_peers_at_newest_epoch_with_majority_hash():
    records = [rec("a", 5, "good"), rec("b", 5, "good"), rec("c", 5, "evil"), rec("d", 4, "old")]
    d = decide_sync("me", 2, "x", records, NOW, 30)
    assert d.action == "download" and d.target_epoch == 5
    assert set(d.donors) == {"a", "b"}
    assert "behind" in d.reason


def test_forked_state_at_same_epoch_resyncs():
    d = decide_sync("me", 4, "mine", [rec("a", 4, "theirs"), rec("b", 4, "theirs")], NOW, 30)
    assert d.action == "download" and d.donors == ("a", "b") and "forked" in d.reason


def test_both_sides_of_a_fork_agree_on_who_downloads():
    # A 2-1 fork at epoch 3 (the two-peer side's round committed without the third): counting its own hash, each
    # peer sees the same majority. Without its own vote, "a" saw a 1-1 tie among the others and could download.
    lone, pair = "h-lone", "h-pair"
    records = [rec("a", 3, pair), rec("b", 3, pair), rec("c", 3, lone)]
    assert decide_sync("a", 3, pair, records, NOW, 30).action == "train"
    assert decide_sync("b", 3, pair, records, NOW, 30).action == "train"
    d = decide_sync("c", 3, lone, records, NOW, 30)
    assert d.action == "download" and set(d.donors) == {"a", "b"}
    # a 1-1 tie is broken by the hash string, the same way on both sides: exactly one of them downloads
    two = [rec("a", 3, "h-x"), rec("b", 3, "h-y")]
    actions = {p: decide_sync(p, 3, h, two, NOW, 30).action for p, h in (("a", "h-x"), ("b", "h-y"))}
    assert sorted(actions.values()) == ["download", "train"]


def test_stale_records_are_ignored():
    d = decide_sync("me", 1, "h1", [rec("a", 9, "h9", age=100)], NOW, 30)
    assert d.action == "train"


def test_coordinator_hash_wins_its_epoch():
    hashes = published_hashes([rec("a", 2, "x"), rec("b", 2, "x"), rec("c", 2, "y", role="coordinator")])
    assert hashes[2] == "y"


def test_solo_round_only_without_live_trainers():
    assert may_commit_alone("me", 1, [rec("a", 0, "h")], NOW, 30)[0]
    assert not may_commit_alone("me", 1, [rec("a", 1, "h")], NOW, 30)[0]
    assert may_commit_alone("me", 1, [rec("a", 1, "h", age=60)], NOW, 30)[0]
    assert may_commit_alone("me", 1, [rec("c", 3, "h", role="coordinator")], NOW, 30)[0]


def test_moshpit_peers_with_different_states_at_one_epoch_are_not_forks():
    records = [rec("a", 4, "theirs"), rec("b", 4, "theirs")]
    assert decide_sync("me", 4, "mine", records, NOW, 30, exact_average=False).action == "train"
    assert decide_sync("me", 3, "mine", records, NOW, 30, exact_average=False).action == "download"


# ---- the retry / solo-commit / resync / lost-DHT policy after one averaging attempt ----------------------------

POLICY = dict(max_retries=2, stale_after_s=30.0, dht_lost_after_s=60.0)


def view(**kw):
    base = dict(epoch=3, my_hash="h3", attempt=1, committed=False, failure="no_group", time_left_s=20.0)
    return RoundView(**{**base, **kw})


def test_a_committed_group_is_applied():
    p = decide_after_round("me", view(committed=True, group_size=3, failure=""), [rec("a", 3, "h3")], NOW, **POLICY)
    assert p.action == "apply"


def test_a_round_of_one_is_applied_only_when_nobody_else_is_at_our_epoch():
    alone = view(committed=True, group_size=1, failure="")
    assert decide_after_round("me", alone, [rec("a", 2, "h2")], NOW, **POLICY).action == "apply"
    p = decide_after_round("me", alone, [rec("a", 3, "h3")], NOW, **POLICY)
    assert p.action == "retry" and "fork" in p.reason


def test_no_solo_step_on_a_view_that_is_not_real():
    p = decide_after_round("me", view(committed=True, group_size=1, failure="", view_ok=False), [], NOW, **POLICY)
    assert p.action == "retry" and "DHT unreachable" in p.reason


def test_failures_back_off_exponentially_up_to_4_s():
    records = [rec("a", 3, "h3")]
    backoffs = [decide_after_round("me", view(attempt=k), records, NOW, **POLICY).backoff_s for k in (1, 2, 3, 6)]
    assert backoffs == [0.25, 0.5, 1.0, 4.0]


def test_peers_that_moved_on_mean_resync_not_retry():
    p = decide_after_round("me", view(failure="not_in_group"), [rec("a", 4, "h4")], NOW, **POLICY)
    assert p.action == "resync" and "behind" in p.reason


def test_past_the_retries_a_peer_waits_for_peers_of_its_epoch_until_the_deadline_then_carries():
    records = [rec("a", 3, "h3")]
    assert decide_after_round("me", view(attempt=3), records, NOW, **POLICY).action == "retry"
    p = decide_after_round("me", view(attempt=3, time_left_s=-1.0), records, NOW, **POLICY)
    assert p.action == "carry" and "deadline" in p.reason
    p = decide_after_round("me", view(attempt=3), [], NOW, **POLICY)  # nobody else: no reason to wait
    assert p.action == "carry"


def test_a_swarm_unreadable_for_too_long_is_lost_even_mid_round():
    p = decide_after_round("me", view(committed=True, group_size=3, view_age_s=61.0), [], NOW, **POLICY)
    assert p.action == "lost" and "61s" in p.reason


def test_a_long_inner_phase_is_not_a_lost_dht_when_the_view_is_fresh():
    # the view's age is what the record heartbeat measured, not the time since the train loop last looked
    p = decide_after_round("me", view(committed=True, group_size=2, view_age_s=4.0), [rec("a", 3, "h3")], NOW, **POLICY)
    assert p.action == "apply"


def test_stopping_stops():
    assert decide_after_round("me", view(stopping=True), [], NOW, **POLICY).action == "stop"


def test_carried_contributions_are_kept_only_as_stale_as_allowed_and_bounded_by_the_weight_cap():
    assert keep_carried(3, 3, 100, 1000)[0]
    ok, why = keep_carried(3, 4, 100, 1000)  # the default: nothing stale (computed against another state)
    assert not ok and "1 epochs stale" in why
    assert keep_carried(3, 4, 100, 1000, max_staleness=1)[0]
    ok, why = keep_carried(3, 5, 100, 1000, max_staleness=1)
    assert not ok and "2 epochs stale" in why
    ok, why = keep_carried(3, 3, 2000, 1000)
    assert not ok and "max_samples_per_round" in why
