"""Where the next inner phase starts while the previous epoch's round is still in flight (``diloco.overlap``).

With overlap, a peer does not wait for the round of epoch e: it starts inner phase e+1 at once and the round runs
in the background. The shared state (θ_e, momentum) stays exactly DiLoCo's: when the round commits, every member
applies the same outer step to the same θ_e and holds bit-identical θ_{e+1} (``outer.outer_step``). Only the
*start point* of the phase in flight is local, since θ_{e+1} is not known yet when it starts:

- "delayed": start from θ_e, the newest shared θ (the averaged update of epoch e reaches the start points one
  epoch late: the naive one-outer-step overlap of Kale et al. 2025, Sec. 3).
- "eager": start from θ_e advanced by an estimate of the average in flight (Kale et al. 2025, "Eager updates for
  overlapped communication and computation in DiLoCo", Sec. 3.2): the previous committed average Δ̄_{e−1} with our own
  share replaced by our fresh pseudo-gradient,

      Δ̂_e = Δ̄_{e−1} + s·(Δ_e − Δ_{e−1}),      s = our weight / the group's total weight in round e−1,

  which is the paper's (1/M)·Δ_e + (1/M)·Σ_{others} Δ_{e−1} with sample weights. Without a previous round of ours
  (first epoch, or we just joined), Δ̂_e = Δ_e.

The pseudo-gradient of the phase is measured from its own start point (Δ = start − θ_local), so it does not matter
to the shared state which start point a peer used; peers that downloaded state start from the downloaded θ.

All tensors: fp32 CPU, ``state.params`` order and shapes. Pure functions: no I/O, no state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from hivetrain.diloco.outer import outer_step
from hivetrain.diloco.state import TrainingState

OverlapMode = Literal["off", "delayed", "eager"]


@dataclass(frozen=True)
class PreviousRound:
    """What the eager estimate needs of the last round we took part in.

    Attributes:
        average: Δ̄ of that round, fp32, per parameter.
        own: our pseudo-gradient in that round, fp32, per parameter.
        share: our weight / the round's total weight, in [0, 1].
    """

    average: Sequence[torch.Tensor]
    own: Sequence[torch.Tensor]
    share: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"share must be in [0, 1], got {self.share}")
        if len(self.average) != len(self.own):
            raise ValueError("average and own must have one tensor per parameter")


def eager_estimate(own: Sequence[torch.Tensor], previous: PreviousRound | None) -> list[torch.Tensor]:
    """Δ̂ = Δ̄_prev + share·(Δ_own − Δ_own_prev), or Δ_own without a previous round (see the module docstring)."""
    if previous is None:
        return [t.clone() for t in own]
    if len(previous.own) != len(own):
        raise ValueError(f"expected {len(previous.own)} tensors, got {len(own)}")
    share = torch.tensor(previous.share, dtype=torch.float32)
    return [avg + share * (new - old) for avg, new, old in zip(previous.average, own, previous.own, strict=True)]


def start_params(
    shared: TrainingState,
    own: Sequence[torch.Tensor],
    previous: PreviousRound | None,
    mode: OverlapMode,
    lr: float,
    momentum: float,
) -> dict[str, torch.Tensor]:
    """θ the next inner phase starts from while the round of ``own`` is in flight.

    Args:
        shared: the newest committed shared state θ_e (not modified).
        own: our pseudo-gradient Δ_e now being averaged.
        previous: the last round we took part in (for "eager"), or None.
        mode: "delayed" or "eager" ("off" has no round in flight: it returns θ_e).
        lr: outer learning rate η; momentum: outer Nesterov momentum μ (the run's ``diloco`` values).

    Returns:
        name -> fp32 tensor, ``shared.params`` order; new tensors (``shared`` is not aliased).

    Raises:
        ValueError: shapes differ or the estimate is not finite.
    """
    if mode in ("off", "delayed"):
        return {name: t.clone() for name, t in shared.params.items()}
    if mode != "eager":
        raise ValueError(f"unknown overlap mode {mode!r}")
    return dict(outer_step(shared, eager_estimate(own, previous), lr, momentum).params)
