"""DiLoCo's inner phase: H AdamW steps with warmup, cosine decay, gradient clipping, mixed precision and microbatches.

Each peer keeps its own AdamW state across outer steps (Douillard et al. 2023, Sec. 2: inner optimizer state is local
to a worker). The learning-rate schedule follows the peer's inner-step count, which is derived from the epoch, so a
peer that downloads state resumes the schedule where the swarm is.

Precision (``DilocoConfig.precision``, resolved per device by ``resolve_precision``): the forward and backward passes
may run under ``torch.autocast`` (bf16, or fp16 with a ``torch.amp.GradScaler``), but the parameters, their gradients
and the AdamW state stay fp32 (autocast casts fp32 weights to the low precision inside each op and gradients flow
back into the fp32 leaves), and so do θ, the outer momentum and the pseudo-gradient (``outer.py`` computes them on the
CPU in fp32). Peers of one run may train in different precisions: the shared state stays bit-identical because only
the averaged fp32 pseudo-gradient ever touches it.

Gradient accumulation (``DilocoConfig.grad_accum_steps`` = k): an inner step draws k microbatches of
``data.batch_size`` windows from the batch stream, back-propagates each one's loss divided by k and then takes one
AdamW step, so its gradient is the mean over k * batch_size windows (equal to one batch of that size up to float
rounding) while activations are held for one microbatch only.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from hivetrain.diloco.config import DilocoConfig
from hivetrain.model import lm_loss

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class InnerPhaseResult:
    """What one inner phase did. Units: samples (token windows), tokens, seconds, nats.

    ``num_samples`` counts every window of every microbatch of the steps run, including the steps the fp16 gradient
    scaler skipped (``num_skipped_steps``; see ``InnerOptimizer.run``).
    """

    num_steps: int
    num_samples: int
    num_tokens: int
    mean_loss: float
    duration_s: float
    num_skipped_steps: int = 0

    @property
    def samples_per_s(self) -> float:
        return self.num_samples / max(self.duration_s, 1e-9)


@dataclass(frozen=True)
class Precision:
    """How a peer runs its inner steps on its device (``resolve_precision``).

    Args:
        name: "fp32", "bf16" or "fp16": the dtype of the forward/backward compute.
        device_type: "cpu", "cuda", ... (``torch.device.type``).
        autocast_dtype: the dtype ``torch.autocast`` runs in; None = no autocast (plain fp32).
        use_grad_scaler: fp16 only: losses are scaled by a ``torch.amp.GradScaler`` so small gradients do not
            underflow.
    """

    name: str
    device_type: str
    autocast_dtype: torch.dtype | None
    use_grad_scaler: bool

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context the forward pass runs in (a no-op for fp32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)


def resolve_precision(requested: str, device_type: str, native_bf16: bool) -> Precision:
    """The precision a peer uses for ``diloco.precision = requested`` on a device of type ``device_type``.

    Args:
        requested: "auto", "fp32", "bf16" or "fp16" (``DilocoConfig.precision``).
        device_type: the model's device type ("cpu", "cuda", ...).
        native_bf16: whether the device computes bf16 natively (CUDA: compute capability 8.0+ or ROCm; ignored for
            other device types). See ``cuda_native_bf16``.

    Returns:
        "auto": bf16 autocast on a CUDA device with native bf16, fp16 autocast with a gradient scaler on an older CUDA
        device, fp32 on every other device (CPU runs stay exactly as without autocast). "fp32": always fp32. "bf16":
        bf16 autocast (also on the CPU, where torch supports it). "fp16": fp16 autocast with a gradient scaler.

    Raises:
        ValueError: "fp16" on a device other than CUDA (the gradient scaler and fast fp16 kernels are CUDA's); "bf16" on
            a CUDA device without native bf16 (emulated bf16 is slower than fp32 there) or on a device type torch
            cannot autocast. The message names the fix ("auto" picks what the device supports).
    """
    if requested == "fp32" or (requested == "auto" and device_type != "cuda"):
        return Precision("fp32", device_type, None, False)
    if requested == "auto":
        requested = "bf16" if native_bf16 else "fp16"
    if requested == "fp16":
        if device_type != "cuda":
            raise ValueError(
                f"diloco.precision='fp16' needs a CUDA GPU, but this peer trains on {device_type!r}: use 'auto' "
                "(bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPUs), 'bf16' or 'fp32'"
            )
        return Precision("fp16", device_type, torch.float16, True)
    if requested == "bf16":
        if device_type == "cuda" and not native_bf16:
            raise ValueError(
                "diloco.precision='bf16' on a CUDA GPU without native bf16 (compute capability below 8.0): use 'auto' "
                "(fp16 with a gradient scaler there) or 'fp16'"
            )
        if not torch.amp.is_autocast_available(device_type):
            raise ValueError(f"diloco.precision='bf16': torch cannot autocast on {device_type!r}; use 'auto' or 'fp32'")
        return Precision("bf16", device_type, torch.bfloat16, False)
    raise ValueError(f"diloco.precision={requested!r}: choose 'auto', 'fp32', 'bf16' or 'fp16'")


def cuda_native_bf16(device: torch.device) -> bool:
    """Whether CUDA ``device`` computes bf16 natively (False for any other device type)."""
    if device.type != "cuda":
        return False
    if torch.version.hip is not None:
        return True
    return torch.cuda.get_device_capability(device) >= (8, 0)


def lr_multiplier(step: int, config: DilocoConfig) -> float:
    """Linear warmup to 1, then cosine decay to ``min_lr_ratio`` over ``schedule_length()`` inner steps."""
    if step < config.warmup_steps:
        return (step + 1) / (config.warmup_steps + 1)
    length = config.schedule_length()
    progress = min(1.0, (step - config.warmup_steps) / max(1, length - config.warmup_steps))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class InnerOptimizer:
    """AdamW over a model's fp32 parameters with the DiLoCo inner schedule, in ``config.precision`` (module docstring).

    Args:
        model: the peer's model; its parameters must be fp32 (they are the master weights) and on the device the
            inner steps run on.
        config: the run's DiLoCo settings (``inner_lr``, ``precision``, ``grad_accum_steps``, ...).

    Raises:
        ValueError: a parameter is not fp32, or ``config.precision`` cannot run on the model's device
            (``resolve_precision``).
    """

    def __init__(self, model: PreTrainedModel, config: DilocoConfig):
        for name, p in model.named_parameters():
            if p.dtype != torch.float32:
                raise ValueError(
                    f"parameter {name} is {p.dtype}: inner steps keep fp32 master parameters; build or load the "
                    "model in torch.float32 (diloco.precision sets the compute precision)"
                )
        device = next(model.parameters()).device
        self.model = model
        self.config = config
        self.precision = resolve_precision(config.precision, device.type, cuda_native_bf16(device))
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.inner_lr, weight_decay=config.weight_decay, betas=(0.9, 0.95)
        )
        # kept across phases like the AdamW state, so the loss scale is calibrated once per peer
        self.scaler = torch.amp.GradScaler(device.type) if self.precision.use_grad_scaler else None
        self.num_skipped_steps = 0  # fp16: steps the scaler skipped since this optimizer was made
        # a multi-rank node (node_ranks): callback(finite) -> whether every rank's microbatch loss is finite, so all
        # ranks raise together; None for a single-process peer
        self.agree_finite: Callable[[bool], bool] | None = None
        logger.info(
            "inner steps in %s on %s, %d microbatch(es) per step", self.precision.name, device, config.grad_accum_steps
        )

    def _grad_sync(self, last_microbatch: bool) -> contextlib.AbstractContextManager:
        """DDP (a multi-rank node): all-reduce the gradients on a step's last microbatch only (``no_sync`` before:
        they accumulate locally, the sum is the same). A no-op for a plain model."""
        no_sync = getattr(self.model, "no_sync", None)
        return no_sync() if no_sync is not None and not last_microbatch else contextlib.nullcontext()

    def run(
        self, batches: Iterator[torch.Tensor], first_step: int, num_steps: int, on_step=None, should_end=None
    ) -> InnerPhaseResult:
        """Run up to ``num_steps`` inner steps starting at global inner step ``first_step`` (for the schedule).

        Each inner step draws ``config.grad_accum_steps`` microbatches from ``batches``. With fp16 the losses are
        scaled by the gradient scaler; when a step's gradients hold Inf/NaN (the scale was too large) the scaler
        skips that AdamW step (parameters and AdamW state unchanged, the learning-rate schedule still advances) and
        halves the scale. Skipped steps are counted (``InnerPhaseResult.num_skipped_steps``, logged as a warning);
        their samples stay in ``num_samples``, as the swarm's schedule counted them. A non-finite *loss* is not a
        scale problem: it raises as below, in every precision.

        Args:
            batches: yields (B, T+1) int64 token windows (one microbatch each, B = ``data.batch_size``).
            first_step: global index of the first inner step (sets the learning rate).
            num_steps: the most inner steps to run.
            on_step: optional callback(step_index, loss) after every step (progress display, duty cycle); loss is the
                step's mean over its microbatches, in nats per token.
            should_end: optional callback(num_steps_done, num_samples_done) -> bool after every step; True ends the
                phase early (the swarm's schedule, ``diloco.schedule``).

        Raises:
            FloatingPointError: the loss became NaN/Inf (the inner phase diverged; the caller discards it).
        """
        device = next(self.model.parameters()).device
        accum = self.config.grad_accum_steps
        scaler = self.scaler
        self.model.train()
        started = time.perf_counter()
        total_loss, samples, tokens, steps, skipped = 0.0, 0, 0, 0, 0
        for i in range(num_steps):
            lr = self.config.inner_lr * lr_multiplier(first_step + i, self.config)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.zero_grad(set_to_none=True)
            step_loss = 0.0
            for j in range(accum):
                batch = next(batches).to(device, non_blocking=True)
                with self._grad_sync(j + 1 == accum):
                    with self.precision.autocast():
                        loss = lm_loss(self.model, batch)  # fp32 scalar: lm_loss takes the cross-entropy in fp32
                    finite = bool(torch.isfinite(loss))
                    if self.agree_finite is not None:
                        finite = self.agree_finite(finite)  # a node's ranks raise together, before the backward
                    if not finite:
                        raise FloatingPointError(f"inner step {first_step + i}: loss is {loss.item()}")
                    scaled = loss / accum if accum > 1 else loss  # the mean over microbatches of equal size
                    (scaler.scale(scaled) if scaler is not None else scaled).backward()
                step_loss += loss.item()
                samples += batch.shape[0]
                tokens += batch.shape[0] * (batch.shape[1] - 1)
            if scaler is not None:
                scaler.unscale_(self.optimizer)  # clip the true gradients
            if self.config.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
            if scaler is not None:
                scale = scaler.get_scale()
                scaler.step(self.optimizer)  # skipped when a gradient is Inf/NaN
                scaler.update()
                if scaler.get_scale() < scale:  # update() backs off exactly when the step was skipped
                    skipped += 1
            else:
                self.optimizer.step()
            loss_value = step_loss / accum
            total_loss += loss_value
            steps += 1
            if on_step is not None:
                on_step(i, loss_value)
            if should_end is not None and should_end(steps, samples):
                break
        if skipped:
            self.num_skipped_steps += skipped
            logger.warning(
                "fp16: the gradient scaler skipped %d of %d inner steps (Inf/NaN gradients); loss scale now %g",
                skipped,
                steps,
                scaler.get_scale() if scaler is not None else 1.0,
            )
        return InnerPhaseResult(
            num_steps=steps,
            num_samples=samples,
            num_tokens=tokens,
            mean_loss=total_loss / max(steps, 1),
            duration_s=time.perf_counter() - started,
            num_skipped_steps=skipped,
        )
