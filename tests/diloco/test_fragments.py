"""Streaming DiLoCo's fragments: the plan, the fragment's pseudo-gradient and outer step, and the local merge."""

import pytest
import torch

from hivetrain.diloco.fragments import FragmentPlan, fragment_outer_step, fragment_pseudo_gradient, merge_fragment
from hivetrain.diloco.outer import outer_step
from hivetrain.diloco.state import TrainingState


def _state(epoch=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"embed": (8, 4), "a.w": (4, 4), "a.b": (4,), "b.w": (4, 6), "b.b": (6,), "head": (6, 8)}
    params = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    return TrainingState(
        epoch=epoch, params=params, momentum={n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
    )


class Model(torch.nn.Module):
    def __init__(self, state):
        super().__init__()
        self.p = torch.nn.ParameterDict(
            {n.replace(".", "_"): torch.nn.Parameter(t.clone()) for n, t in state.params.items()}
        )

    def named_parameters(self, *args, **kwargs):  # the state's names (ParameterDict keys cannot hold dots)
        for name, p in self.p.items():
            yield name.replace("_", "."), p


def test_the_plan_covers_every_tensor_once_balanced_and_the_same_for_every_peer():
    state = _state()
    plan = FragmentPlan.of_state(state, 3)
    names = [n for f in plan.fragments for n in f]
    assert sorted(names) == sorted(state.params) and len(names) == len(set(names))
    order = list(state.params)
    assert all(list(f) == sorted(f, key=order.index) for f in plan.fragments)  # the state's order inside a fragment
    assert plan.numels == tuple(sum(state.params[n].numel() for n in f) for f in plan.fragments)
    # contiguous runs cut nearest each third of 130: embed 32 + a.w 16 (48) | a.b 4 + b.w 24 + b.b 6 (34) | head 48
    assert plan.fragments == (("embed", "a.w"), ("a.b", "b.w", "b.b"), ("head",)) and plan.numels == (48, 34, 48)
    # so each fragment is one contiguous byte range of the flat state (downloads reuse the others' chunks)
    assert [n for f in plan.fragments for n in f] == order
    many = FragmentPlan.build({f"t{i}": 10 for i in range(8)}, 3)  # equal tensors: 3 / 3 / 2 (cuts at 26.7, 53.3)
    assert [len(f) for f in many.fragments] == [3, 2, 3] and sum(many.numels) == 80
    lopsided = FragmentPlan.build({"big": 1000, "a": 1, "b": 1}, 3)  # every fragment keeps one tensor at least
    assert lopsided.fragments == (("big",), ("a",), ("b",))
    assert FragmentPlan.of_state(_state(seed=5), 3) == plan  # a function of names and shapes only
    assert [plan.fragment_of(e) for e in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert plan.names(4) == plan.fragments[1]


def test_a_plan_refuses_empty_fragments_with_the_fix():
    with pytest.raises(ValueError, match="at most that many fragments"):
        FragmentPlan.of_state(_state(), 7)
    with pytest.raises(ValueError, match=">= 1"):
        FragmentPlan.of_state(_state(), 0)
    assert FragmentPlan.of_state(_state(), 1).fragments == (tuple(_state().params),)


def test_the_fragment_outer_step_is_the_outer_step_on_its_tensors_and_leaves_the_rest_alone():
    state = _state(epoch=4)
    plan = FragmentPlan.of_state(state, 3)
    names = plan.names(state.epoch)
    gen = torch.Generator().manual_seed(1)
    avg = [torch.randn(state.params[n].shape, generator=gen) for n in names]
    new = fragment_outer_step(state, names, avg, 0.7, 0.9)
    whole = outer_step(
        state, [avg[names.index(n)] if n in names else torch.zeros_like(t) for n, t in state.params.items()], 0.7, 0.9
    )
    assert new.epoch == 5 and list(new.params) == list(state.params)
    for n in state.params:
        if n in names:  # bit for bit DiLoCo's outer step
            assert torch.equal(new.params[n], whole.params[n]) and torch.equal(new.momentum[n], whole.momentum[n])
        else:  # untouched: not even the momentum decays (a zero Δ̄ through outer_step would move θ by μ·m)
            assert new.params[n] is state.params[n] and new.momentum[n] is state.momentum[n]
    other = next(n for n in state.params if n not in names)
    assert not torch.equal(whole.params[other], state.params[other])  # what the whole-model step would have done
    with pytest.raises(ValueError, match="expected"):
        fragment_outer_step(state, names, avg[:-1], 0.7, 0.9)
    with pytest.raises(ValueError, match="not finite"):
        fragment_outer_step(state, names, [torch.full_like(t, float("nan")) for t in avg], 0.7, 0.9)


def test_the_fragment_pseudo_gradient_and_the_merge():
    state = _state()
    model = Model(state)
    names = ("a.w", "head")
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.5)
    deltas = fragment_pseudo_gradient(state, model, names)
    assert [d.shape for d in deltas] == [state.params[n].shape for n in names]
    assert all(torch.allclose(d, torch.full_like(d, -0.5)) for d in deltas)
    local = dict(model.named_parameters())
    merge_fragment(model, state, names, alpha=0.5)  # half way back to the shared θ
    assert torch.allclose(local["a.w"], state.params["a.w"] + 0.25)
    assert torch.allclose(local["b.w"], state.params["b.w"] + 0.5)  # not in the fragment: untouched
    merge_fragment(model, state, names, alpha=0.0)
    assert torch.equal(local["head"], state.params["head"])
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        merge_fragment(model, state, names, alpha=1.0)
    with torch.no_grad():
        local["head"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        fragment_pseudo_gradient(state, model, names)
