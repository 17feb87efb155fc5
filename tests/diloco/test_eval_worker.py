"""Evaluation off the critical path (``diloco/eval_worker.py``): a thread evaluating submitted states on a replica."""

import threading

import pytest
import torch

from hivetrain.diloco.eval_worker import BackgroundEval, resolve_eval_overlap
from hivetrain.diloco.state import TrainingState
from hivetrain.model import build_config, build_model, evaluate

T = 16


def _model():
    return build_model(build_config("tiny", max_seq_len=T + 1), seed=0)


def _windows() -> torch.Tensor:
    return torch.randint(0, 256, (12, T + 1), generator=torch.Generator().manual_seed(3))


def _state(model, epoch: int, scale: float) -> TrainingState:
    state = TrainingState.from_model(model)
    params = {n: p * scale for n, p in state.params.items()}
    return TrainingState(epoch=epoch, params=params, momentum=state.momentum)


def test_resolve_eval_overlap():
    assert resolve_eval_overlap("auto", "cuda", sharded=False) is True
    assert resolve_eval_overlap("auto", "cpu", sharded=False) is False
    assert resolve_eval_overlap("on", "cpu", sharded=False) is True
    assert resolve_eval_overlap("on", "cuda", sharded=True) is False  # an FSDP node evaluates with every rank
    assert resolve_eval_overlap("off", "cuda", sharded=False) is False
    with pytest.raises(ValueError, match="eval_overlap"):
        resolve_eval_overlap("sometimes", "cpu", sharded=False)


def test_each_submitted_state_is_evaluated_on_the_replica_and_the_model_is_untouched():
    model, windows = _model(), _windows()
    before = [p.detach().clone() for p in model.parameters()]
    worker = BackgroundEval(model, evaluate, windows)
    states = [_state(model, epoch, scale) for epoch, scale in ((1, 1.0), (2, 0.5))]
    expected = []
    for state in states:
        reference = _model()
        with torch.no_grad():
            for n, p in reference.named_parameters():
                p.copy_(state.params[n])
        expected.append(evaluate(reference, windows))
    results = []
    for k, state in enumerate(states):
        assert worker.submit(state)
        for _ in range(600):  # wait for its result: the next submission would otherwise replace it (tested below)
            results += worker.drain()
            if len(results) > k:
                break
            threading.Event().wait(0.05)
    results += worker.close(timeout_s=30)
    assert [(r.epoch, r.loss) for r in results] == [(1, expected[0]), (2, expected[1])]
    assert all(r.seconds > 0 for r in results)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not worker.submit(states[0])  # closed: the caller evaluates itself


def test_a_newer_state_replaces_a_waiting_one_and_a_failure_hands_evaluation_back():
    model, windows = _model(), _windows()
    gate = threading.Event()
    calls = []

    def slow_evaluate(m, w):
        calls.append(1)
        gate.wait(10)
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory (the replica)")
        return 1.0

    worker = BackgroundEval(model, slow_evaluate, windows)
    assert worker.submit(_state(model, 1, 1.0))  # runs, blocked on the gate
    for _ in range(200):
        if calls:
            break
        threading.Event().wait(0.02)
    assert worker.submit(_state(model, 2, 1.0))  # waits
    assert worker.submit(_state(model, 3, 1.0))  # replaces epoch 2
    assert worker.skipped == 1
    gate.set()
    for _ in range(400):
        if worker.failed is not None:
            break
        threading.Event().wait(0.02)
    assert worker.failed and "out of memory" in worker.failed  # epoch 3's evaluation raised
    assert [r.epoch for r in worker.drain()] == [1]
    assert not worker.submit(_state(model, 4, 1.0))  # the trainer evaluates on its own thread from now on
    worker.close(timeout_s=5)


def test_auto_on_a_gpu_runs_in_the_background_only_with_room_for_the_replica(monkeypatch):
    import hivetrain.preflight as preflight
    from hivetrain.config import RunConfig
    from hivetrain.diloco.builder import eval_in_background
    from hivetrain.model import describe_run_model

    config = RunConfig.from_dict({"model": "small", "data": {"seq_len": 128, "batch_size": 8}})
    model_config, n = describe_run_model(config, 256)
    estimate = preflight.estimate_memory(
        n, model_config, microbatch=8, seq_len=128, device_type="cuda", half_precision=True
    )
    need = estimate.device_bytes * preflight.DEFAULT_MARGIN
    cuda = torch.device("cuda")

    def free(device_bytes):
        monkeypatch.setattr(preflight, "free_memory", lambda device: (int(device_bytes), 64 * 2**30))

    # the replica and one evaluation's logits (16 windows of 128 tokens, fp32 twice) and a layer's activations
    h, i = model_config.hidden_size, model_config.intermediate_size
    replica = (4 * n + 16 * 128 * (8 * 256 + 4 * (4 * h + 3 * i))) * preflight.DEFAULT_MARGIN
    free(need + replica + 2**20)  # room for training and the replica
    assert eval_in_background(config, 256, cuda, None, True, None)
    free(need + replica - 2**20)  # not quite: the replica would need activation checkpointing or more
    assert not eval_in_background(config, 256, cuda, None, True, None)
    assert not eval_in_background(config, 256, cuda, None, False, None)  # --skip-memory-check: no figure to go by
    assert not eval_in_background(config, 256, torch.device("cpu"), None, True, None)  # auto: a CPU evaluates inline
    on = RunConfig.from_dict({"model": "small", "diloco": {"eval_overlap": "on"}})
    assert eval_in_background(on, 256, torch.device("cpu"), None, True, None)
