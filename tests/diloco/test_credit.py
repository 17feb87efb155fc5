"""Credit from witnesses (``diloco/credit.py``): who witnesses whom in a round, and how the coordinator counts."""

from __future__ import annotations

from collections import Counter

from hivetrain.diloco.credit import WITNESSES, CreditLedger, witnesses_for
from tests.records import peer_record


def test_each_member_is_witnessed_by_k_others_in_a_large_group_and_by_everyone_in_a_small_one():
    weights = [(f"p{i:02d}", 100.0 + i) for i in range(10)]
    seen = Counter()
    for me, _ in weights:
        mine = witnesses_for("round-a", weights, me)
        assert len(mine) == WITNESSES and me not in dict(mine)
        assert all(samples == int(dict(weights)[p]) for p, samples in mine)  # the agreed weights, as integers
        seen.update(p for p, _ in mine)
    assert set(seen.values()) == {WITNESSES}  # a ring: everyone witnessed exactly k times
    small = weights[:3]
    for me, _ in small:
        assert {p for p, _ in witnesses_for("round-a", small, me)} == {p for p, _ in small} - {me}


def test_the_ring_follows_the_round_id_and_nobody_outside_or_alone_witnesses():
    weights = [(f"p{i:02d}", 8.0) for i in range(10)]
    a, b = witnesses_for("round-a", weights, "p00"), witnesses_for("round-b", weights, "p00")
    assert a == witnesses_for("round-a", list(reversed(weights)), "p00")  # the order of the input does not matter
    assert a != b  # another round, other neighbours (a fixed order would let a peer pick its witnesses once)
    assert witnesses_for("round-a", weights, "stranger") == ()
    assert witnesses_for("round-a", [("p00", 8.0)], "p00") == ()  # a solo round witnesses nothing


def _witness(peer: str, epoch: int, entries, role: str = "trainer"):
    return peer_record(peer, epoch, role=role, witnessed=tuple(entries), witnessed_epoch=epoch)


def test_a_peer_is_credited_the_median_of_its_witnesses_and_one_liar_moves_nothing():
    ledger = CreditLedger(max_samples_per_round=1000)
    ledger.observe(
        [_witness("w1", 3, [("x", 300)]), _witness("w2", 3, [("x", 300)]), _witness("liar", 3, [("x", 999)])]
    )
    assert ledger.credited() == {"x": 300}
    ledger.observe([_witness("liar", 3, [("x", 0)])])  # the liar changes its story: still one of three
    assert ledger.credited() == {"x": 300}


def test_self_witness_non_trainers_and_claims_over_the_round_bound_do_not_count():
    ledger = CreditLedger(max_samples_per_round=500)
    ledger.observe(
        [
            _witness("x", 2, [("x", 400)]),  # its own weight: never counted
            _witness("c", 2, [("y", 400)], role="coordinator"),
            _witness("w", 2, [("y", 10**9)]),  # capped at the round bound
        ]
    )
    assert ledger.credited() == {"y": 500}


def test_each_epoch_counts_once_however_often_it_is_polled_and_closed_epochs_are_final():
    ledger = CreditLedger(max_samples_per_round=1000, window_epochs=2)
    for _ in range(3):  # the same record, polled three times
        ledger.observe([_witness("w", 1, [("x", 100)])])
    assert ledger.credited() == {"x": 100}
    ledger.observe([_witness("w", 2, [("x", 120)]), _witness("v", 5, [("x", 130)])])
    assert ledger.final == {"x": 220} and ledger.credited() == {"x": 350}  # epochs 1-2 closed once epoch 5 came
    ledger.observe([_witness("late", 1, [("x", 900)])])  # a witness of a closed epoch
    assert ledger.credited() == {"x": 350}
