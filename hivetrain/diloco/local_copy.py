"""The local model between phases: where each inner phase starts, and what its pseudo-gradient and weight are.

Whole-model rounds (DiLoCo, ``diloco.fragments = 1``): every phase starts from the shared θ (or, with a round in
flight, ``BackgroundRound.start_state``), and its pseudo-gradient Δ = start − θ_local is that phase's, weighted by
its samples (``rounds.Contribution``; a failed round's Δ is carried, ``rounds.carry``).

Fragments (Streaming DiLoCo, ``diloco/fragments.py``): the local copy is never reloaded whole while the peer keeps
up: a phase starts where the last one ended, after the local copy took in the new shared θ of each fragment whose
outer step committed since (``merge_fragment``: replaced, or mixed by ``diloco.fragment_mix`` when its round
overlapped a phase). The pseudo-gradient of epoch e is that of fragment p = e mod F, Δ_p = θ_p − θ_p,local, which
holds everything the local copy learned on p since it last took θ_p, so its weight is the samples of every phase
since then (counted per fragment here), and a round that fails carries nothing: Δ_p is measured again, larger, at p's
next round. A download replaces the local copy whole (``reset``); what it had learned and not sent is lost (the
caller counts it as discarded).

Not thread-safe: the trainer's thread only.
"""

from __future__ import annotations

import torch

from hivetrain.diloco.config import DilocoConfig
from hivetrain.diloco.fragments import FragmentPlan, fragment_pseudo_gradient, merge_fragment
from hivetrain.diloco.outer import load_into_model, pseudo_gradient
from hivetrain.diloco.state import TrainingState


class LocalCopy:
    """The local model's relation to the shared state (see the module docstring).

    Args:
        model: the peer's model (any device and dtype).
        plan: the run's fragments (``FragmentPlan.of_state``), or None for whole-model rounds.
        mix: ``diloco.fragment_mix`` when rounds overlap phases (``overlap = "delayed"``), else 0.
    """

    def __init__(self, model: torch.nn.Module, plan: FragmentPlan | None, mix: float = 0.0):
        self.model, self.plan, self.mix = model, plan, mix
        self._synced: int | None = None  # the shared epoch the local copy last took in (None: reload it whole)
        self._samples = [0] * (plan.num_fragments if plan else 1)  # per fragment: samples since it took θ_p

    @classmethod
    def for_run(cls, model: torch.nn.Module, state: TrainingState, config: DilocoConfig) -> LocalCopy:
        """The run's local copy: whole-model rounds, or ``config.fragments`` fragments of ``state``'s parameters
        mixed by ``config.fragment_mix`` when rounds overlap phases (replaced without overlap)."""
        if config.fragments == 1:
            return cls(model, None)
        mix = config.fragment_mix if config.overlap != "off" else 0.0
        return cls(model, FragmentPlan.of_state(state, config.fragments), mix)

    @property
    def fragments(self) -> bool:
        return self.plan is not None

    def load(self, start: TrainingState, shared: TrainingState) -> None:
        """Before a phase: whole-model rounds load ``start``; fragments take in the fragments of the epochs
        committed since the last phase (``shared``: the newest shared state), or the whole of ``shared`` after a
        ``reset`` or a jump the commits do not explain (a download)."""
        if self.plan is None:
            load_into_model(start, self.model)
            return
        synced = self._synced
        if synced is None or not synced <= shared.epoch <= synced + self.plan.num_fragments:
            load_into_model(shared, self.model)
            self._samples = [0] * self.plan.num_fragments
        else:
            for epoch in range(synced, shared.epoch):
                p = self.plan.fragment_of(epoch)
                merge_fragment(self.model, shared, self.plan.fragments[p], self.mix)
                self._samples[p] = 0
        self._synced = shared.epoch

    def reset(self) -> int:
        """The shared state was downloaded: the next ``load`` replaces the local copy whole. Returns the samples
        the local copy learned from that no committed round has taken (fragments; 0 for whole-model rounds, whose
        pending contributions the caller discards itself)."""
        self._synced = None
        lost = max(self._samples) if self.plan is not None else 0
        self._samples = [0] * len(self._samples)
        return lost

    def pseudo_gradient(
        self, start: TrainingState, phase_epoch: int, phase_samples: int
    ) -> tuple[list[torch.Tensor], int]:
        """After a phase of ``phase_samples`` samples for the round of ``phase_epoch``: (Δ, its weight in samples).

        Whole-model rounds: Δ = start − θ_local over every parameter, weight ``phase_samples``. Fragments: Δ_p of
        fragment ``phase_epoch mod F`` from the shared θ ``start`` (fp32 CPU, the fragment's names in state order),
        weight: the samples since the local copy took θ_p.

        Raises:
            ValueError: Δ is not finite (the inner phase diverged) or the model and state do not match.
        """
        if self.plan is None:
            return pseudo_gradient(start, self.model), phase_samples
        for p in range(len(self._samples)):
            self._samples[p] += phase_samples
        p = self.plan.fragment_of(phase_epoch)
        return fragment_pseudo_gradient(start, self.model, self.plan.fragments[p]), self._samples[p]
