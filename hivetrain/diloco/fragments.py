"""Streaming DiLoCo's fragments: the parameters split into F parts whose outer steps take turns (``diloco.fragments``).

Douillard et al. 2025, "Streaming DiLoCo with overlapping communication: Towards a Distributed Free Lunch"
(arXiv 2501.18512). DiLoCo sends every parameter's pseudo-gradient at the end of each inner phase: a burst of the
whole model's bytes, during which the link is the bottleneck and, without overlap, compute waits. Streaming DiLoCo
splits the parameters into F fragments and syncs one fragment every H / F inner steps, in turn (Sec. 2.2), so each
fragment still averages every H inner steps but a round carries 1/F of the model: the peak upload rate a member
needs to hide a round behind the next H / F inner steps falls F times (Sec. 2.3: the fragment's round overlaps the
next steps, its average merged into the local copy when it arrives).

In hivetrain's terms an epoch is one fragment's outer step: epoch ``e`` averages fragment ``e mod F``.

- **The pseudo-gradient** of fragment p is Δ_p = θ_p − θ_p,local, θ_p being the shared θ of that fragment, which
  only fragment p's outer steps change, so it is what the local copy last took from the shared state (F epochs ago,
  or at a download).
- **The outer step** (``fragment_outer_step``) applies DiLoCo's outer Nesterov step (``outer.outer_step``) to the
  fragment's θ and momentum; every other tensor of the state is carried over untouched (the same tensors).
- **The local copy** takes the new shared θ_p (``merge_fragment``): replaced (α = 0), or, when the round overlapped
  inner steps that moved the local copy on meanwhile, mixed as θ_p,local ← α·θ_p,local + (1 − α)·θ_p (Sec. 2.3,
  α = 0.5 in the paper), keeping part of what those steps learned. The other fragments keep training locally.

Fragments are contiguous runs of whole parameter tensors in the state's order, cut where the running element count
comes closest to each k/F of the total (``FragmentPlan.build``): the F rounds carry equal bytes to within about one
tensor, and each fragment is one contiguous byte range of the flat state that downloads move in chunks
(``state_wire``), so a peer or follower that downloads a newer state fetches only the chunks of the fragments changed
since (``state_reuse``). The paper strides transformer blocks over the fragments (block i in fragment i mod F) and
found it slightly better than contiguous blocks (Sec. 3.3); strided fragments interleave in the flat state, and a
4 MiB chunk then holds tensors of several fragments: the coordinator following a 50 MB model with 4 strided
fragments fetched all of θ every epoch (dev/LOG.md, session 40). Every peer builds the same plan from the same names
and sizes (a pure function of them).

All tensors: fp32 CPU, ``TrainingState.params`` order within a fragment. Pure functions and a frozen plan: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hivetrain.diloco.outer import outer_step
from hivetrain.diloco.state import TrainingState


@dataclass(frozen=True)
class FragmentPlan:
    """Which parameters each fragment holds.

    Attributes:
        fragments: per fragment, its parameter names in the state's order; every name in exactly one fragment.
        numels: per fragment, its number of elements.
    """

    fragments: tuple[tuple[str, ...], ...]
    numels: tuple[int, ...]

    @classmethod
    def build(cls, numels: Mapping[str, int], num_fragments: int) -> FragmentPlan:
        """Split the parameters (name -> number of elements, in the state's order) into ``num_fragments`` of near
        equal size (see the module docstring).

        Raises:
            ValueError: ``num_fragments`` < 1, or more fragments than parameter tensors (a fragment would be empty).
        """
        if num_fragments < 1:
            raise ValueError(f"diloco.fragments must be >= 1, got {num_fragments}")
        if num_fragments > len(numels):
            raise ValueError(
                f"diloco.fragments = {num_fragments} but the model has {len(numels)} parameter tensors: a fragment "
                "is whole tensors, so use at most that many fragments"
            )
        names, total = list(numels), sum(numels.values())
        members: list[list[str]] = [[] for _ in range(num_fragments)]
        done, index = 0, 0
        for p in range(num_fragments):
            left = num_fragments - p - 1  # fragments after this one: each needs at least one tensor
            cut = total * (p + 1) / num_fragments
            while index < len(names) - left:
                n = numels[names[index]]
                # take the tensor if the fragment is empty, or if ending after it comes closer to the cut
                if members[p] and abs(done + n - cut) > abs(done - cut):
                    break
                members[p].append(names[index])
                done, index = done + n, index + 1
            if p == num_fragments - 1:
                members[p].extend(names[index:])
                index = len(names)
        fragments = tuple(tuple(m) for m in members)
        sizes = [sum(numels[n] for n in m) for m in members]
        return cls(fragments=fragments, numels=tuple(sizes))

    @classmethod
    def of_state(cls, state: TrainingState, num_fragments: int) -> FragmentPlan:
        """``build`` from a state's parameters."""
        return cls.build({name: t.numel() for name, t in state.params.items()}, num_fragments)

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def fragment_of(self, epoch: int) -> int:
        """The fragment whose outer step epoch ``epoch`` is (its round makes epoch + 1)."""
        return epoch % self.num_fragments

    def names(self, epoch: int) -> tuple[str, ...]:
        """The parameter names the round of epoch ``epoch`` averages."""
        return self.fragments[self.fragment_of(epoch)]


def fragment_pseudo_gradient(
    state: TrainingState, local_model: torch.nn.Module, names: Sequence[str]
) -> list[torch.Tensor]:
    """Δ_p = θ_p − θ_p,local for the parameters ``names`` (one fragment), fp32 CPU, in ``names`` order.

    Raises:
        ValueError: a name is not a parameter of both, or Δ is not finite (a diverged inner phase must not be sent).
    """
    local = dict(local_model.named_parameters())
    deltas = []
    for name in names:
        if name not in local or name not in state.params:
            raise ValueError(f"fragment parameter {name!r} is not in both the model and the training state")
        delta = state.params[name] - local[name].detach().to("cpu", torch.float32)
        if not torch.isfinite(delta).all():
            raise ValueError(f"pseudo-gradient of {name} is not finite: the inner phase diverged")
        deltas.append(delta)
    return deltas


def fragment_outer_step(
    state: TrainingState, names: Sequence[str], avg_delta: Sequence[torch.Tensor], lr: float, momentum: float
) -> TrainingState:
    """Apply the outer Nesterov step (``outer.outer_step``, bit for bit) to the fragment ``names`` only; returns the
    state of epoch + 1, whose other tensors are ``state``'s own (not copied: states are never modified in place).

    Args:
        state: θ and momentum at epoch e (not modified).
        names: the fragment's parameter names (``FragmentPlan.names(state.epoch)``).
        avg_delta: Δ̄ per name, fp32, the shapes of ``state.params[name]``.
        lr, momentum: the outer step's η and μ.

    Raises:
        ValueError: a name is not in the state, counts, shapes or dtypes differ, or Δ̄ is not finite.
    """
    if len(avg_delta) != len(names):
        raise ValueError(f"expected {len(names)} averaged tensors for the fragment, got {len(avg_delta)}")
    missing = [n for n in names if n not in state.params]
    if missing:
        raise ValueError(f"fragment parameters not in the state: {missing[:3]}")
    part = TrainingState(
        epoch=state.epoch, params={n: state.params[n] for n in names}, momentum={n: state.momentum[n] for n in names}
    )
    stepped = outer_step(part, avg_delta, lr, momentum)
    params = {n: stepped.params.get(n, t) for n, t in state.params.items()}
    buffers = {n: stepped.momentum.get(n, t) for n, t in state.momentum.items()}
    return TrainingState(epoch=state.epoch + 1, params=params, momentum=buffers)


def merge_fragment(model: torch.nn.Module, state: TrainingState, names: Sequence[str], alpha: float) -> None:
    """The local copy takes the shared θ of the fragment ``names``: θ_local ← α·θ_local + (1 − α)·θ (α = 0:
    replaced; Streaming DiLoCo Sec. 2.3). Any device and dtype; other parameters are not touched.

    Raises:
        ValueError: ``alpha`` outside [0, 1), or a name that is not a parameter of the model.
    """
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"the mixing factor alpha must be in [0, 1), got {alpha}")
    local = dict(model.named_parameters())
    with torch.no_grad():
        for name in names:
            if name not in local:
                raise ValueError(f"fragment parameter {name!r} is not a parameter of the model")
            shared = state.params[name].to(local[name].device, local[name].dtype)
            if alpha == 0.0:
                local[name].copy_(shared)
            else:
                local[name].mul_(alpha).add_(shared, alpha=1.0 - alpha)
