"""Parameter drift from published sketches (diloco/drift.py): the estimate tracks the exact figure, peers pick the
same coordinates, and bad sketches are left out instead of breaking the figure."""

import pytest
import torch

from hivetrain.diloco.drift import (
    SKETCH_SIZE,
    ParamSketcher,
    decode_sketch,
    drift_by_epoch,
    encode_sketch,
    epoch_sketches,
    relative_drift,
    sketch_buckets,
    sketch_from_text,
    sketch_outlier,
    sketch_seed,
    sketch_to_text,
)
from hivetrain.diloco.join_check import may_ban_refused_donor
from hivetrain.model import build_config, build_model
from tests.records import peer_record


def exact_drift(states):
    flat = torch.stack([torch.cat([p.reshape(-1) for p in s.values()]).double() for s in states])
    mean = flat.mean(0)
    return float((flat - mean).norm(dim=1).max() / mean.norm())


def tiny_params():
    model = build_model(build_config("tiny", vocab_size=256, max_seq_len=64), seed=0)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("run_id", ["run-a", "run-b", "run-c", "run-d"])
@pytest.mark.parametrize("noise", [1e-4, 1e-2])
def test_sketch_estimate_is_within_15_percent_of_the_exact_drift_of_a_real_model(noise, run_id):
    """The tiny model's θ has most of its norm in a few hundred norm weights equal to 1.0: the case where sampling
    coordinates failed (off by 2x) and a count sketch with a 4-wise independent hash does not."""
    base = tiny_params()
    gen = torch.Generator().manual_seed(1)
    states = []
    for p in range(4):  # each peer off the mean by its own amount, proportional to each tensor's scale
        states.append({n: t + (p + 1) * noise * t.std() * torch.randn(t.shape, generator=gen) for n, t in base.items()})
    sketcher = ParamSketcher({n: t.shape for n, t in base.items()}, sketch_seed(run_id, 0))
    estimate = relative_drift([sketcher.sketch(s) for s in states])
    exact = exact_drift(states)
    assert exact * 0.85 < estimate < exact * 1.15, (estimate, exact)


def test_identical_states_have_zero_drift_and_sketches_survive_encoding():
    params = tiny_params()
    sketcher = ParamSketcher({n: t.shape for n, t in params.items()}, sketch_seed("run", 0))
    data = sketcher.encode(object(), params)
    assert len(data) == 4 * SKETCH_SIZE
    assert sketch_from_text(sketch_to_text(data)) == data
    decoded = decode_sketch(data)
    assert torch.equal(decoded, sketcher.sketch(params))
    assert relative_drift([decoded, decoded.clone(), decoded.clone()]) == 0.0


def test_buckets_are_fixed_by_the_run_not_by_the_library_rng():
    """Peers with different torch versions must build the same sketch: buckets and signs come from integer hashing,
    so they are pinned here; a change would make old and new peers' sketches incomparable."""
    seed = sketch_seed("demo", 0)
    bucket, sign = sketch_buckets(10**9, 4, seed)
    torch.manual_seed(123)  # the global RNG plays no part
    again_bucket, again_sign = sketch_buckets(10**9, 4, seed)
    assert torch.equal(bucket, again_bucket) and torch.equal(sign, again_sign)
    assert (bucket.tolist(), sign.tolist()) == PINNED
    other_bucket, _ = sketch_buckets(10**9, 4, sketch_seed("other-run", 0))
    assert not torch.equal(bucket, other_bucket)
    many, signs = sketch_buckets(0, 100_000, seed)
    counts = torch.bincount(many, minlength=SKETCH_SIZE)
    assert counts.min() > 100_000 / SKETCH_SIZE / 2 and counts.max() < 100_000 / SKETCH_SIZE * 2  # spread evenly
    assert abs(float(signs.mean())) < 0.02


PINNED = ([223, 445, 285, 391], [1.0, -1.0, -1.0, 1.0])


def test_bad_sketches_are_rejected_and_left_out_of_the_figure():
    good = encode_sketch(torch.ones(SKETCH_SIZE))
    other = encode_sketch(torch.full((SKETCH_SIZE,), 1.5))
    for bad in (b"", b"abc", encode_sketch(torch.tensor([1.0, float("nan")])), b"\0" * (4 * SKETCH_SIZE + 4)):
        with pytest.raises(ValueError):
            decode_sketch(bad)
    by_epoch = {
        1: {"a": good, "b": other, "nan": encode_sketch(torch.full((SKETCH_SIZE,), float("nan"))), "short": b"\0" * 8},
        2: {"a": good},  # one peer: no figure
        3: {"a": good, "b": b"junk"},  # one valid sketch: no figure
    }
    figures = drift_by_epoch(by_epoch)
    assert list(figures) == [1]
    value, num_peers = figures[1]
    assert num_peers == 2 and value == pytest.approx(0.25 / 1.25)
    with pytest.raises(ValueError):
        relative_drift([torch.ones(3)])
    with pytest.raises(ValueError):
        relative_drift([torch.zeros(3), torch.zeros(3)])


def _peers_at_drift(base, drift, count, seed):
    """``count`` θ off ``base`` by about ``drift`` of its norm each (moshpit peers of one epoch)."""
    gen = torch.Generator().manual_seed(seed)
    scale = drift / (sum(t.numel() for t in base.values()) ** 0.5)
    norm = sum(float(t.double().pow(2).sum()) for t in base.values()) ** 0.5
    return [{n: t + scale * norm * torch.randn(t.shape, generator=gen) for n, t in base.items()} for _ in range(count)]


def test_a_downloaded_state_far_from_the_epochs_published_sketches_is_an_outlier():
    """Moshpit peers 3% and 8% apart (the most drift measured) accept each other's states; a state of random weights
    (what an ``epoch_liar`` serves) and θ pushed 60% off are refused, also with 2 of 7 published sketches lying."""
    base = tiny_params()
    sketcher = ParamSketcher({n: t.shape for n, t in base.items()}, sketch_seed("run-x", 0))
    honest = [sketcher.sketch(s) for s in _peers_at_drift(base, 0.03, 6, seed=2)]
    own = sketcher.sketch(_peers_at_drift(base, 0.03, 1, seed=3)[0])
    assert sketch_outlier(own, honest) == ""
    assert sketch_outlier(sketcher.sketch(_peers_at_drift(base, 0.084, 1, seed=6)[0]), honest) == ""
    gen = torch.Generator().manual_seed(4)
    garbage = sketcher.sketch({n: torch.randn(t.shape, generator=gen) * 3.0 for n, t in base.items()})
    pushed = sketcher.sketch(_peers_at_drift(base, 0.60, 1, seed=5)[0])
    colluding = honest[:5] + [garbage, garbage]
    for far in (garbage, pushed):
        assert "from the median of" in sketch_outlier(far, honest)
        assert sketch_outlier(far, colluding) != ""
    assert sketch_outlier(garbage, []) == ""  # no sketch tells nothing
    with pytest.raises(ValueError, match="different sizes"):
        sketch_outlier(own, [h[:100] for h in honest])


def test_with_one_or_two_sketches_a_donor_must_lie_near_one_of_them_and_a_lone_sketch_bans_nobody():
    """A swarm of 2-3 trainers besides the donor: no median resists a liar, so a state is taken when it lies within
    the floor of one published sketch. With one liar among the donor and two publishers, a lying donor is refused by
    both honest sketches and an honest donor is taken despite a lying one; a single contradicting sketch refuses the
    state but is no ground to ban the donor (the publisher may be the liar)."""
    base = tiny_params()
    sketcher = ParamSketcher({n: t.shape for n, t in base.items()}, sketch_seed("run-x", 0))
    a, b, donor = (sketcher.sketch(s) for s in _peers_at_drift(base, 0.084, 3, seed=7))
    gen = torch.Generator().manual_seed(4)
    garbage = sketcher.sketch({n: torch.randn(t.shape, generator=gen) * 3.0 for n, t in base.items()})
    assert sketch_outlier(donor, [a, b]) == "" and sketch_outlier(donor, [a]) == ""
    assert "nearest of 2 peers'" in sketch_outlier(garbage, [a, b])
    assert sketch_outlier(donor, [a, garbage]) == ""  # the liar publishes; the honest donor is still taken
    assert "nearest of 1 peers'" in sketch_outlier(garbage, [a])
    assert sketch_outlier(donor, [garbage]) != ""  # donor and lone publisher disagree: refused...
    assert not may_ban_refused_donor(1) and may_ban_refused_donor(2) and may_ban_refused_donor(5)  # ...unbanned


def test_epoch_sketches_keeps_one_valid_sketch_per_trainer_of_the_epoch():
    good = sketch_to_text(encode_sketch(torch.ones(SKETCH_SIZE)))
    records = [
        peer_record("a", 5, 0.0, param_sketch=good),
        peer_record("b", 5, 0.0, param_sketch="!!not base64"),
        peer_record("c", 4, 0.0, param_sketch=good),
        peer_record("d", 5, 0.0, param_sketch=good),
        peer_record("e", 5, 0.0, param_sketch=""),
        peer_record("f", 5, 0.0, param_sketch=good, role="coordinator"),
    ]
    assert len(epoch_sketches(records, 5, exclude=set())) == 2
    assert len(epoch_sketches(records, 5, exclude={"a"})) == 1
