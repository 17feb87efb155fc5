"""DiLoCo's inner phase: H AdamW steps with warmup, cosine decay and gradient clipping.

Each peer keeps its own AdamW state across outer steps (Douillard et al. 2023, Sec. 2: inner optimizer state is local
to a worker). The learning-rate schedule follows the peer's inner-step count, which is derived from the epoch, so a
peer that downloads state resumes the schedule where the swarm is.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from hivetrain.config import DilocoConfig
from hivetrain.model import lm_loss


@dataclass(frozen=True)
class InnerPhaseResult:
    """What one inner phase did. Units: samples, tokens, seconds, nats."""

    num_steps: int
    num_samples: int
    num_tokens: int
    mean_loss: float
    duration_s: float

    @property
    def samples_per_s(self) -> float:
        return self.num_samples / max(self.duration_s, 1e-9)


def lr_multiplier(step: int, config: DilocoConfig) -> float:
    """Linear warmup to 1, then cosine decay to ``min_lr_ratio`` over ``schedule_length()`` inner steps."""
    if step < config.warmup_steps:
        return (step + 1) / (config.warmup_steps + 1)
    length = config.schedule_length()
    progress = min(1.0, (step - config.warmup_steps) / max(1, length - config.warmup_steps))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class InnerOptimizer:
    """AdamW over a model's parameters with the DiLoCo inner schedule."""

    def __init__(self, model: PreTrainedModel, config: DilocoConfig):
        self.model = model
        self.config = config
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.inner_lr, weight_decay=config.weight_decay, betas=(0.9, 0.95)
        )

    def run(
        self, batches: Iterator[torch.Tensor], first_step: int, num_steps: int, on_step=None, should_end=None
    ) -> InnerPhaseResult:
        """Run up to ``num_steps`` inner steps starting at global inner step ``first_step`` (for the schedule).

        Args:
            batches: yields (B, T+1) int64 token windows.
            on_step: optional callback(step_index, loss) after every step (progress display, duty cycle).
            should_end: optional callback(num_steps_done, num_samples_done) -> bool after every step; True ends the
                phase early (the swarm's schedule, ``diloco.schedule``).

        Raises:
            FloatingPointError: the loss became NaN/Inf (the inner phase diverged; the caller discards it).
        """
        device = next(self.model.parameters()).device
        self.model.train()
        started = time.perf_counter()
        total_loss, samples, tokens, steps = 0.0, 0, 0, 0
        for i in range(num_steps):
            batch = next(batches).to(device, non_blocking=True)
            lr = self.config.inner_lr * lr_multiplier(first_step + i, self.config)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            loss = lm_loss(self.model, batch)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"inner step {first_step + i}: loss is {loss.item()}")
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.config.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
            self.optimizer.step()
            loss_value = loss.item()
            total_loss += loss_value
            samples += batch.shape[0]
            tokens += batch.shape[0] * (batch.shape[1] - 1)
            steps += 1
            if on_step is not None:
                on_step(i, loss_value)
            if should_end is not None and should_end(steps, samples):
                break
        return InnerPhaseResult(
            num_steps=steps,
            num_samples=samples,
            num_tokens=tokens,
            mean_loss=total_loss / max(steps, 1),
            duration_s=time.perf_counter() - started,
        )
