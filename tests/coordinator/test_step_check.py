"""The coordinator adopts a state only one bounded step from its own (issue 28: it followed 3 identities one epoch
ahead of 2 honest trainers and checkpointed random weights)."""

import pytest
import torch

from hivetrain.coordinator.follower import FollowerOptions, step_check
from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.update_bound import UpdateNorms


def state(epoch: int, theta: torch.Tensor) -> TrainingState:
    return TrainingState(epoch, {"w": theta.clone()}, {"w": torch.zeros_like(theta)})


def test_honest_steps_pass_and_random_weights_one_epoch_ahead_are_refused():
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(1000, generator=gen)
    steps, options = UpdateNorms(16), FollowerOptions(max_step_ratio=10.0, step_min_history=3)
    current = state(0, theta)
    for epoch in range(1, 6):  # honest steps of about 0.1 norm (0.05-0.15: the run's scale changes a little)
        step = torch.randn(1000, generator=gen) * (0.05 + 0.02 * epoch) / 1000**0.5
        new = state(epoch, current.params["w"] + step)
        ok, why = step_check(current, new, steps, options)
        assert ok, why
        current = new
    assert len(steps.history) == 5
    poison = state(6, torch.randn(1000, generator=gen) * 3.0)  # the attack: random weights x3, one epoch ahead
    ok, why = step_check(current, poison, steps, options)
    assert not ok and "per-epoch step to epoch 6" in why and "max_update_ratio" in why
    assert len(steps.history) == 5, "a refused step is not remembered"
    # a jump of several honest epochs at once is judged per epoch: 3 steps of the usual size pass
    far = state(8, current.params["w"] + 3 * 0.1 * torch.ones(1000) / 1000**0.5)
    assert step_check(current, far, steps, options)[0]


def test_without_history_the_first_steps_are_taken_and_the_bound_can_be_off():
    theta = torch.zeros(10)
    steps = UpdateNorms(4)
    assert step_check(state(0, theta), state(1, theta + 100.0), steps, FollowerOptions(step_min_history=3))[0]
    off = FollowerOptions(max_step_ratio=0.0, step_min_history=1)
    assert step_check(state(1, theta), state(2, theta + 1e6), UpdateNorms(4), off)[0]


def test_an_adoption_the_coordinator_cannot_check_is_named_and_the_run_start_is_not_one():
    from hivetrain.coordinator.follower import unchecked_adoption

    theta, options = torch.zeros(10), FollowerOptions(step_min_history=3)
    fresh = UpdateNorms(4)
    assert unchecked_adoption(state(0, theta), state(1, theta + 1), fresh, options) == ""  # the run's start
    fresh.add(1.0)
    assert unchecked_adoption(state(1, theta), state(2, theta + 1), fresh, options) == ""  # followed step by step
    restarted = unchecked_adoption(state(40, theta), state(41, theta + 1), UpdateNorms(4), options)
    assert "we hold epoch 40 but only 0 followed step(s)" in restarted
    assert "a fork resolved" in unchecked_adoption(state(5, theta), state(5, theta + 1), fresh, options)
    history = UpdateNorms(4)
    for norm in (1.0, 1.0, 1.0):
        history.add(norm)
    assert unchecked_adoption(state(40, theta), state(41, theta + 1), history, options) == ""


def test_the_checkpoint_before_an_unchecked_adoption_outlives_pruning(tmp_path):
    from hivetrain.coordinator.checkpoint import CheckpointStore

    store = CheckpointStore(tmp_path, keep_last=2)
    theta = torch.zeros(10)
    for epoch in (1, 2, 3):
        store.save(state(epoch, theta + epoch), {"run_id": "r"})
    store.protect(3, "epoch 4 adopted unchecked: a fork resolved")
    for epoch in (4, 5, 6, 7):
        store.save(state(epoch, theta + epoch), {"run_id": "r"})
    assert [c.epoch for c in store.list(verify=False)] == [7, 6, 3]
    assert store.protected() == (3, "epoch 4 adopted unchecked: a fork resolved")
    store.protect(6, "a restart")  # one protected checkpoint at a time: the older one is pruned like any other
    store.save(state(8, theta + 8), {"run_id": "r"})
    assert [c.epoch for c in store.list(verify=False)] == [8, 7, 6]
    with pytest.raises(ValueError, match="cannot protect epoch 1"):
        store.protect(1, "gone")
