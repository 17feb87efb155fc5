"""DiLoCo outer step: closed-form reference, torch's Nesterov SGD as a cross-check, and a pinned golden trajectory."""

import json
import os
from pathlib import Path

import pytest
import torch

from hivetrain.diloco.outer import outer_step, pseudo_gradient
from hivetrain.diloco.state import TrainingState

GOLDEN = Path(__file__).parent / "golden_outer.json"


def _state(values):
    params = {"w": torch.tensor(values, dtype=torch.float32)}
    return TrainingState(epoch=0, params=params, momentum={"w": torch.zeros_like(params["w"])})


def test_outer_step_matches_closed_form_nesterov():
    lr, mu = 0.7, 0.9
    state = _state([1.0, -2.0, 0.5])
    deltas = [torch.tensor([0.1, 0.2, -0.3]), torch.tensor([0.05, -0.1, 0.2])]
    theta, m = state.params["w"].double(), torch.zeros(3, dtype=torch.float64)
    for delta in deltas:
        state = outer_step(state, [delta], lr, mu)
        m = mu * m + delta.double()
        theta = theta - lr * (delta.double() + mu * m)
    assert state.epoch == 2
    torch.testing.assert_close(state.params["w"].double(), theta, atol=1e-6, rtol=0)
    torch.testing.assert_close(state.momentum["w"].double(), m, atol=1e-6, rtol=0)


def test_outer_step_agrees_with_torch_sgd_nesterov():
    torch.manual_seed(0)
    theta0 = torch.randn(1000)
    state = _state(theta0.tolist())
    param = torch.nn.Parameter(theta0.clone())
    sgd = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(5):
        delta = torch.randn(1000) * 0.01
        state = outer_step(state, [delta], 0.7, 0.9)
        param.grad = delta.clone()
        sgd.step()
    torch.testing.assert_close(state.params["w"], param.detach(), atol=1e-6, rtol=1e-6)


def test_pseudo_gradient_is_theta_minus_local_and_rejects_nan():
    model = torch.nn.Linear(3, 2)
    state = TrainingState.from_model(model)
    with torch.no_grad():
        model.weight.add_(0.5)
    (d_w, d_b) = pseudo_gradient(state, model)
    torch.testing.assert_close(d_w, torch.full((2, 3), -0.5))
    torch.testing.assert_close(d_b, torch.zeros(2))
    with torch.no_grad():
        model.bias[0] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        pseudo_gradient(state, model)


def test_outer_step_rejects_bad_average():
    state = _state([1.0, 2.0])
    with pytest.raises(ValueError, match="does not match"):
        outer_step(state, [torch.zeros(3)], 0.7, 0.9)
    with pytest.raises(ValueError, match="not finite"):
        outer_step(state, [torch.tensor([0.0, float("inf")])], 0.7, 0.9)


def test_golden_trajectory_is_bit_exact():
    """Pins the exact bits of 4 outer steps; regenerate with HIVETRAIN_REGEN_GOLDEN=1 after an intended change."""
    gen = torch.Generator().manual_seed(1234)
    state = _state(torch.randn(64, generator=gen).tolist())
    for _ in range(4):
        state = outer_step(state, [torch.randn(64, generator=gen) * 0.05], 0.7, 0.9)
    digest = state.state_hash()
    if os.environ.get("HIVETRAIN_REGEN_GOLDEN"):
        GOLDEN.write_text(json.dumps({"state_hash": digest, "theta_head": state.params["w"][:4].tolist()}, indent=1))
    golden = json.loads(GOLDEN.read_text())
    assert digest == golden["state_hash"]


def test_without_momentum_theta_is_plain_averaging_and_the_momentum_stays_zero():
    """μ = 0: θ ← θ − η·Δ̄ bit for bit as with a buffer, and no buffer is carried (state downloads skip zero chunks)."""
    gen = torch.Generator().manual_seed(3)
    state = _state(torch.randn(257, generator=gen).tolist())
    state.momentum["w"] = torch.randn(257, generator=gen)  # a state saved by a version that kept m = Δ̄
    theta = state.params["w"].clone()
    for _ in range(3):
        delta = torch.randn(257, generator=gen) * 0.01
        state = outer_step(state, [delta], 0.8, 0.0)
        theta = theta - delta * torch.tensor(0.8)
        assert torch.equal(state.params["w"], theta)
        assert torch.count_nonzero(state.momentum["w"]) == 0
