"""Pure decisions: when a peer downloads state, and when it may apply a round of one."""

from hivetrain.diloco.sync_policy import decide_sync, may_commit_alone, published_hashes
from hivetrain.peers.records import PeerRecord

NOW = 1000.0


def rec(peer, epoch, digest, role="trainer", age=0.0):
    return PeerRecord(
        peer_id=peer,
        role=role,
        version="0.1.0",
        run_id="r",
        model_fingerprint="f",
        epoch=epoch,
        throughput=1.0,
        state_hash=digest,
        updated_at=NOW - age,
    )


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
