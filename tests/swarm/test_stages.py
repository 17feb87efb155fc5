"""The stage cut computes exactly what the uncut model computes (loss and every parameter gradient)."""

from __future__ import annotations

import pytest
import torch

from hivetrain.model import build_config, build_model, lm_loss
from hivetrain.swarm.stages import PipelineStage, build_stage, cut_model, plan_stages


def _pipeline_loss(stages, windows_BT1):
    h = windows_BT1[:, :-1]
    for stage in stages:
        h = stage(h)
    return torch.nn.functional.cross_entropy(h.flatten(0, 1), windows_BT1[:, 1:].flatten())


@pytest.mark.parametrize(("preset", "num_stages"), [("tiny", 3), ("tiny", 2), ("tiny", 1), ("small", 3), ("small", 4)])
def test_cut_model_matches_uncut_loss_and_gradients(preset, num_stages):
    config = build_config(preset, max_seq_len=64)
    model = build_model(config, seed=3)
    stages = cut_model(model, num_stages)
    windows = torch.randint(0, 256, (3, 33), generator=torch.Generator().manual_seed(0))

    reference = lm_loss(model, windows)
    reference.backward()
    loss = _pipeline_loss(stages, windows)
    loss.backward()

    torch.testing.assert_close(loss, reference, atol=1e-5, rtol=0)
    full = dict(model.named_parameters())
    seen = set()
    for stage in stages:
        for name, param in stage.named_parameters():
            torch.testing.assert_close(param.grad, full[name].grad, atol=1e-5, rtol=0, msg=name)
            seen.add(name)
    assert seen == set(full), "the stages together must hold every parameter exactly once"


def test_plan_stages_assigns_every_block_once():
    specs = plan_stages(num_layers=6, num_stages=4)
    assert [(s.layer_start, s.layer_end) for s in specs] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert specs[0].is_first and specs[-1].is_last
    tiny = plan_stages(num_layers=2, num_stages=3)
    assert [s.num_layers for s in tiny] == [1, 1, 0]  # the last stage holds the norm and the LM head
    assert [s.num_layers for s in plan_stages(6, 3, (1, 4, 1))] == [1, 4, 1]


@pytest.mark.parametrize(
    ("num_layers", "num_stages", "layers"),
    [(2, 5, ()), (6, 3, (1, 1, 1)), (6, 2, (1, 2, 3)), (6, 0, ())],
)
def test_plan_stages_rejects_bad_cuts(num_layers, num_stages, layers):
    with pytest.raises(ValueError):
        plan_stages(num_layers, num_stages, layers)


def test_build_stage_holds_the_seeds_initial_parameters_and_fresh_stage_loads_them():
    config = build_config("tiny", max_seq_len=64)
    model = build_model(config, seed=7)
    full = dict(model.named_parameters())
    spec = plan_stages(config.num_hidden_layers, 3)[1]
    stage = build_stage(config, spec, seed=7)
    for name, param in stage.named_parameters():
        assert torch.equal(param, full[name]), name
    fresh_config = build_config("tiny", max_seq_len=64)
    fresh_config._attn_implementation = "sdpa"
    fresh = PipelineStage(fresh_config, spec)
    fresh.load_state_dict(stage.state_dict())
    hidden = torch.randn(2, 16, config.hidden_size)
    torch.testing.assert_close(fresh(hidden), stage(hidden), atol=0, rtol=0)
