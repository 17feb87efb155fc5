"""A carried contribution is a correct update (issue 22): phases carried at one epoch start from the same θ, so their
merge is the sample-weighted mean Δ (weight: their summed samples), and at most ``diloco.max_carried_phases`` ride.

Issue 22's run: two peers failed to meet for six phases; each failed round carried the pseudo-gradient, the six Δ
were summed (19,200 samples) and applied with outer lr 1, and the eval loss went from 5.54 to 55."""

from types import SimpleNamespace

import pytest
import torch

from hivetrain.config import RunConfig
from hivetrain.diloco.outer import outer_step
from hivetrain.diloco.rounds import Contribution, carry
from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.trainer import DilocoTrainer
from hivetrain.diloco.update_bound import l2_norm

SHAPES = {"w": (64, 16), "b": (16,)}
SAMPLES = [3200, 3100, 3300, 3200, 2900, 3500]  # six phases of about 3,200 samples: issue 22's 19,200


def _theta() -> TrainingState:
    g = torch.Generator().manual_seed(0)
    params = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    momentum = {n: 0.01 * torch.randn(s, generator=g) for n, s in SHAPES.items()}
    return TrainingState(epoch=7, params=params, momentum=momentum)


def _phases() -> list[Contribution]:
    """Six pseudo-gradients from the same θ: one update's signal plus each phase's own noise."""
    g = torch.Generator().manual_seed(1)
    signal = [0.05 * torch.randn(s, generator=g) for s in SHAPES.values()]
    return [
        Contribution([d + 0.02 * torch.randn(d.shape, generator=g) for d in signal], samples, epoch=7)
        for samples in SAMPLES
    ]


def _weighted_mean(phases: list[Contribution]) -> list[torch.Tensor]:
    total = sum(p.samples for p in phases)
    return [(sum(p.samples * p.delta[k].double() for p in phases) / total).float() for k in range(len(phases[0].delta))]


def _carry_all(phases: list[Contribution], max_phases: int) -> tuple[Contribution, int, list[str]]:
    """Merge the phases one at a time, as the trainer does at the end of each phase after a failed round."""
    pending, dropped, reasons = None, 0, []
    for fresh in phases:
        pending, num, why = carry(pending, fresh, max_phases=max_phases, max_samples=1_000_000)
        dropped += num
        reasons += [why] if why else []
    assert pending is not None
    return pending, dropped, reasons


@pytest.mark.parametrize(("lr", "momentum"), [(1.0, 0.0), (0.7, 0.9)])
def test_six_carried_phases_apply_the_step_of_their_weighted_mean(lr: float, momentum: float):
    theta, phases = _theta(), _phases()
    merged, dropped, _ = _carry_all(phases, max_phases=6)
    assert dropped == 0 and merged.samples == sum(SAMPLES) == 19_200 and merged.epoch == 7
    applied = outer_step(theta, merged.delta, lr, momentum)
    expected = outer_step(theta, _weighted_mean(phases), lr, momentum)
    for name in SHAPES:
        torch.testing.assert_close(applied.params[name], expected.params[name])
        torch.testing.assert_close(applied.momentum[name], expected.momentum[name])
    # the step is one phase's size, not six: issue 22's sum moved θ ~6x as far
    step = l2_norm([applied.params[n] - theta.params[n] for n in SHAPES])
    one = l2_norm([outer_step(theta, phases[0].delta, lr, momentum).params[n] - theta.params[n] for n in SHAPES])
    summed = [sum(p.delta[k] for p in phases) for k in range(len(SHAPES))]
    assert step < 1.2 * one and l2_norm(summed) > 5 * l2_norm(merged.delta)


def test_past_max_carried_phases_the_oldest_phases_are_dropped_and_counted():
    theta, phases = _theta(), _phases()
    merged, dropped, reasons = _carry_all(phases, max_phases=4)
    assert dropped == SAMPLES[0] + SAMPLES[1] and merged.samples == sum(SAMPLES[2:])
    assert merged.phases == tuple(phases[2:])
    assert reasons == ["the oldest 1 of 4 carried phase(s) dropped: 5 phases exceed diloco.max_carried_phases (4)"] * 2
    applied = outer_step(theta, merged.delta, 1.0, 0.0)
    expected = outer_step(theta, _weighted_mean(phases[2:]), 1.0, 0.0)
    for name in SHAPES:
        torch.testing.assert_close(applied.params[name], expected.params[name])


def test_the_trainer_counts_the_dropped_phases_as_discarded_with_the_reason():
    discarded = []
    config = RunConfig.from_dict({"diloco": {"max_carried_phases": 2}})
    report = SimpleNamespace(discard=lambda samples, why: discarded.append((samples, why)))
    trainer = SimpleNamespace(config=config, report=report)
    pending = None
    for fresh in _phases()[:3]:
        pending = DilocoTrainer._carry(trainer, pending, fresh)
    assert pending.samples == SAMPLES[1] + SAMPLES[2] and len(pending.phases) == 2
    (samples, why), *more = [d for d in discarded if d[0] > 0]
    assert samples == SAMPLES[0] and not more
    assert why == "the oldest 1 of 2 carried phase(s) dropped: 3 phases exceed diloco.max_carried_phases (2)"


@pytest.mark.parametrize("fragments", [False, True])
def test_a_round_that_did_not_commit_is_reported_carried_in_both_modes(fragments):
    """Whole-model rounds carry the contribution into the next one (merged); with fragments it stays in the local
    copy, and with a round in flight next (overlap) our epoch's fragment is measured anew. Both say so in a
    ``contribution_carried`` event (the chaos harness reads it); a stop discards it instead."""
    from hivetrain.diloco.round_policy import RoundPolicy
    from hivetrain.diloco.rounds import RoundOutcome

    events, discarded = [], []
    state = _theta()
    fresh = Contribution([torch.zeros(4)], 10, state.epoch, new_samples=10)
    local = SimpleNamespace(fragments=fragments, pseudo_gradient=lambda start, epoch, n: ([torch.ones(2)], 30))
    report = SimpleNamespace(
        emit=lambda event, **fields: events.append((event, fields)), discard=lambda n, why: discarded.append(n)
    )
    trainer = SimpleNamespace(
        config=RunConfig.from_dict({}), rounds=SimpleNamespace(rounds_failed=1, last_failure="x"),
        stats=SimpleNamespace(), report=report, local=local, state=state, _pending=None,
        _overlap="delayed" if fragments else "off",
    )  # fmt: skip
    trainer._carry = lambda older, newer, staleness=0: DilocoTrainer._carry(trainer, older, newer, staleness)
    action = DilocoTrainer._apply(trainer, RoundOutcome(RoundPolicy("carry", "nobody committed"), 1), fresh)
    assert action == "carry" and [e for e, _ in events] == ["contribution_carried"] and not discarded
    if fragments:  # our epoch's round again, with the fragment's Δ measured anew (weight: every phase since)
        assert trainer._pending.samples == 30 and trainer._pending.counted == 0
    else:
        assert trainer._pending is fresh
    DilocoTrainer._apply(trainer, RoundOutcome(RoundPolicy("stop", "stopping"), 1), fresh)
    assert discarded == [10] and len(events) == 1
