"""LocalCopy: where each phase starts and what its pseudo-gradient and weight are, whole-model and with fragments."""

import torch

from hivetrain.diloco.config import DilocoConfig
from hivetrain.diloco.fragments import fragment_outer_step
from hivetrain.diloco.local_copy import LocalCopy
from hivetrain.diloco.state import TrainingState


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def _train(model, by=1.0):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_whole_model_rounds_load_the_start_and_weigh_the_phase():
    model = _model()
    shared = TrainingState.from_model(model)
    local = LocalCopy.for_run(model, shared, DilocoConfig())
    assert not local.fragments
    _train(model)
    local.load(shared, shared)  # every phase starts from the shared θ
    assert all(torch.equal(p, shared.params[n]) for n, p in model.named_parameters())
    _train(model, 0.5)
    delta, weight = local.pseudo_gradient(shared, 0, 40)
    assert weight == 40 and all(torch.allclose(d, torch.full_like(d, -0.5)) for d in delta)
    assert local.reset() == 0


def test_fragments_keep_the_local_copy_take_in_committed_fragments_and_weigh_every_phase_since():
    model = _model()
    shared = TrainingState.from_model(model)
    config = DilocoConfig(inner_steps=20, fragments=2, overlap="delayed", fragment_mix=0.5)
    local = LocalCopy.for_run(model, shared, config)
    plan = local.plan
    assert local.fragments and plan.num_fragments == 2
    local.load(shared, shared)  # first phase: the whole shared state
    _train(model)  # phase 0: 10 samples
    delta, weight = local.pseudo_gradient(shared, 0, 10)
    first = plan.fragments[0]
    assert weight == 10 and len(delta) == len(first)
    assert all(torch.allclose(d, torch.full_like(d, -1.0)) for d in delta)
    before = _params(model)
    local.load(shared, shared)  # the next phase, the round of epoch 0 still in flight: nothing changes
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    _train(model)  # phase 1: 12 samples; fragment 1's Δ holds phases 0 and 1
    delta, weight = local.pseudo_gradient(shared, 1, 12)
    assert weight == 22 and all(torch.allclose(d, torch.full_like(d, -2.0)) for d in delta)
    # the round of epoch 0 committed: fragment 0 moved by -0.25; the next phase mixes it in at α = 0.5
    committed = fragment_outer_step(shared, first, [torch.full_like(shared.params[n], 0.25) for n in first], 1.0, 0.0)
    local.load(committed, committed)
    for name, p in model.named_parameters():
        if name in first:  # 0.5 x (θ + 2) + 0.5 x (θ - 0.25)
            assert torch.allclose(p, shared.params[name] + 0.875)
        else:  # fragment 1: its round has not committed, the local copy goes on
            assert torch.equal(p, before[name] + 1.0)
    _train(model)  # phase 2: fragment 0 counts from its merge, fragment 1 still from the start
    _, weight0 = local.pseudo_gradient(committed, 2, 8)
    _, weight1 = local.pseudo_gradient(committed, 3, 0)
    assert (weight0, weight1) == (8, 30)
    # a download: the next load replaces the local copy whole, and what no round took is lost
    assert local.reset() == 30
    downloaded = TrainingState(7, {n: t + 3.0 for n, t in shared.params.items()}, dict(shared.momentum))
    local.load(downloaded, downloaded)
    assert all(torch.equal(p, downloaded.params[n]) for n, p in model.named_parameters())


def test_a_jump_the_commits_do_not_explain_reloads_the_whole_state():
    model = _model()
    shared = TrainingState.from_model(model)
    local = LocalCopy.for_run(model, shared, DilocoConfig(inner_steps=20, fragments=2))
    local.load(shared, shared)
    _train(model)
    far = TrainingState(5, {n: t - 1.0 for n, t in shared.params.items()}, dict(shared.momentum))  # 5 > 0 + F
    local.load(far, far)
    assert all(torch.equal(p, far.params[n]) for n, p in model.named_parameters())
