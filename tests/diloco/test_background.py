"""BackgroundRound: the round in flight under overlap (fake round runner: no network)."""

import threading

import pytest
import torch

from hivetrain.averaging.base import RoundResult
from hivetrain.diloco.background import BackgroundRound
from hivetrain.diloco.outer import outer_step
from hivetrain.diloco.overlap import eager_estimate
from hivetrain.diloco.round_policy import RoundPolicy
from hivetrain.diloco.rounds import Contribution, RoundOutcome
from hivetrain.diloco.state import TrainingState

LR, MU = 0.7, 0.5


def state(epoch=3) -> TrainingState:
    g = torch.Generator().manual_seed(epoch)
    params = {"w": torch.randn(4, generator=g)}
    return TrainingState(epoch=epoch, params=params, momentum={"w": torch.zeros(4)})


class FakeRounds:
    """Blocks until ``release`` is set, then commits ``average`` (or fails with ``action``)."""

    def __init__(self, action="apply", average=None, total_weight=30.0):
        self.action, self.average, self.total_weight = action, average, total_weight
        self.release = threading.Event()

    def run(self, base, base_hash, contribution):
        assert self.release.wait(10)
        if self.action != "apply":
            return RoundOutcome(RoundPolicy(self.action, "test"), attempts=1)
        average = self.average or contribution.delta
        result = RoundResult(list(average), ("a", "b"), self.total_weight, "r")
        new = outer_step(base, average, LR, MU)
        return RoundOutcome(RoundPolicy("apply", "ok"), 1, new, new.state_hash(), result, list(contribution.delta))


def contribution(value=0.1, samples=10, epoch=3) -> Contribution:
    return Contribution([torch.full((4,), value)], samples, epoch)


def test_a_committed_round_reaches_the_trainer_before_settle_returns_and_eager_remembers_it():
    rounds = FakeRounds(average=[torch.full((4,), 0.2)])
    committed = []
    bg = BackgroundRound(rounds, "eager", LR, MU, committed.append)
    base = state()
    bg.launch(base, base.state_hash(), contribution())
    assert bg.in_flight and bg.base_epoch == 3
    start = bg.start_state(base)  # no previous round: our own Δ stands in for the average
    expected = outer_step(base, eager_estimate([torch.full((4,), 0.1)], None), LR, MU)
    assert torch.equal(start.params["w"], expected.params["w"]) and start.epoch == 3
    rounds.release.set()
    outcome, sent = bg.settle()
    assert outcome.policy.action == "apply" and committed == [outcome] and sent.samples == 10 and not bg.in_flight
    bg.remember(outcome, sent)
    # the next estimate: previous average 0.2 with our share (10/30) of it replaced by our new Δ 0.4
    bg.launch(outcome.state, outcome.state_hash, contribution(0.4, epoch=4))
    start = bg.start_state(outcome.state)
    estimate = 0.2 + (10 / 30) * (0.4 - 0.1)
    expected = outer_step(outcome.state, [torch.full((4,), estimate)], LR, MU)
    torch.testing.assert_close(start.params["w"], expected.params["w"])
    assert bg.start_state(state(9)).epoch == 9  # once the round committed, the new shared state is the start
    rounds.release.set()
    bg.settle()


def test_a_failed_round_applies_nothing_and_hands_its_contribution_back():
    rounds = FakeRounds(action="carry")
    committed = []
    bg = BackgroundRound(rounds, "delayed", LR, MU, committed.append)
    base = state()
    bg.launch(base, base.state_hash(), contribution())
    assert torch.equal(bg.start_state(base).params["w"], base.params["w"])  # delayed: the shared θ
    rounds.release.set()
    outcome, sent = bg.settle()
    assert outcome.policy.action == "carry" and outcome.state is None and committed == [] and sent.samples == 10


def test_abandon_does_not_wait_for_a_round_still_running():
    rounds = FakeRounds()
    bg = BackgroundRound(rounds, "eager", LR, MU, lambda outcome: None)
    assert bg.abandon() == (None, None)
    base = state()
    bg.launch(base, base.state_hash(), contribution())
    outcome, sent = bg.abandon()
    assert outcome is None and sent.samples == 10 and not bg.in_flight
    rounds.release.set()


def test_a_round_that_raises_raises_in_settle():
    class Broken:
        def run(self, *args):
            raise RuntimeError("daemon died")

    bg = BackgroundRound(Broken(), "eager", LR, MU, lambda outcome: None)
    base = state()
    bg.launch(base, base.state_hash(), contribution())
    with pytest.raises(RuntimeError, match="daemon died"):
        bg.settle()
