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

Speed on a GPU (issue 24; ``scripts/bench/inner_loop.py`` measures it): the forward pass and loss may run through
``torch.compile`` (``DilocoConfig.compile``; compiled once per process by ``InnerOptimizer.warm_up``, before the first
phase), AdamW is fused on CUDA (one kernel for every parameter), batches are copied from pinned host memory without
blocking, and the host does not wait for the device inside an inner step ("deferred reads"): each step's loss and its
non-finite flag stay on the device, the fused AdamW step of a step whose loss is not finite is skipped on the device
(its ``found_inf`` input, the mechanism ``torch.amp.GradScaler`` uses), and step k's loss is read after step k+1 is
queued, so the device always has work. A diverged step still raises ``FloatingPointError`` before the phase returns
(one step later than on the CPU, with the parameters and AdamW state untouched by it). CPU peers keep the plain path:
unfused AdamW, eager, every microbatch's loss checked before its backward pass (bit-identical to before issue 24).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from hivetrain.diloco.config import DilocoConfig

if TYPE_CHECKING:
    from hivetrain.preflight import MemoryCheck
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


def resolve_compile(requested: str, device_type: str) -> bool:
    """Whether ``diloco.compile = requested`` compiles the inner step on a device of type ``device_type``: "auto" on
    CUDA only (``DilocoConfig.compile``), "on" everywhere, "off" nowhere."""
    if requested not in ("auto", "on", "off"):
        raise ValueError(f"diloco.compile={requested!r}: choose 'auto', 'on' or 'off'")
    return requested == "on" or (requested == "auto" and device_type == "cuda")


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
        config: the run's DiLoCo settings (``inner_lr``, ``precision``, ``grad_accum_steps``, ``compile``, ...).
        fused: use fused AdamW (one kernel per step); None = on CUDA only (CPU peers keep torch's default
            multi-tensor AdamW, as before issue 24).
        deferred_reads: read each step's loss one step late and skip a non-finite step on the device (module
            docstring); needs fused AdamW and no gradient scaler or multi-rank agreement (``agree_finite``). None = on
            whenever those hold on CUDA.
        autocast: run the forward pass under ``torch.autocast`` in the precision's dtype (default). False: the model
            casts its own compute (an FSDP2 node's ``MixedPrecisionPolicy``, ``node_shard``).

    Raises:
        ValueError: a parameter is not fp32, ``config.precision`` cannot run on the model's device
            (``resolve_precision``), or ``deferred_reads=True`` without fused AdamW or with fp16's gradient scaler.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: DilocoConfig,
        *,
        fused: bool | None = None,
        deferred_reads: bool | None = None,
        autocast: bool = True,
    ):
        for name, p in model.named_parameters():
            if p.dtype != torch.float32:
                raise ValueError(
                    f"parameter {name} is {p.dtype}: inner steps keep fp32 master parameters; build or load the "
                    "model in torch.float32 (diloco.precision sets the compute precision)"
                )
        device = next(model.parameters()).device
        self.model = model
        self.config = config
        self._autocast = autocast
        # the share of the parameters, gradients and AdamW state this process holds (FSDP: 1/ranks) and the
        # parameters it gathers at once: what the preflight's estimate was made for (``_check_memory``)
        self.shards, self.gathered_parameters = 1, 0
        self.precision = resolve_precision(config.precision, device.type, cuda_native_bf16(device))
        self.fused = device.type == "cuda" if fused is None else fused
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=config.inner_lr,
            weight_decay=config.weight_decay,
            betas=(0.9, 0.95),
            fused=self.fused or None,  # None: torch's default (foreach where it can)
        )
        # kept across phases like the AdamW state, so the loss scale is calibrated once per peer
        self.scaler = torch.amp.GradScaler(device.type) if self.precision.use_grad_scaler else None
        if deferred_reads and (not self.fused or self.scaler is not None):
            raise ValueError("deferred reads skip a diverged step inside fused AdamW: they need fused=True and no fp16")
        self._deferred = deferred_reads
        self.num_skipped_steps = 0  # fp16: steps the scaler skipped since this optimizer was made
        # a multi-rank node (node_ranks): callback(finite) -> whether every rank's microbatch loss is finite, so all
        # ranks raise together; None for a single-process peer
        self.agree_finite: Callable[[bool], bool] | None = None
        self.compiled = resolve_compile(config.compile, device.type)
        self._loss = torch.compile(self._forward_loss, dynamic=False) if self.compiled else self._forward_loss
        self.compile_s = 0.0  # seconds ``warm_up`` spent compiling
        self.memory: MemoryCheck | None = None  # CUDA: the preflight's estimate vs the first phase's measured peak
        self._memory_checked = False  # once per process, whatever the outcome
        logger.info(
            "inner steps in %s on %s, %d microbatch(es) per step, %s AdamW, %s",
            self.precision.name,
            device,
            config.grad_accum_steps,
            "fused" if self.fused else "multi-tensor",
            "compiled" if self.compiled else "eager",
        )

    def _check_memory(self, device: torch.device, microbatch: int, seq_len: int) -> None:
        """Log the preflight's estimate against the peak the device held in this (first) phase; never raises (a
        model without a transformers config has no estimate)."""
        from hivetrain.preflight import check_estimate

        self._memory_checked = True
        try:
            peak = torch.cuda.max_memory_allocated(device)
            half = self.precision.autocast_dtype is not None
            self.memory = check_estimate(
                self.model, microbatch, seq_len, device.type, half, peak, self.shards, self.gathered_parameters
            )
        except (AttributeError, ValueError) as exc:
            logger.info("memory: measured peak not compared with the preflight (%s)", exc)
            return
        logger.info("%s", self.memory.reason)

    @property
    def deferred_reads(self) -> bool:
        """Whether ``run`` reads each step's loss one step late (module docstring)."""
        if self._deferred is not None:
            return self._deferred and self.agree_finite is None
        device = next(self.model.parameters()).device
        return device.type == "cuda" and self.fused and self.scaler is None and self.agree_finite is None

    def _forward_loss(self, batch: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss of a (B, T+1) int64 batch, in the step's precision (what ``torch.compile``
        compiles): an fp32 scalar, nats per token."""
        with self.precision.autocast() if self._autocast else contextlib.nullcontext():
            return lm_loss(self.model, batch)  # lm_loss takes the cross-entropy in fp32

    def warm_up(self, batch_size: int, seq_len: int) -> float:
        """Compile the inner step now, on a batch of zeros of the run's shape (B = ``batch_size``, T+1 = ``seq_len``
        + 1), so the first phase's time and throughput measure training, not compiling. The parameters, the AdamW
        state and the random number generators are left as they were; the gradients are cleared. A no-op (0.0)
        when the step is not compiled.

        Returns:
            Seconds spent (logged; ``compile_s``).

        Raises:
            ValueError: ``diloco.compile = "on"`` and torch.compile failed (the message names the cause and the fix).
                With "auto" a failure falls back to the eager step with a warning instead.
        """
        if not self.compiled:
            return 0.0
        device = next(self.model.parameters()).device
        batch = torch.zeros((batch_size, seq_len + 1), dtype=torch.int64, device=device)
        started = time.perf_counter()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                self.model.train()
                self._loss(batch).backward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        except Exception as exc:  # inductor's failures have many types: a missing compiler, Triton, an unsupported op
            cause = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            if self.config.compile == "on":
                raise ValueError(
                    f"diloco.compile = 'on', but torch.compile failed on this machine ({cause[:500]}): set "
                    "diloco.compile = 'auto' (compiles on CUDA GPUs only, else falls back) or 'off'; on a CPU, "
                    "inductor needs a C++ compiler (e.g. g++)"
                ) from exc
            logger.warning("torch.compile failed, inner steps run eager (diloco.compile = 'auto'): %s", cause[:500])
            self.compiled, self._loss = False, self._forward_loss
        finally:
            self.optimizer.zero_grad(set_to_none=True)
        self.compile_s = time.perf_counter() - started
        logger.info("compiling the inner step took %.1f s (once per process)", self.compile_s)
        return self.compile_s

    def _grad_sync(self, last_microbatch: bool) -> contextlib.AbstractContextManager:
        """DDP (a multi-rank node): all-reduce the gradients on a step's last microbatch only (``no_sync`` before:
        they accumulate locally, the sum is the same). A no-op for a plain model."""
        no_sync = getattr(self.model, "no_sync", None)
        return no_sync() if no_sync is not None and not last_microbatch else contextlib.nullcontext()

    @staticmethod
    def _to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``batch`` on ``device``; from pinned host memory without blocking the host when that is a GPU."""
        if device.type == "cuda" and batch.device.type == "cpu":
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=True)

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

        With deferred reads (``deferred_reads``: CUDA) ``on_step`` for step k runs once step k+1 is queued (after the
        last step, before returning); ``should_end`` runs after every step is queued and counts it, so the phase
        never runs a step the schedule did not ask for.

        Args:
            batches: yields (B, T+1) int64 token windows (one microbatch each, B = ``data.batch_size``).
            first_step: global index of the first inner step (sets the learning rate).
            num_steps: the most inner steps to run.
            on_step: optional callback(step_index, loss) after every step (progress display, duty cycle); loss is the
                step's mean over its microbatches, in nats per token.
            should_end: optional callback(num_steps_done, num_samples_done) -> bool after every step; True ends the
                phase early (the swarm's schedule, ``diloco.schedule``).

        Raises:
            FloatingPointError: the loss became NaN/Inf (the inner phase diverged; the caller discards it). The
                diverged step changed neither the parameters nor the AdamW state.
        """
        device = next(self.model.parameters()).device
        accum = self.config.grad_accum_steps
        scaler = self.scaler
        deferred = self.deferred_reads
        self.model.train()
        started = time.perf_counter()
        samples, tokens, steps, skipped = 0, 0, 0, 0
        losses: list[float] = []
        pending: tuple[int, torch.Tensor] | None = None  # deferred: (step index, its summed loss on the device)

        def report(i: int, loss_sum: torch.Tensor | float) -> None:
            value = (loss_sum.item() if isinstance(loss_sum, torch.Tensor) else loss_sum) / accum
            if not math.isfinite(value):  # deferred reads: the fused step skipped it on the device
                raise FloatingPointError(f"inner step {first_step + i}: loss is {value}")
            losses.append(value)
            if on_step is not None:
                on_step(i, value)

        try:
            for i in range(num_steps):
                lr = self.config.inner_lr * lr_multiplier(first_step + i, self.config)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                self.optimizer.zero_grad(set_to_none=True)
                step_loss: torch.Tensor | float = 0.0
                for j in range(accum):
                    batch = self._to_device(next(batches), device)
                    with self._grad_sync(j + 1 == accum):
                        loss = self._loss(batch)
                        if not deferred:
                            finite = bool(torch.isfinite(loss))
                            if self.agree_finite is not None:
                                finite = self.agree_finite(finite)  # a node's ranks raise together, before the backward
                            if not finite:
                                raise FloatingPointError(f"inner step {first_step + i}: loss is {loss.item()}")
                        scaled = loss / accum if accum > 1 else loss  # the mean over microbatches of equal size
                        (scaler.scale(scaled) if scaler is not None else scaled).backward()
                    step_loss = step_loss + (loss.detach() if deferred else loss.item())
                    samples += batch.shape[0]
                    tokens += batch.shape[0] * (batch.shape[1] - 1)
                if deferred:  # a non-finite loss leaves parameters, AdamW state and its step count as they were
                    self.optimizer.found_inf = (~torch.isfinite(step_loss)).to(torch.float32)
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
                steps += 1
                if deferred:
                    previous, pending = pending, (i, step_loss)
                    if previous is not None:
                        report(*previous)  # waits for the step before this one only: this one keeps the device busy
                else:
                    report(i, step_loss)
                if should_end is not None and should_end(steps, samples):
                    break
            if pending is not None:
                report(*pending)
        finally:
            self.optimizer.__dict__.pop("found_inf", None)  # only our deferred steps set it
            # the gradients are not needed between phases: their 4 bytes per parameter go back to the averaging round
            # and the outer step (host memory on a CPU peer; the evaluation replica's room on a GPU)
            self.optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda" and not self._memory_checked and steps:
            self._check_memory(device, samples // (steps * accum), tokens // max(samples, 1))
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
            mean_loss=sum(losses) / max(steps, 1),
            duration_s=time.perf_counter() - started,
            num_skipped_steps=skipped,
        )
