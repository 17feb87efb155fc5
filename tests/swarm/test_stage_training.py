"""Per-stage DiLoCo in the stage runtime: inner steps, outer step through the averager, kept and abandoned phases,
dedup."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from hivetrain.averaging.base import RoundFailed, RoundResult
from hivetrain.diloco.config import DilocoConfig
from hivetrain.diloco.state import TrainingState
from hivetrain.model import build_config
from hivetrain.swarm.config import SwarmConfig
from hivetrain.swarm.runtime import StageRuntime, TaskExpired
from hivetrain.swarm.stages import build_stage, plan_stages

SWARM = SwarmConfig(microbatch_size=2, microbatches_per_inner_step=2, average_stage=True)
DILOCO = DilocoConfig(inner_steps=2, inner_lr=1e-2, warmup_steps=0, outer_lr=0.7, outer_momentum=0.9)


class FakeGroup:
    """An in-process stand-in for GroupAverager: the members of one round wait for each other and all get the same
    weighted mean (computed once), or all get RoundFailed."""

    def __init__(self, size: int, fail: bool = False):
        self.size, self.fail = size, fail
        self.barrier = threading.Barrier(size, timeout=30)
        self.inputs: list[tuple[list[torch.Tensor], float]] = []
        self.result: list[torch.Tensor] | None = None
        self.lock = threading.Lock()

    def average(self, tensors, weight, epoch, timeout_s) -> RoundResult:
        with self.lock:
            self.inputs.append(([t.clone() for t in tensors], weight))
        self.barrier.wait()
        if self.fail:
            raise RoundFailed("peer_failed", "test")
        with self.lock:
            if self.result is None:
                total = sum(w for _, w in self.inputs)
                self.result = [sum(ts[i] * (w / total) for ts, w in self.inputs) for i in range(len(self.inputs[0][0]))]
        return RoundResult(tensors=self.result, group=("a", "b"), total_weight=20.0, round_id="r")

    def shutdown(self, timeout_s: float = 5.0) -> None:
        pass


def _runtime(group: FakeGroup | None, seed: int = 0) -> StageRuntime:
    config = build_config("tiny", max_seq_len=32)
    stage = build_stage(config, plan_stages(config.num_hidden_layers, 3)[1], seed=seed)

    def on_phase_end(runtime, deltas):
        result = group.average(deltas, 2.0, runtime.state.epoch, 10.0)
        from hivetrain.diloco.outer import outer_step

        return outer_step(runtime.state, result.tensors, DILOCO.outer_lr, DILOCO.outer_momentum)

    return StageRuntime(
        stage,
        TrainingState.from_model(stage),
        SWARM,
        DILOCO,
        torch.device("cpu"),
        on_phase_end=on_phase_end if group else None,
    )


def _feed(runtime: StageRuntime, seed: int, count: int, tag: str) -> list:
    gen = torch.Generator().manual_seed(seed)
    results = []
    for i in range(count):
        x, g = torch.randn(2, 8, 128, generator=gen), torch.randn(2, 8, 128, generator=gen)
        future = runtime.submit_backward(x, g, f"{tag}{i}", time.time() + 30, accumulate=True, replay=False)
        results.append(future.result(timeout=30))
    return results


def test_stage_servers_commit_the_same_outer_step():
    group = FakeGroup(2)
    a, b = _runtime(group), _runtime(group)
    theta0 = {n: t.clone() for n, t in a.state.params.items()}
    try:
        done = [threading.Thread(target=_feed, args=(rt, seed, 4, f"m{seed}-")) for rt, seed in ((a, 1), (b, 2))]
        for thread in done:
            thread.start()
        for thread in done:
            thread.join(60)
        assert a.state.epoch == b.state.epoch == 1
        assert a.state.state_hash() == b.state.state_hash(), "replicas of a stage must be bit-identical after a commit"
        assert a.phase == 1 and not a.abandoned
        (delta_a, _), (delta_b, _) = group.inputs
        names = list(theta0)
        for i, name in enumerate(names):
            mean = 0.5 * delta_a[i] + 0.5 * delta_b[i]
            expected = theta0[name] - DILOCO.outer_lr * (mean + DILOCO.outer_momentum * mean)  # m0 = 0 -> m1 = mean
            torch.testing.assert_close(a.state.params[name], expected, atol=1e-6, rtol=0)
            torch.testing.assert_close(a.params[name].detach(), a.state.params[name], atol=0, rtol=0)
        assert any(not torch.equal(a.state.params[n], theta0[n]) for n in names)
    finally:
        a.shutdown()
        b.shutdown()


def test_failed_round_keeps_the_phase_and_the_next_outer_step_covers_all_of_it():
    """A round that failed all-or-nothing applied nothing anywhere: the phase goes on from θ_local (no replay for the
    trainers: same window, nothing abandoned) and the next outer step averages the pseudo-gradient of the whole,
    longer phase with all its microbatches as weight."""
    config = build_config("tiny", max_seq_len=32)
    stage = build_stage(config, plan_stages(config.num_hidden_layers, 3)[1], seed=0)
    seen: list[tuple[int, int, list[torch.Tensor]]] = []
    theta0 = TrainingState.from_model(stage)

    def on_phase_end(runtime, deltas):
        seen.append((runtime.phase_inner_steps, runtime.phase_microbatches, [d.clone() for d in deltas]))
        if len(seen) == 1:
            raise RoundFailed("peer_failed", "test")
        from hivetrain.diloco.outer import outer_step

        return outer_step(runtime.state, deltas, 1.0, 0.0)  # alone, plain averaging: θ <- θ_local

    rt = StageRuntime(stage, theta0, SWARM, DILOCO, torch.device("cpu"), on_phase_end=on_phase_end)
    try:
        results = _feed(rt, 3, 4, "m")
        assert len(seen) == 1 and rt.state.epoch == 0 and rt.phase == 0 and not rt.abandoned
        assert rt.phase_record.num_failed_outer_steps == 1
        assert any(not torch.equal(p.detach(), theta0.params[n]) for n, p in rt.params.items()), "θ_local is kept"
        results += _feed(rt, 4, 4, "n")  # H more inner steps, then the kept phase's next outer step
        assert [r.window for r in results] == [0] * 8, "every microbatch went into the one kept window"
        assert rt.state.epoch == 1 and rt.phase == 1 and not rt.abandoned
        assert [(steps, mbs) for steps, mbs, _ in seen] == [(2, 4), (4, 8)]
        for i, name in enumerate(theta0.params):  # the second pseudo-gradient spans both halves of the phase
            torch.testing.assert_close(theta0.params[name] - seen[1][2][i], rt.state.params[name], atol=1e-6, rtol=0)
        assert rt.phase_record.num_failed_outer_steps == 0
    finally:
        rt.shutdown()


def test_an_outer_step_refused_for_another_reason_abandons_the_phase_and_restores_theta():
    config = build_config("tiny", max_seq_len=32)
    stage = build_stage(config, plan_stages(config.num_hidden_layers, 3)[1], seed=0)

    def on_phase_end(runtime, deltas):
        raise RuntimeError("moving to another stage")

    rt = StageRuntime(
        stage, TrainingState.from_model(stage), SWARM, DILOCO, torch.device("cpu"), on_phase_end=on_phase_end
    )
    theta0 = rt.state.state_hash()
    try:
        results = _feed(rt, 3, 4, "m")
        assert [r.window for r in results] == [0, 0, 0, 0]
        assert rt.state.epoch == 0 and rt.state.state_hash() == theta0
        assert list(rt.abandoned) == [0] and rt.phase == 1  # trainers replay window 0
        assert all(torch.equal(p.detach(), rt.state.params[n]) for n, p in rt.params.items())
        grads, count = rt.accumulated_gradients()
        assert count == 0 and all(float(g.abs().sum()) == 0 for g in grads.values())
    finally:
        rt.shutdown()


def test_backward_is_idempotent_per_microbatch_and_expired_calls_accumulate_nothing():
    rt = _runtime(None)
    try:
        x, g = torch.randn(2, 8, 128), torch.randn(2, 8, 128)
        first = rt.submit_backward(x, g, "m0", time.time() + 30, True, False).result(30)
        again = rt.submit_backward(x, g, "m0", time.time() + 30, True, False).result(30)
        assert first.window == again.window == 0 and rt.num_accumulated == 1
        torch.testing.assert_close(first.grad_input, again.grad_input, atol=0, rtol=0)
        with pytest.raises(TaskExpired):
            rt.submit_backward(x, g, "m1", time.time() - 1, True, False).result(30)
        replay = rt.submit_backward(x, g, "m2", math.inf, True, True).result(30)
        assert replay.grad_input is None and rt.num_accumulated == 0 and rt.inner_step == 1  # 2 microbatches -> a step
        old = rt.incarnation
        rt.call(lambda: rt.reincarnate("test"), 10)
        assert rt.incarnation != old and rt.num_accumulated == 0 and rt.phase == 0
    finally:
        rt.shutdown()


def test_rerouted_calls_then_replays_run_before_queued_backward_and_forward_passes():
    rt = _runtime(None)
    try:
        gate, order = threading.Event(), []
        rt.submit_control(lambda: gate.wait(30))  # holds the worker while the queue fills
        x, g = torch.randn(2, 8, 128), torch.randn(2, 8, 128)
        futures = {
            "forward": rt.submit_forward(x, "f", time.time() + 30),
            "backward": rt.submit_backward(x, g, "b", time.time() + 30, accumulate=True, replay=False),
            "replay": rt.submit_backward(x, g, "r", time.time() + 30, accumulate=True, replay=True),
            "urgent": rt.submit_forward(x, "u", time.time() + 30, urgent=True),
        }
        for name, future in futures.items():
            future.add_done_callback(lambda _, name=name: order.append(name))
        gate.set()
        for future in futures.values():
            future.result(30)
        assert order == ["urgent", "replay", "backward", "forward"]
    finally:
        rt.shutdown()
