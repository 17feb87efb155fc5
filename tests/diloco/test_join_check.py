"""``diloco.join_check.JoinCheck``: a moshpit/gossip download waits (for a bounded time) for the epoch's θ sketches,
then a state far from them is refused, and its donor banned only on two or more sketches."""

from __future__ import annotations

import torch

from hivetrain.diloco.drift import SKETCH_SIZE, encode_sketch, sketch_to_text
from hivetrain.diloco.join_check import JoinCheck
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
    assert check.ready(records, 4, exclude, now=100.0) == (False, "1 of 2 other peers of epoch 4 published a θ sketch")
    assert not check.ready(records, 4, exclude, now=129.0)[0]
    ready, note = check.ready(records, 4, exclude, now=131.0)  # b withholds its sketch: check on a's alone
    assert ready and note.startswith("1 of 2")
    records[1] = _record("b", 4, base + 0.01 * _sketch(2))
    assert check.ready(records, 4, exclude, now=132.0) == (True, "")
    assert check.ready(records, 5, exclude, now=500.0) == (True, "")  # nobody else at epoch 5: nothing to wait for


def test_a_state_far_from_the_sketches_is_refused_and_its_donor_banned_only_on_two_or_more():
    check = JoinCheck(max_wait_s=30.0)
    base = _sketch(1)
    honest = base + 0.05 * _sketch(3)
    garbage = _sketch(4, scale=50.0)
    two = [_record("a", 4, base), _record("b", 4, base + 0.05 * _sketch(2))]
    assert check.verdict(honest, two, 4, {"me"}).refused == ""
    far = check.verdict(garbage, two, 4, {"me"})
    assert "nearest of 2 peers'" in far.refused and far.ban_donors
    lone = check.verdict(garbage, two[:1], 4, {"me"})
    assert lone.refused and not lone.ban_donors  # the lone publisher may be the liar
    assert check.verdict(garbage, two, 4, {"me", "a", "b"}).refused == ""  # no sketch: nothing to tell
