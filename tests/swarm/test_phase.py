"""One owner for a stage server's state: the phase record replaced in one step, the status changed by one locked
transition table (no sleeps: the race is driven transition by transition)."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch

from hivetrain.diloco.state import TrainingState
from hivetrain.model import build_config
from hivetrain.swarm.phase import ServerStatus, StagePhase, next_status
from hivetrain.swarm.process import describe_model
from hivetrain.swarm.runtime import StageRuntime
from hivetrain.swarm.server import StageServer, StatusRefused
from hivetrain.swarm.stages import build_stage, plan_stages

from .conftest import TEST_RUN, TEST_SWARM
from .test_stage_training import DILOCO, SWARM

H = 4


def test_phase_record_counts_and_every_new_phase_starts_from_its_epoch():
    phase = StagePhase.first(epoch=3, inner_steps=H)
    assert phase == StagePhase(window=0, inner_step=12, num_inner_steps=0, num_microbatches=0)
    phase = phase.with_microbatch().with_microbatch().with_inner_step()
    assert (phase.num_microbatches, phase.num_inner_steps, phase.inner_step) == (2, 1, 13)
    # committed (epoch 4) or abandoned (still epoch 3): the next window, counters zeroed, schedule from the epoch
    assert phase.next(epoch=4, inner_steps=H) == StagePhase(window=1, inner_step=16)
    assert phase.next(epoch=3, inner_steps=H) == StagePhase(window=1, inner_step=12)
    # a downloaded state rebases an open phase that took no inner step, keeping its microbatches
    fresh = StagePhase.first(3, H).with_microbatch()
    assert fresh.rebased(epoch=5, inner_steps=H) == StagePhase(window=0, inner_step=20, num_microbatches=1)
    with pytest.raises(AssertionError):
        phase.rebased(epoch=5, inner_steps=H)
    with pytest.raises(dataclasses.FrozenInstanceError):
        phase.window = 7  # type: ignore[misc]


def test_a_kept_phase_goes_on_and_backs_off_its_next_outer_step():
    phase = StagePhase.first(epoch=3, inner_steps=H).with_microbatch().with_inner_step()
    assert phase.retry_at(interval_s=1.0) == 0.0  # nothing failed: no backoff
    kept = phase.kept(now=100.0)
    assert (kept.window, kept.num_microbatches, kept.num_inner_steps, kept.inner_step) == (0, 1, 1, 13)
    assert kept.retry_at(interval_s=1.0) == 101.0
    again = kept.kept(now=200.0).kept(now=300.0)
    assert again.num_failed_outer_steps == 3 and again.retry_at(interval_s=0.5) == 300.0 + 0.5 * 4
    many = again
    for _ in range(10):
        many = many.kept(now=400.0)
    assert many.retry_at(interval_s=1.0) == 408.0  # capped at 8 intervals
    # the phase after it (committed or abandoned) starts afresh
    assert many.next(epoch=4, inner_steps=H) == StagePhase(window=1, inner_step=16)


def test_transition_table_refuses_a_move_while_syncing_and_a_sync_while_moving():
    assert next_status("joining", "serving")[0]
    assert next_status("serving", "syncing")[0] and next_status("syncing", "serving")[0]
    assert next_status("serving", "moving")[0] and next_status("moving", "serving")[0]
    allowed, reason = next_status("syncing", "moving")
    assert not allowed and "syncing" in reason
    allowed, reason = next_status("moving", "syncing")
    assert not allowed and "moving" in reason
    assert not next_status("serving", "serving")[0] and not next_status("joining", "moving")[0]


def test_the_end_of_an_outer_step_cannot_overwrite_a_move():
    """The race of issue 14 item 7: the maintenance thread starts a move, then the runtime worker reaches the end of a
    phase. Before, the worker set "syncing" and its ``finally`` set "serving" in the middle of the move."""
    status = ServerStatus("serving")
    assert status.transition("moving")[0]  # maintenance thread: move_to begins
    assert not status.transition("syncing")[0]  # runtime worker: the outer step is refused ...
    assert not status.leave("syncing", "serving")  # ... and its end changes nothing
    assert status.value == "moving"
    assert status.leave("moving", "serving") and status.value == "serving"  # the move ends

    # the other order: an outer step in progress refuses the move, which a later rebalance retries
    assert status.transition("syncing")[0]
    assert not status.transition("moving")[0]
    assert status.value == "syncing"
    assert status.leave("syncing", "serving") and status.transition("moving")[0]


def test_stage_server_refuses_an_outer_step_while_moving_and_a_move_while_syncing():
    model_config, fingerprint = describe_model(TEST_RUN)
    server = StageServer(None, TEST_RUN, TEST_SWARM, model_config, fingerprint, stage=1)  # never started: no I/O
    runtime = SimpleNamespace(spec=SimpleNamespace(index=1))
    server.runtime = runtime
    assert server._status.transition("serving")[0]

    assert server._status.transition("moving")[0]
    with pytest.raises(StatusRefused, match="moving"):
        server._outer_step(runtime, [])
    assert server.status == "moving"

    assert server._status.leave("moving", "serving") and server._status.transition("syncing")[0]
    assert server.move_to(2) is False  # refused before touching the runtime, the DHT or the network
    assert server.status == "syncing" and server.rebalances == 0


def test_requested_phase_end_takes_the_pending_inner_step_then_ends_the_phase():
    """With external phase ends (the stage's servers end together), a phase ends only on request; the request first
    applies the gradients accumulated since the last inner step, then commits (locally here: no averager)."""
    config = build_config("tiny", max_seq_len=32)
    stage = build_stage(config, plan_stages(config.num_hidden_layers, 3)[1], seed=0)
    rt = StageRuntime(
        stage, TrainingState.from_model(stage), SWARM, DILOCO, torch.device("cpu"), external_phase_end=True
    )
    try:
        gen = torch.Generator().manual_seed(0)
        for i in range(2 * DILOCO.inner_steps * SWARM.microbatches_per_inner_step + 1):  # H inner steps and one more
            x, g = torch.randn(2, 8, 128, generator=gen), torch.randn(2, 8, 128, generator=gen)
            rt.submit_backward(x, g, f"m{i}", time.time() + 30, accumulate=True, replay=False).result(30)
        assert rt.phase_record == StagePhase(window=0, inner_step=4, num_inner_steps=4, num_microbatches=9)
        assert rt.request_phase_end()
        rt.call(lambda: None, 30)  # the phase end was queued before this no-op
        assert rt.state.epoch == 1 and rt.phase_record == StagePhase(window=1, inner_step=DILOCO.inner_steps)
        assert rt.external_phase_end and rt.num_accumulated == 0
    finally:
        rt.shutdown()
