"""Inner steps in mixed precision and with gradient accumulation (``diloco/inner.py``), tested on the CPU.

The bf16 path is the one CUDA peers take ("auto" on a GPU with native bf16); CPU autocast runs it here. The fp16 path
(CUDA only in production) is driven on the CPU by giving the optimizer a CPU gradient scaler, to check that skipped
steps are counted and change nothing.
"""

import itertools

import pytest
import torch

from hivetrain.averaging.config import AveragingConfig
from hivetrain.config import RunConfig
from hivetrain.data.config import DataConfig
from hivetrain.diloco.config import DilocoConfig
from hivetrain.diloco.inner import InnerOptimizer, Precision, lr_multiplier, resolve_precision
from hivetrain.diloco.outer import pseudo_gradient
from hivetrain.diloco.state import TrainingState
from hivetrain.model import build_config, build_model, lm_loss

T = 32  # tokens per window


def tiny_model():
    return build_model(build_config("tiny", max_seq_len=T + 1), seed=0)


def text_windows(num_windows: int, seed: int = 0) -> torch.Tensor:
    """(num_windows, T+1) int64 byte windows of a repetitive English text (learnable in a few steps)."""
    text = b"the quick brown fox jumps over the lazy dog; a stitch in time saves nine. " * 40
    data = torch.tensor(list(text), dtype=torch.long)
    starts = torch.randint(0, len(data) - T - 1, (num_windows,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([data[s : s + T + 1] for s in starts.tolist()])


def stream(batch_size: int, seed: int = 0):
    """Endless (batch_size, T+1) microbatches, the same sequence for the same seed."""
    windows = text_windows(batch_size * 200, seed)
    return (windows[i * batch_size : (i + 1) * batch_size] for i in itertools.cycle(range(200)))


def test_bf16_inner_steps_on_cpu_learn_and_keep_parameters_adamw_state_and_pseudo_gradient_fp32():
    model = tiny_model()
    start = TrainingState.from_model(model)
    inner = InnerOptimizer(model, DilocoConfig(precision="bf16", warmup_steps=2, inner_lr=3e-3))
    assert inner.precision == Precision("bf16", "cpu", torch.bfloat16, False) and inner.scaler is None
    seen = set()
    model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: seen.add(out.dtype))
    losses, grads = [], set()

    def on_step(i: int, loss: float) -> None:
        losses.append(loss)
        grads.update(p.grad.dtype for p in model.parameters())  # the step's gradients, before the next one

    result = inner.run(stream(8), 0, 20, on_step=on_step)
    assert seen == {torch.bfloat16}  # the matmuls ran under bf16 autocast
    assert result.num_steps == 20 and result.num_samples == 160 and result.num_skipped_steps == 0
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.0, losses  # ln(256) = 5.5 nats at the start
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert grads == {torch.float32}
    adam = [t for s in inner.optimizer.state.values() for t in (s["exp_avg"], s["exp_avg_sq"])]
    assert len(adam) == 2 * len(list(model.parameters())) and all(t.dtype == torch.float32 for t in adam)
    deltas = pseudo_gradient(start, model)
    assert all(d.dtype == torch.float32 and d.device.type == "cpu" for d in deltas)
    assert sum(float(d.norm()) for d in deltas) > 0
    assert all(t.dtype == torch.float32 for t in TrainingState.from_model(model).params.values())


def reference_inner_steps(model, config: DilocoConfig, batches, num_steps: int) -> list[float]:
    """The inner loop as it was before mixed precision and accumulation: fp32, one batch per AdamW step."""
    opt = torch.optim.AdamW(model.parameters(), lr=config.inner_lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    losses = []
    for i in range(num_steps):
        for group in opt.param_groups:
            group["lr"] = config.inner_lr * lr_multiplier(i, config)
        loss = lm_loss(model, next(batches))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("precision", ["auto", "fp32"])
def test_default_and_fp32_inner_steps_on_cpu_are_bit_identical_to_the_plain_fp32_loop(precision):
    config = DilocoConfig(precision=precision, warmup_steps=2)
    assert DilocoConfig().precision == "auto" and DilocoConfig().grad_accum_steps == 1
    reference, model = tiny_model(), tiny_model()
    expected = reference_inner_steps(reference, config, stream(4), 5)
    inner = InnerOptimizer(model, config)
    assert inner.precision.autocast_dtype is None and inner.scaler is None
    losses = []
    inner.run(stream(4), 0, 5, on_step=lambda i, loss: losses.append(loss))
    assert losses == expected
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=False):
        assert torch.equal(p, q), name


def test_k_microbatches_of_b_windows_give_the_gradient_of_one_batch_of_k_times_b_windows():
    k, b = 3, 2
    windows = text_windows(k * b, seed=1)
    config = DilocoConfig(grad_accum_steps=k, grad_clip=0.0, precision="fp32")
    accum_model, big_model = tiny_model(), tiny_model()
    accum_result = InnerOptimizer(accum_model, config).run(iter(windows.split(b)), 0, 1)
    big_result = InnerOptimizer(big_model, DilocoConfig(grad_clip=0.0, precision="fp32")).run(iter([windows]), 0, 1)
    # the step's gradient stays in .grad until the next step zeroes it
    for (name, p), q in zip(accum_model.named_parameters(), big_model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert abs(accum_result.mean_loss - big_result.mean_loss) < 1e-5
    assert accum_result.num_samples == big_result.num_samples == k * b
    assert accum_result.num_tokens == big_result.num_tokens == k * b * T


def test_each_inner_step_draws_k_microbatches_and_the_schedule_sees_all_their_samples():
    drawn, calls = [], []

    def counted():
        for batch in stream(2):
            drawn.append(batch)
            yield batch

    inner = InnerOptimizer(tiny_model(), DilocoConfig(grad_accum_steps=4, precision="fp32"))
    result = inner.run(counted(), 0, 10, should_end=lambda steps, samples: calls.append((steps, samples)) or steps == 3)
    assert calls == [(1, 8), (2, 16), (3, 24)] and len(drawn) == 12
    assert result.num_samples == 24 and result.num_steps == 3 and result.num_tokens == 24 * T


def test_skipped_fp16_steps_are_counted_and_change_no_parameter():
    """fp16 with a loss scale far too large: the scaled gradients overflow, the scaler skips the AdamW step and backs
    off. (Production runs fp16 on CUDA only; here the same loop runs under CPU autocast with a CPU scaler.)"""
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    inner = InnerOptimizer(model, DilocoConfig(precision="fp32", warmup_steps=0))
    inner.precision = Precision("fp16", "cpu", torch.float16, True)
    inner.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)  # inf as soon as the loss is scaled
    result = inner.run(stream(2), 0, 2)
    assert result.num_steps == 2 and result.num_skipped_steps == 2 and inner.num_skipped_steps == 2
    assert result.num_samples == 4  # the schedule counted them; the skip is reported, not hidden
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=False))
    assert inner.scaler.get_scale() == 2.0**98
    inner.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    result = inner.run(stream(2, seed=1), 2, 3)
    assert result.num_skipped_steps == 0 and inner.num_skipped_steps == 2
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=False))
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_precision_per_device():
    assert resolve_precision("auto", "cpu", native_bf16=False) == Precision("fp32", "cpu", None, False)
    assert resolve_precision("auto", "cuda", native_bf16=True) == Precision("bf16", "cuda", torch.bfloat16, False)
    assert resolve_precision("auto", "cuda", native_bf16=False) == Precision("fp16", "cuda", torch.float16, True)
    assert resolve_precision("fp16", "cuda", native_bf16=True).use_grad_scaler
    assert resolve_precision("fp32", "cuda", native_bf16=True).autocast_dtype is None
    assert resolve_precision("bf16", "cpu", native_bf16=False).autocast_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="compute capability below 8.0.*'auto'"):
        resolve_precision("bf16", "cuda", native_bf16=False)


def test_fp16_on_a_cpu_peer_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="'fp16' needs a CUDA GPU, but this peer trains on 'cpu': use 'auto'"):
        InnerOptimizer(tiny_model(), DilocoConfig(precision="fp16"))


def test_master_parameters_must_be_fp32():
    with pytest.raises(ValueError, match="is torch.bfloat16: inner steps keep fp32 master parameters"):
        InnerOptimizer(tiny_model().to(torch.bfloat16), DilocoConfig())


def test_config_fields_are_validated_and_the_claimed_weight_counts_every_microbatch():
    with pytest.raises(ValueError, match="diloco.precision"):
        RunConfig.from_dict({"diloco": {"precision": "fp8"}})
    with pytest.raises(ValueError, match="diloco.grad_accum_steps"):
        RunConfig.from_dict({"diloco": {"grad_accum_steps": 0}})
    config = DilocoConfig(inner_steps=10, grad_accum_steps=4)
    assert config.samples_per_inner_step(8) == 32
    RunConfig(data=DataConfig(batch_size=8), diloco=config, averaging=AveragingConfig(max_samples_per_round=320))
    with pytest.raises(ValueError, match=r"data.batch_size \* diloco.grad_accum_steps \(320\)"):
        RunConfig(data=DataConfig(batch_size=8), diloco=config, averaging=AveragingConfig(max_samples_per_round=319))
