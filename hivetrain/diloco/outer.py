"""DiLoCo's outer step: pseudo-gradient and outer Nesterov SGD (Douillard et al. 2023, Algorithm 1).

After H inner steps from the shared parameters θ, a peer's pseudo-gradient is Δ = θ − θ_local. Peers average Δ
(weighted by samples) and every member applies the same outer step to the same θ:

    m ← μ·m + Δ̄
    θ ← θ − η·(Δ̄ + μ·m)          (Nesterov momentum, as torch.optim.SGD(nesterov=True) computes it)

with η = outer_lr (paper: 0.7) and μ = outer_momentum (paper: 0.9). At μ = 0 (hivetrain's default) the update is
plain averaging, θ ← θ − η·Δ̄, and m stays zero (as torch's SGD keeps no buffer without momentum): storing Δ̄ in m
would change nothing in θ but would double every state download, checkpoint and hash with a buffer never read
(a coordinator following a 50 MB model pulled 100.7 MB per epoch from volunteers' uplinks; dev/LOG.md, session 39).

Bit-identity across machines: peers must end an outer step with bit-identical θ and m even on different CPUs. The
update is therefore written as single IEEE-754 operations (one multiply or one add per statement, each correctly
rounded), never a fused multiply-add that one CPU might fuse and another not. ``torch.optim.SGD`` is the reference
in the tests (it agrees to float rounding), not the implementation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hivetrain.diloco.state import TrainingState


def pseudo_gradient(state: TrainingState, local_model: torch.nn.Module) -> list[torch.Tensor]:
    """Δ = θ − θ_local for every parameter, fp32 on the CPU, in ``state.params`` order.

    Raises:
        ValueError: the model's parameters do not match the state's names/shapes, or Δ is not finite (a diverged
            inner phase must not be sent to other peers).
    """
    local = dict(local_model.named_parameters())
    if list(local) != list(state.params):
        raise ValueError("model parameters do not match the training state")
    deltas = []
    for name, theta in state.params.items():
        delta = theta - local[name].detach().to("cpu", torch.float32)
        if not torch.isfinite(delta).all():
            raise ValueError(f"pseudo-gradient of {name} is not finite: the inner phase diverged")
        deltas.append(delta)
    return deltas


def outer_step(state: TrainingState, avg_delta: Sequence[torch.Tensor], lr: float, momentum: float) -> TrainingState:
    """Apply outer Nesterov SGD with the averaged pseudo-gradient; returns the state of epoch + 1.

    Args:
        state: θ and momentum at epoch e (not modified).
        avg_delta: Δ̄ per parameter, fp32, same shapes and order as ``state.params``.
        lr: outer learning rate η.
        momentum: Nesterov momentum μ (0: the returned momentum is all zeros).

    Raises:
        ValueError: shapes/dtypes differ or Δ̄ is not finite.
    """
    if len(avg_delta) != len(state.params):
        raise ValueError(f"expected {len(state.params)} averaged tensors, got {len(avg_delta)}")
    lr_t = torch.tensor(lr, dtype=torch.float32)
    mu_t = torch.tensor(momentum, dtype=torch.float32)
    params, buffers = {}, {}
    for (name, theta), delta in zip(state.params.items(), avg_delta, strict=False):
        if delta.shape != theta.shape or delta.dtype != torch.float32:
            raise ValueError(f"{name}: averaged delta {delta.dtype}{tuple(delta.shape)} does not match θ")
        if not torch.isfinite(delta).all():
            raise ValueError(f"{name}: averaged delta is not finite")
        # two new tensors per parameter, each op in place after it (fresh temporaries per op cost page faults: 12.2
        # -> see dev/LOG.md 2026-12-02 for ms per million parameters); the same six correctly rounded operations
        buf = torch.mul(state.momentum[name], mu_t)  # μ·m
        buf.add_(delta)  # m ← μ·m + Δ̄
        update = torch.mul(buf, mu_t)  # μ·m
        update.add_(delta)  # Δ̄ + μ·m
        update.mul_(lr_t)  # η·(Δ̄ + μ·m)
        params[name] = torch.sub(theta, update, out=update)  # θ − η·(Δ̄ + μ·m), into the update's memory
        buffers[name] = buf.zero_() if momentum == 0.0 else buf  # μ = 0: m is never read (module docstring)
    return TrainingState(epoch=state.epoch + 1, params=params, momentum=buffers)


def load_into_model(state: TrainingState, model: torch.nn.Module) -> None:
    """Copy θ into ``model`` (any device/dtype); the inner phase starts from here."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(state.params[name])
