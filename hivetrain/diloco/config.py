"""DiLoCo's settings (a table ``[diloco]`` of the run's TOML file): the inner and outer optimizers, the schedule,
overlap, precision and how rounds carry over."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

_STRICT = ConfigDict(extra="forbid")


FRAGMENT_MIX_DEFAULT = 0.5
"""``diloco.fragment_mix``'s default (measured: see its docstring)."""
MAX_DOWNLOADERS_DEFAULT = 16
"""``diloco.max_downloaders``'s default: peers one donor serves at once (measured: dev/LOG.md, 2026-11-29)."""


@dataclass(frozen=True, config=_STRICT)
class DilocoConfig:
    """DiLoCo hyper-parameters (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of LMs").

    Args:
        inner_steps: H, inner AdamW steps between outer steps.
        inner_lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warmup of the inner learning rate, in inner steps.
        total_inner_steps: length of the cosine decay in inner steps; 0 = outer_steps * inner_steps.
        min_lr_ratio: floor of the cosine decay as a fraction of inner_lr (kept > 0 so open-ended runs still learn).
        grad_clip: max global gradient norm per inner step; 0 = no clipping.
        outer_lr: outer SGD learning rate. Default 1.0 with ``outer_momentum`` 0: plain averaging of the peers'
            updates, the best or within noise of the best setting at every length that
            ``scripts/bench/diloco_vs_ddp.py`` measured (10 to 120 outer steps, tiny and small presets; dev/LOG.md,
            2026-11-25). The paper's 0.7 with momentum 0.9 (tuned on a 150M model, H = 500) ended 5-14 points
            further behind tuned data parallelism there (e.g. +11.1% vs +5.6% eval loss at 10 outer steps).
        outer_momentum: outer Nesterov momentum (see ``outer_lr``; paper: 0.9).
        outer_steps: stop after this many outer steps (epochs; with ``fragments`` each is one fragment's, so F of
            them make one round of every parameter); 0 = train until stopped.
        eval_every: evaluate on the held-out windows every this many outer steps (epochs, as ``outer_steps``); 0 =
            only at start and end.
        schedule: when a peer ends its inner phase. "swarm" (default): when the samples that all live peers have
            computed at this epoch reach ``target_samples_per_epoch`` (estimated from the progress and throughput
            every peer publishes, as hivemind's ``ProgressTracker``), so every peer ends at about the same time and a
            fast peer runs more inner steps than a slow one (Async Local-SGD's dynamic local updates, Liu et al.
            2024). "steps": every peer runs exactly ``inner_steps`` inner steps (the paper's fixed H; slow peers
            arrive late).
        target_samples_per_epoch: the swarm's samples per epoch for ``schedule = "swarm"``; 0 = ``inner_steps *
            data.batch_size * grad_accum_steps`` times the number of live trainers at the epoch (equal peers then run
            H steps each).
        overlap: "off" = the peer waits for its epoch's round before the next inner phase. "delayed" = the next inner
            phase starts at once from the newest shared θ while the round runs in the background (the averaged
            update lands one epoch late). "eager" = the same, but the next phase starts from θ advanced by an
            estimate of the average in flight: the previous average with our own share replaced by our new
            pseudo-gradient (Kale et al. 2025, "Eager updates for overlapped communication and computation in
            DiLoCo"). The shared state stays bit-identical across peers in every mode.
        precision: the compute precision of the inner steps' forward and backward passes (``diloco/inner.py``).
            "auto" (default): bf16 autocast on CUDA GPUs with native bf16 (compute capability 8.0+), fp16 autocast
            with a gradient scaler on older CUDA GPUs, fp32 on CPUs and other devices (so CPU peers compute exactly
            as without autocast). "fp32": no autocast anywhere. "bf16": bf16 autocast on every peer, CPUs included
            (torch autocasts there too; slow on CPUs without bf16 instructions). "fp16": fp16 autocast with a
            gradient scaler (steps with Inf/NaN gradients are skipped and counted); a peer without a CUDA GPU
            refuses to start with a ValueError rather than silently train in another precision. Parameters, AdamW
            state, θ, the outer momentum and the pseudo-gradient stay fp32 in every mode, so peers of one run may
            use different precisions (mixed GPU/CPU swarms: keep "auto") and still hold bit-identical state. Why:
            bf16 autocast roughly halves activation memory and runs on a GPU's tensor cores.
        grad_accum_steps: microbatches per inner step (gradient accumulation). Each inner step averages the
            gradients of ``grad_accum_steps`` microbatches of ``data.batch_size`` windows, so an inner step
            trains on ``data.batch_size * grad_accum_steps`` samples (the weight a peer claims counts them all)
            while activations are held for one microbatch. Default 1 (no accumulation). Why: a large batch that
            does not fit in device memory.
        max_carried_phases: the most inner phases one contribution holds. A round that fails while nobody moved on
            carries the peer's pseudo-gradient into its next round, merged with the next phase's as their
            sample-weighted mean (``diloco.rounds.Contribution``); when a new phase would make more than this many,
            the oldest carried phase is dropped and counted in ``samples_discarded``. 1 = never carry. Default 4:
            phases carried at one epoch are estimates of one update from one θ, so each more only averages noise
            down (the mean of k has sqrt(1/k) of one's noise: the 5th phase would cut it by 11% more, the 2nd by
            29%), while the peer trains for k phases without an outer step and holds one fp32 copy of the
            parameters per phase; four phases cover rounds missed for three phases in a row (issue 22 saw six, on
            a machine at load 7-18 whose matchmaking could not converge).
        max_downloaders: a peer serves its state's chunks to at most this many downloading peers at once (0 = no
            cap; ``diloco.state_sync.StateServer``). A joiner refused as one too many takes its chunks from the other
            holders, so no donor serves more than its share of a flash crowd. Default ``MAX_DOWNLOADERS_DEFAULT``
            (measured in the simulator's flash crowd: dev/LOG.md, 2026-11-29 session 13).
        compile: whether the inner step's forward pass and loss run through ``torch.compile`` (``diloco/inner.py``).
            "auto" (default): on CUDA GPUs, where it roughly doubles tokens/s (dev/LOG.md, 2026-11-28: 0.50x of a
            compiled loop without it), falling back to eager with a warning if compiling fails; off on CPUs, which
            then train exactly as without it. "on": everywhere (CPUs need a C++ compiler for inductor); a failure to
            compile stops the peer with the cause. "off": never. Compiling happens once per process, before the
            first inner phase (its seconds are logged): tens of seconds, less when inductor's cache holds the graph.
            Peers that compile and peers that do not hold bit-identical shared state (only the averaged
            pseudo-gradient touches it).
        activation_checkpointing: keep only each decoder layer's input for the backward pass and recompute the
            rest there (``transformers``' gradient checkpointing, non-reentrant): activations shrink by about the
            layer count (``hivetrain.preflight``), for one more forward pass per step (~1/3 more compute). "auto"
            (default): on only when the memory preflight finds the run does not fit the device without it and does
            with it (logged); off with ``--skip-memory-check``. "on": always. "off": never. The numerics are the
            same either way (the recomputation repeats the forward pass exactly).
        fragments: F, Streaming DiLoCo's fragments (Douillard et al. 2025, arXiv 2501.18512; ``diloco/fragments.py``):
            the parameters split into F parts of near equal size whose outer steps take turns, one every
            ``inner_steps`` / F inner steps, so each part still averages every ``inner_steps`` steps but a round
            carries 1/F of the model (an epoch is then one fragment's outer step). With ``overlap = "delayed"`` each
            fragment's round runs during the next ``inner_steps`` / F steps: the upload rate a peer needs to hide
            its rounds behind compute falls F times. Default 1 (whole-model rounds). Needs ``inner_steps`` a
            multiple of F, the butterfly strategy, and overlap "off" or "delayed".
        fragment_mix: α, how a fragment's new shared θ enters the local copy once its round overlapped inner steps
            (``overlap = "delayed"``): θ_local ← α·θ_local + (1 − α)·θ, keeping part of what those steps learned
            (Streaming DiLoCo Sec. 2.3); 0 = replaced. Default 0.5, the paper's and the better of {0, 0.5} on the
            learning-per-byte bench (``--plan fragments``, tiny, F = 4, H = 40, seed 0: 1.973 against 1.987; dev/LOG.md,
            session 40). Without overlap the local copy is always replaced (another value is refused).
        eval_overlap: where the evaluation after an outer step runs (``diloco/eval_worker.py``). "auto" (default):
            on CUDA on a thread of its own, on a replica of the model (one more fp32 copy of the parameters on the
            GPU) and its own CUDA stream, while the next inner phase trains, reported as an ``eval`` event per
            epoch; on CPUs on the trainer's thread between phases (a CPU evaluation takes the cores the inner steps
            use: overlapping only moves the time). "on": in the background on any device. "off": never. An FSDP
            node always evaluates between phases (its evaluation is a collective of all ranks).
    """

    inner_steps: int = Field(default=50, ge=1, le=1_000_000)
    inner_lr: float = Field(default=1e-3, gt=0.0, le=1.0)
    weight_decay: float = Field(default=0.1, ge=0.0, le=1.0)
    warmup_steps: int = Field(default=20, ge=0)
    total_inner_steps: int = Field(default=0, ge=0)
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    grad_clip: float = Field(default=1.0, ge=0.0)
    outer_lr: float = Field(default=1.0, gt=0.0, le=10.0)
    outer_momentum: float = Field(default=0.0, ge=0.0, lt=1.0)
    outer_steps: int = Field(default=0, ge=0)
    eval_every: int = Field(default=1, ge=0)
    schedule: Literal["steps", "swarm"] = "swarm"
    target_samples_per_epoch: int = Field(default=0, ge=0)
    overlap: Literal["off", "delayed", "eager"] = "off"
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    grad_accum_steps: int = Field(default=1, ge=1, le=4096)
    max_carried_phases: int = Field(default=4, ge=1, le=64)
    max_downloaders: int = Field(default=MAX_DOWNLOADERS_DEFAULT, ge=0, le=4096)
    compile: Literal["auto", "on", "off"] = "auto"
    activation_checkpointing: Literal["auto", "on", "off"] = "auto"
    eval_overlap: Literal["auto", "on", "off"] = "auto"
    fragments: int = Field(default=1, ge=1, le=4096)
    fragment_mix: float = Field(default=FRAGMENT_MIX_DEFAULT, ge=0.0, lt=1.0)

    def __post_init__(self) -> None:
        if self.inner_steps % self.fragments:
            raise ValueError(
                f"diloco.inner_steps = {self.inner_steps} is not a multiple of diloco.fragments = {self.fragments}: "
                "each fragment averages every inner_steps steps, one every inner_steps / fragments; change either"
            )
        if self.fragments > 1 and self.overlap == "eager":
            raise ValueError(
                "diloco.fragments > 1 with diloco.overlap = 'eager': the eager estimate is of a whole-model round; "
                "fragments overlap their rounds with overlap = 'delayed' (their own start point is the local copy)"
            )
        if self.fragment_mix != FRAGMENT_MIX_DEFAULT and (self.fragments == 1 or self.overlap == "off"):
            raise ValueError(
                "diloco.fragment_mix mixes a fragment's average into the local copy after its round overlapped inner "
                "steps: it needs diloco.fragments > 1 and diloco.overlap = 'delayed'"
            )

    @property
    def phase_steps(self) -> int:
        """Inner steps per epoch: H, or H / F with fragments (one fragment's outer step per epoch)."""
        return self.inner_steps // self.fragments

    def samples_per_inner_step(self, batch_size: int) -> int:
        """Samples (windows) one inner step trains on: ``batch_size`` (``data.batch_size``) * ``grad_accum_steps``."""
        return batch_size * self.grad_accum_steps

    def schedule_length(self) -> int:
        """Inner steps over which the cosine schedule decays (at least the warmup)."""
        length = self.total_inner_steps or self.outer_steps * self.phase_steps or 100_000
        return max(length, self.warmup_steps + 1)
