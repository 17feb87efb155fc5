"""The inner step's speed path (issue 24, ``diloco/inner.py``): fused AdamW, deferred reads, torch.compile.

CUDA peers take this path by default; here the CPU drives it (fused AdamW and inductor both run on the CPU), so the
same code is tested without a GPU: what it computes, when it raises, and what it leaves untouched.
"""

import math

import pytest
import torch

from hivetrain.diloco.config import DilocoConfig
from hivetrain.diloco.inner import InnerOptimizer, resolve_compile
from tests.diloco.test_precision import T, stream, tiny_model

STEPS = 12


def run_steps(inner: InnerOptimizer, steps: int = STEPS, **kwargs):
    """(losses reported by on_step, (step index, loss) pairs in call order, the phase's result)."""
    calls = []
    result = inner.run(stream(8), 0, steps, on_step=lambda i, loss: calls.append((i, loss)), **kwargs)
    return [loss for _, loss in calls], calls, result


def test_deferred_reads_train_bit_for_bit_like_reading_every_step():
    """Reading a step's loss one step late changes when the host waits, not what is computed."""
    config = DilocoConfig(warmup_steps=2, inner_lr=3e-3)
    now_model, late_model = tiny_model(), tiny_model()
    now = InnerOptimizer(now_model, config, fused=True, deferred_reads=False)
    late = InnerOptimizer(late_model, config, fused=True, deferred_reads=True)
    assert not now.deferred_reads and late.deferred_reads
    now_losses, now_calls, now_result = run_steps(now)
    late_losses, late_calls, late_result = run_steps(late)
    assert late_calls == now_calls and [i for i, _ in late_calls] == list(range(STEPS))
    assert late_losses[-1] < late_losses[0] - 1.0  # it learns
    assert late_result.mean_loss == now_result.mean_loss and late_result.num_samples == now_result.num_samples
    for (name, a), b in zip(now_model.named_parameters(), late_model.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert not hasattr(late.optimizer, "found_inf")  # nothing of a deferred phase stays on the optimizer


def test_with_deferred_reads_the_schedule_counts_every_queued_step_and_no_step_runs_past_its_end():
    inner = InnerOptimizer(tiny_model(), DilocoConfig(), fused=True, deferred_reads=True)
    seen = []

    def should_end(num_steps: int, num_samples: int) -> bool:
        seen.append((num_steps, num_samples))
        return num_steps == 5

    _, calls, result = run_steps(inner, should_end=should_end)
    assert seen == [(k, 8 * k) for k in range(1, 6)]
    assert result.num_steps == 5 and result.num_samples == 40
    assert [i for i, _ in calls] == [0, 1, 2, 3, 4]  # the last step's loss is read before the phase returns


def poison_step(model, at_call: int):
    """Make the ``at_call``-th forward pass (0-based) return NaN logits."""
    calls = [0]

    def hook(module, args, out):
        calls[0] += 1
        return out * float("nan") if calls[0] - 1 == at_call else out

    model.model.norm.register_forward_hook(hook)


@pytest.mark.parametrize("deferred", [False, True])
def test_a_diverged_step_raises_and_changes_neither_parameters_nor_adamw_state(deferred):
    model = tiny_model()
    inner = InnerOptimizer(model, DilocoConfig(warmup_steps=2, inner_lr=3e-3), fused=True, deferred_reads=deferred)
    poison_step(model, at_call=4)
    calls = []
    with pytest.raises(FloatingPointError, match=r"inner step 4: loss is nan"):
        inner.run(stream(8), 0, STEPS, on_step=lambda i, loss: calls.append(i))
    assert calls == [0, 1, 2, 3]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    states = list(inner.optimizer.state.values())
    assert all(torch.isfinite(s["exp_avg"]).all() and torch.isfinite(s["exp_avg_sq"]).all() for s in states)
    # steps 0-3 applied; deferred: step 5 was queued before step 4's loss was read, and is applied, step 4 is not
    assert {float(s["step"]) for s in states} == {5.0 if deferred else 4.0}
    assert not hasattr(inner.optimizer, "found_inf")
    # the optimizer trains on after the diverged phase (the trainer reloads θ and runs the next one)
    losses, _, _ = run_steps(inner, steps=3)
    assert all(math.isfinite(loss) for loss in losses)


def test_cpu_defaults_keep_the_plain_path_and_cuda_defaults_take_the_fast_one():
    inner = InnerOptimizer(tiny_model(), DilocoConfig())
    assert not inner.fused and not inner.deferred_reads and not inner.compiled
    assert inner.optimizer.defaults["fused"] is None
    assert resolve_compile("auto", "cuda") and not resolve_compile("auto", "cpu")
    assert resolve_compile("on", "cpu") and not resolve_compile("off", "cuda")
    with pytest.raises(ValueError, match="diloco.compile"):
        resolve_compile("yes", "cpu")
    with pytest.raises(ValueError, match="fused"):
        InnerOptimizer(tiny_model(), DilocoConfig(), fused=False, deferred_reads=True)
    node_inner = InnerOptimizer(tiny_model(), DilocoConfig(), fused=True, deferred_reads=True)
    node_inner.agree_finite = lambda finite: finite  # a multi-rank node agrees on every microbatch, before backward
    assert not node_inner.deferred_reads
    with pytest.raises(ValueError):
        DilocoConfig(compile="sometimes")


def failing_compile(batch):
    raise RuntimeError("InductorError: CppCompileError: C++ compile error\ncommand: g++ ...")


def test_compile_on_where_torch_compile_fails_stops_the_peer_with_the_cause_and_the_fix():
    inner = InnerOptimizer(tiny_model(), DilocoConfig(compile="on"))
    assert inner.compiled
    inner._loss = failing_compile  # what inductor raises on a machine without a working C++ compiler
    with pytest.raises(ValueError, match=r"diloco.compile = 'on'.*CppCompileError.*'off'"):
        inner.warm_up(8, 32)


def test_compile_auto_falls_back_to_eager_steps_when_torch_compile_fails(caplog):
    model = tiny_model()
    inner = InnerOptimizer(model, DilocoConfig(compile="auto"))
    inner.compiled, inner._loss = True, failing_compile  # "auto" compiles on CUDA: here, as if on a GPU
    with caplog.at_level("WARNING"):
        inner.warm_up(8, 32)
    assert not inner.compiled and "torch.compile failed" in caplog.text
    before = [p.detach().clone() for p in model.parameters()]
    losses, _, _ = run_steps(inner, steps=3)
    assert len(losses) == 3 and all(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())  # freed at the phase's end (the round needs the memory)


@pytest.mark.slow
def test_a_compiled_inner_step_trains_like_the_eager_one_and_warm_up_changes_nothing():
    """inductor on the CPU (its first compile of the tiny model takes ~30 s here, a few with its cache warm)."""
    config = DilocoConfig(warmup_steps=2, inner_lr=3e-3, compile="on")
    eager_model, compiled_model = tiny_model(), tiny_model()
    eager = InnerOptimizer(eager_model, DilocoConfig(warmup_steps=2, inner_lr=3e-3))
    compiled = InnerOptimizer(compiled_model, config)
    before = {name: p.detach().clone() for name, p in compiled_model.named_parameters()}
    rng = torch.get_rng_state()
    assert compiled.warm_up(8, 32) > 0 and compiled.compiled
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(p, before[name]) for name, p in compiled_model.named_parameters())
    assert all(p.grad is None for p in compiled_model.parameters()) and not compiled.optimizer.state
    eager_losses, _, _ = run_steps(eager, steps=20)
    compiled_losses, _, _ = run_steps(compiled, steps=20)
    assert compiled_losses[-1] < compiled_losses[0] - 1.0
    # fp32 on both sides; inductor fuses and reorders float operations, so the curves agree closely, not exactly
    assert max(abs(a - b) for a, b in zip(eager_losses, compiled_losses, strict=True)) < 0.02, (
        eager_losses,
        compiled_losses,
    )


def test_the_first_phase_on_cuda_compares_the_preflights_estimate_with_the_measured_peak(monkeypatch):
    """Issue 24 item 3: the preflight's estimate vs measured peak memory, logged and in the peer's summary. The CPU
    measures no device peak (the host's memory is the whole process's): nothing is compared there; the CUDA branch is
    driven here with a stand-in for ``torch.cuda.max_memory_allocated``."""
    from hivetrain.cli.join_swarm import _memory_figures
    from hivetrain.model import count_parameters
    from hivetrain.preflight import estimate_memory

    model = tiny_model()
    inner = InnerOptimizer(model, DilocoConfig(precision="bf16"))
    run_steps(inner, steps=2)
    assert inner.memory is None  # CPU: nothing measured
    estimated = estimate_memory(count_parameters(model), model.config, microbatch=8, seq_len=T, device_type="cuda",
                                half_precision=True).device_bytes  # fmt: skip
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: int(estimated * 1.1))
    inner._check_memory(torch.device("cuda"), microbatch=8, seq_len=T)
    assert inner.memory.estimated_bytes == estimated and inner.memory.ratio == pytest.approx(1.1, rel=1e-6)
    assert "+10%" in inner.memory.reason and "measured peak" in inner.memory.reason
    trainer = type("Trainer", (), {"phases": type("Phases", (), {"inner": inner})()})()
    figures = _memory_figures(trainer)
    assert figures["preflight_device_bytes"] == estimated and figures["peak_device_bytes"] == int(estimated * 1.1)
    assert set(_memory_figures(None)) == {"peak_rss_bytes"} and figures["peak_rss_bytes"] > 50 * 2**20
