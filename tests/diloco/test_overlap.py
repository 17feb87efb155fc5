"""Overlap start points (pure): delayed starts from the shared θ, eager from θ advanced by the estimated average."""

import pytest
import torch

from hivetrain.diloco.outer import outer_step
from hivetrain.diloco.overlap import PreviousRound, eager_estimate, start_params
from hivetrain.diloco.state import TrainingState


def shared_state() -> TrainingState:
    g = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g)}
    momentum = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
    return TrainingState(epoch=7, params=params, momentum=momentum)


def deltas(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=g), torch.randn(5, generator=g)]


def test_eager_estimate_replaces_our_share_of_the_previous_average_by_our_new_pseudo_gradient():
    avg, old, new = deltas(1), deltas(2), deltas(3)
    est = eager_estimate(new, PreviousRound(avg, old, share=0.25))
    for e, a, o, n in zip(est, avg, old, new, strict=True):
        torch.testing.assert_close(e, a + 0.25 * (n - o))
    # two equal-weight peers: (1/M)·Δ_new + (1/M)·Δ_other_old, the paper's form
    other_old = deltas(4)
    two = [(o + x) / 2 for o, x in zip(old, other_old, strict=True)]
    est = eager_estimate(new, PreviousRound(two, old, share=0.5))
    for e, n, x in zip(est, new, other_old, strict=True):
        torch.testing.assert_close(e, 0.5 * n + 0.5 * x)


def test_without_a_previous_round_our_own_pseudo_gradient_stands_in():
    new = deltas(3)
    for e, n in zip(eager_estimate(new, None), new, strict=True):
        assert torch.equal(e, n) and e is not n


def test_delayed_starts_from_the_shared_theta_without_aliasing_it():
    state = shared_state()
    start = start_params(state, deltas(3), None, "delayed", 0.7, 0.9)
    for name, t in start.items():
        assert torch.equal(t, state.params[name]) and t.data_ptr() != state.params[name].data_ptr()


def test_eager_starts_from_the_outer_step_with_the_estimate_and_leaves_the_shared_state_alone():
    state = shared_state()
    before = state.state_hash()
    prev = PreviousRound(deltas(1), deltas(2), share=1 / 3)
    start = start_params(state, deltas(3), prev, "eager", 0.7, 0.9)
    expected = outer_step(state, eager_estimate(deltas(3), prev), 0.7, 0.9).params
    for name in state.params:
        assert torch.equal(start[name], expected[name])
    assert state.state_hash() == before


def test_bad_shares_and_modes_are_refused():
    with pytest.raises(ValueError, match="share"):
        PreviousRound(deltas(1), deltas(2), share=1.5)
    with pytest.raises(ValueError, match="overlap mode"):
        start_params(shared_state(), deltas(3), None, "sometimes", 0.7, 0.9)  # type: ignore[arg-type]
