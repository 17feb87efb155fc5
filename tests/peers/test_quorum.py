"""The quorum rule (pure): holders, agreement, progress; θ₀ holders; moshpit; the run-age bound."""

import random

import pytest

from hivetrain.peers.quorum import (
    Backing,
    QuorumConfig,
    Vote,
    backed_states,
    distinct_voters,
    implausible,
    max_plausible_epoch,
)

Q = QuorumConfig()


def votes(*spec):
    """("a", 5, "h"), ... -> Votes."""
    return [Vote(*s) for s in spec]


def hashes(claims, config=Q, exact=True):
    return {e: b.state_hash for e, b in backed_states(claims, config, exact).items()}


def test_one_peer_is_never_a_quorum_and_two_agreeing_peers_are():
    assert hashes(votes(("a", 5, "h"))) == {}
    assert hashes(votes(("a", 5, "h"), ("b", 5, "h"))) == {5: "h"}
    assert hashes(votes(("a", 5, "h"), ("b", 5, "h"))[:1] * 3) == {}  # one identity counted once
    backing = backed_states(votes(("a", 5, "h"), ("b", 5, "h"), ("c", 3, "g")), Q)[5]
    assert backing.holders == ("a", "b") and (backing.at_epoch, backing.passed, backing.population) == (2, 2, 3)


def test_agreement_two_hashes_at_one_epoch_need_a_strict_majority_of_that_epoch():
    assert hashes(votes(("a", 5, "h"), ("b", 5, "h"), ("x", 5, "e"), ("y", 5, "e"))) == {}
    assert hashes(votes(("a", 5, "h"), ("b", 5, "h"), ("c", 5, "h"), ("x", 5, "e"), ("y", 5, "e"))) == {5: "h"}
    # below one half, ties go to the larger hash string
    loose = QuorumConfig(min_fraction=0.4)
    assert hashes(votes(("a", 5, "h"), ("b", 5, "h"), ("x", 5, "e"), ("y", 5, "e")), loose) == {5: "h"}


def test_progress_peers_behind_an_epoch_count_against_it_so_a_minority_cannot_run_ahead():
    honest = votes(("a", 7, "h"), ("b", 7, "h"), ("c", 7, "h"))
    colluders = votes(("x", 12, "e"), ("y", 12, "e"))
    assert hashes(honest + colluders) == {7: "h"}  # epoch 12: 2 of 5 live peers; epoch 7: all 5 passed it
    # 2 of 4: half the identities can lead (rule 3: at least half, so the survivors of a peer that died are followed)
    assert hashes(honest[:2] + colluders) == {7: "h", 12: "e"}


def test_theta0_holders_neither_back_nor_oppose_a_trained_state():
    crowd = votes(("a", 7, "h"), ("b", 7, "h")) + votes(*[(f"j{i}", 0, "t0") for i in range(10)])
    assert hashes(crowd) == {0: "t0", 7: "h"}


def test_with_count_untrained_theta0_holders_outvote_a_lone_trained_claim():
    lone = QuorumConfig(min_peers=1, min_fraction=0.51)
    start = votes(("liar", 500, "x"), ("a", 0, "t0"), ("b", 0, "t0"))
    assert 500 in backed_states(start, lone)  # "1 of 1" trained: why the follower counts θ₀ holders
    counting = QuorumConfig(min_peers=1, min_fraction=0.51, count_untrained=True)
    assert 500 not in backed_states(start, counting)
    assert 4 in backed_states(votes(("a", 4, "h")), counting)  # alone it is still followed


def test_moshpit_counts_peers_at_an_epoch_whatever_their_hash():
    peers = votes(("a", 4, "h-a"), ("b", 4, "h-b"), ("c", 3, "h-c"))
    assert hashes(peers) == {}
    assert hashes(peers, exact=False) == {4: "h-b"}
    assert hashes(peers[:1] + peers[2:], exact=False) == {}


def test_claims_without_a_state_hash_are_not_votes():
    assert hashes(votes(("a", 5, "h"), ("b", 5, "h"), ("c", 9, ""), ("d", 9, ""))) == {5: "h"}


def test_the_run_age_bounds_epochs():
    config = QuorumConfig(min_epoch_s=0.5, max_clock_skew_s=10.0)
    assert max_plausible_epoch(None, 1000.0, config) is None
    assert max_plausible_epoch(1000.0, 1000.0, config) == 20
    assert max_plausible_epoch(900.0, 1000.0, config) == 220
    assert max_plausible_epoch(2000.0, 1000.0, config) == 0  # a start in the future: only epoch 0 is plausible
    claims = votes(("a", 200, "h"), ("liar", 10**6, "x"), ("liar", 10**6 + 1, "y"))
    assert implausible(claims, 220) == ("liar",)
    assert implausible(claims, None) == ()


@pytest.mark.parametrize(
    "kwargs", [dict(min_peers=0), dict(min_fraction=1.0), dict(min_fraction=-0.1), dict(min_epoch_s=0.0)]
)
def test_bad_quorum_configs_are_refused(kwargs):
    with pytest.raises(ValueError, match="QuorumConfig"):
        QuorumConfig(**kwargs)


def _rule_per_epoch(claims, config, exact):
    """The quorum rule of the module docstring, evaluated epoch by epoch over every voter (the O(voters x epochs)
    form ``backed_states`` had before it grouped voters by epoch in one pass)."""
    voters = distinct_voters(claims)
    trained = sum(1 for v in voters if v.epoch >= 1)
    result = {}
    for epoch in sorted({v.epoch for v in voters}):
        at = [v for v in voters if v.epoch == epoch]
        population = trained if epoch >= 1 and not config.count_untrained else len(voters)
        passed = sum(1 for v in voters if v.epoch >= epoch)
        hashes = sorted({v.state_hash for v in at}, key=lambda h: (sum(v.state_hash == h for v in at), h))
        state_hash = hashes[-1] if exact else max(v.state_hash for v in at)
        count = sum(v.state_hash == state_hash for v in at) if exact else len(at)
        agreed = count >= config.min_peers and count > config.min_fraction * len(at)
        if agreed and passed >= config.min_fraction * population:
            holders = tuple(v.peer_id for v in at if v.state_hash == state_hash)
            result[epoch] = Backing(epoch, state_hash, holders, len(at), passed, population)
    return result


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("count_untrained", [False, True])
def test_backed_states_in_one_pass_equals_the_rule_evaluated_per_epoch(exact, count_untrained):
    rng = random.Random(7)
    config = QuorumConfig(count_untrained=count_untrained)
    for trial in range(200):
        num_epochs = rng.randint(1, 12)
        claims = [
            Vote(f"p{rng.randrange(60):02d}", rng.randrange(num_epochs), rng.choice(["", "a", "b", "c"]))
            for _ in range(rng.randint(0, 80))
        ]  # duplicate peer IDs and claims without a state included
        assert backed_states(claims, config, exact) == _rule_per_epoch(claims, config, exact), trial
