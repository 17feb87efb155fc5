"""``diloco.join_check.JoinCheck``: a moshpit/gossip download waits (for a bounded time) for the epoch's θ sketches,
then a state far from them is refused, and its donor banned only on two or more sketches."""

from __future__ import annotations

import torch

from hivetrain.diloco.drift import SKETCH_SIZE, encode_sketch, sketch_to_text
from hivetrain.diloco.join_check import JoinCheck, wait_for_sketches
from tests.records import peer_record


def _sketch(seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(SKETCH_SIZE, generator=torch.Generator().manual_seed(seed)) * scale


def _record(peer: str, epoch: int, sketch: torch.Tensor | None):
    text = sketch_to_text(encode_sketch(sketch)) if sketch is not None else ""
    return peer_record(peer, epoch, param_sketch=text)


def test_a_download_waits_for_the_other_peers_sketches_then_gives_up_after_its_bound():
    check = JoinCheck(max_wait_s=30.0)
    base = _sketch(1)
    records = [_record("a", 4, base), _record("b", 4, None), _record("liar", 4, None)]
    exclude = {"me", "liar"}  # the donor
    waiting = (False, "1 of 2 other peers at or committing epoch 4 published a θ sketch")
    assert check.ready(records, 4, ["liar"], exclude, now=100.0) == waiting
    assert not check.ready(records, 4, ["liar"], exclude, now=129.0)[0]
    ready, note = check.ready(records, 4, ["liar"], exclude, now=131.0)  # b withholds its sketch: check on a's alone
    assert ready and note.startswith("1 of 2")
    records[1] = _record("b", 4, base + 0.01 * _sketch(2))
    assert check.ready(records, 4, ["liar"], exclude, now=132.0) == (True, "")
    assert check.ready(records, 6, ["liar"], exclude, now=500.0) == (True, "")  # nobody else at or near epoch 6


def test_a_donor_alone_at_its_epoch_waits_for_the_peers_committing_it():
    """A joiner that started right after the first commit saw only the liar's record at the new epoch: with no
    sketch to compare it adopted the liar's random weights. The peers one epoch behind are committing it: wait for
    their sketches (bounded), then judge."""
    check = JoinCheck(max_wait_s=30.0)
    records = [_record("a", 4, _sketch(1)), _record("b", 4, _sketch(1)), _record("liar", 5, None)]
    exclude = {"me", "liar"}
    assert check.ready(records, 5, ["liar"], exclude, now=100.0) == (
        False,
        "0 of 2 other peers at or committing epoch 5 published a θ sketch",
    )
    records[:2] = [_record("a", 5, _sketch(3)), _record("b", 5, _sketch(3) + 0.01 * _sketch(4))]
    assert check.ready(records, 5, ["liar"], exclude, now=103.0) == (True, "")
    assert check.verdict(_sketch(9, scale=40.0), records, 5, ["liar"], exclude).ban_donors  # then refused, banned


def test_a_state_far_from_the_sketches_is_refused_and_its_donor_banned_only_on_two_or_more():
    check = JoinCheck(max_wait_s=30.0)
    base = _sketch(1)
    honest = base + 0.05 * _sketch(3)
    garbage = _sketch(4, scale=50.0)
    two = [_record("a", 4, base), _record("b", 4, base + 0.05 * _sketch(2))]
    assert check.verdict(honest, two, 4, ["d"], {"me", "d"}).refused == ""
    far = check.verdict(garbage, two, 4, ["d"], {"me", "d"})
    assert "nearest of 2 peers'" in far.refused and far.ban_donors
    lone = check.verdict(garbage, two[:1], 4, ["d"], {"me", "d"})
    assert lone.refused and not lone.ban_donors  # the lone publisher may be the liar
    assert check.verdict(garbage, two, 4, ["d"], {"me", "d", "a", "b"}).refused == ""  # no sketch: nothing to tell


def test_after_a_refusal_on_one_sketch_the_same_donor_is_asked_again_only_on_new_evidence():
    """One sketch against the donor bans nobody; downloading the same state again could only give the same answer,
    so the joiner waits for a second sketch of the epoch (or another donor, or another epoch) instead of looping."""
    check = JoinCheck(max_wait_s=30.0)
    base = _sketch(1)
    records = [_record("a", 4, base), _record("liar", 4, None)]
    exclude = {"me", "liar"}
    assert check.ready(records, 4, ["liar"], exclude, now=0.0) == (True, "")
    assert check.verdict(_sketch(4, scale=50.0), records, 4, ["liar"], exclude).refused
    ready, note = check.ready(records, 4, ["liar"], exclude, now=1.0)
    assert not ready and "second θ sketch" in note
    assert check.ready(records, 4, ["a"], {"me", "a"}, now=40.0)[0]  # another donor may be asked (the liar has no
    # sketch to wait for past the bound)
    assert check.ready(records, 6, ["liar"], exclude, now=1.0)[0]  # and another epoch (nobody at or committing it)
    records.append(_record("b", 4, base + 0.05 * _sketch(2)))
    assert check.ready(records, 4, ["liar"], exclude, now=2.0) == (True, "")


def test_a_joiner_waits_for_three_sketches_or_every_other_peers_for_a_bounded_time():
    """Download waits for min(3, other trainers at the epoch) sketches, and no longer than its bound."""
    assert wait_for_sketches(num_others=5, num_published=2, waited_s=1.0, max_wait_s=30.0)
    assert not wait_for_sketches(num_others=5, num_published=3, waited_s=1.0, max_wait_s=30.0)
    assert wait_for_sketches(num_others=2, num_published=1, waited_s=1.0, max_wait_s=30.0)  # a swarm of 3
    assert not wait_for_sketches(num_others=2, num_published=2, waited_s=1.0, max_wait_s=30.0)
    assert not wait_for_sketches(num_others=0, num_published=0, waited_s=0.0, max_wait_s=30.0)
    assert not wait_for_sketches(num_others=2, num_published=1, waited_s=31.0, max_wait_s=30.0)  # one withholds
