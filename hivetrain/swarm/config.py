"""Configuration of a SWARM pipeline (stage servers and pipeline trainers): the ``[swarm]`` table of a run's TOML.

A run is pipelined when its config has a ``[swarm]`` table (``RunConfig.swarm.num_stages`` >= 1); without one,
``RunConfig.swarm`` is ``NOT_PIPELINED`` (``num_stages = 0``) and the run is data-parallel DiLoCo.

The rest of the run (model preset, seed, data, DiLoCo and averaging hyper-parameters) comes from ``RunConfig``:
``data.batch_size`` windows form one trainer step, cut into microbatches of ``microbatch_size`` windows; each stage
runs DiLoCo with ``diloco`` (inner AdamW steps, outer Nesterov step averaged among the stage's servers).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Literal

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

_STRICT = ConfigDict(extra="forbid")

Compression = Literal["none", "fp16", "uint8"]


@dataclass(frozen=True, config=_STRICT)
class SwarmConfig:
    """How a model is cut into stages, how microbatches travel and how servers balance and train.

    Args:
        num_stages: S, pipeline stages (stage 0 holds the embedding, stage S-1 the final norm and LM head);
            0 = not pipelined (``NOT_PIPELINED``: the run has no ``[swarm]`` table and every other field keeps its
            default).
        layers_per_stage: decoder blocks per stage (sums to the model's layer count); empty = as even as possible.
        microbatch_size: windows per microbatch (the unit servers compute and trainers route).
        max_inflight_microbatches: microbatches a trainer keeps in the pipeline at once.
        compression: how activations and their gradients travel: "none" (exact fp32), "fp16" or "uint8"
            (hivemind's uniform 8-bit quantization). Token ids always travel uncompressed.
        request_timeout_s: one forward or backward call to one server, seconds; a call past it is rerouted.
        step_timeout_s: a whole trainer step (all microbatches, retries included), seconds.
        max_attempts_per_hop: servers tried for one stage of one microbatch before the step fails.
        ban_base_s: first ban of a failing server, seconds; doubles with every further failure.
        ban_max_s: longest ban, seconds.
        announce_interval_s: a server refreshes its DHT record this often, seconds.
        record_ttl_s: records expire after this many seconds (a dead server disappears from routing).
        rebalance_interval_s: a server considers moving to another stage this often, seconds; 0 = never.
        rebalance_margin: move only if the pipeline throughput estimate improves by more than this fraction of the
            moving server's own estimated throughput at the target stage (``swarm.rebalance.decide_move``).
        rebalance_cooldown_s: a server does not move again within this many seconds of joining or moving.
        microbatches_per_inner_step: a server applies an inner AdamW step after accumulating this many
            microbatches' gradients; 0 = never (gradients only accumulate; tests read them).
        average_stage: run DiLoCo's outer step among a stage's servers every ``diloco.inner_steps`` inner steps.
        device: "cpu", "cuda" or "auto" (cuda when available) for a server's stage.
        num_threads: torch intra-op threads of a server or trainer process; 0 = torch's default (join-swarm's
            ``--threads`` wins when given).
        trainer_steps: steps each pipeline trainer runs before it leaves; 0 = until stopped (SIGINT/SIGTERM).
        min_servers_per_stage: a volunteer joining with ``join-swarm --role auto`` serves a stage until every stage
            has this many serving servers, and trains (if it holds the data) once they do.
    """

    num_stages: int = Field(default=3, ge=0, le=256)
    layers_per_stage: tuple[int, ...] = ()
    microbatch_size: int = Field(default=4, ge=1, le=4096)
    max_inflight_microbatches: int = Field(default=4, ge=1, le=1024)
    compression: Compression = "fp16"
    request_timeout_s: float = Field(default=10.0, gt=0.0, le=3600.0)
    step_timeout_s: float = Field(default=120.0, gt=0.0, le=86400.0)
    max_attempts_per_hop: int = Field(default=8, ge=1, le=1000)
    ban_base_s: float = Field(default=2.0, gt=0.0)
    ban_max_s: float = Field(default=60.0, gt=0.0)
    announce_interval_s: float = Field(default=1.0, gt=0.0, le=600.0)
    record_ttl_s: float = Field(default=5.0, gt=0.0, le=600.0)  # RecordBounds.max_record_ttl_s: longer is refused
    rebalance_interval_s: float = Field(default=10.0, ge=0.0)
    rebalance_margin: float = Field(default=0.2, ge=0.0, le=100.0)
    rebalance_cooldown_s: float = Field(default=30.0, ge=0.0)
    microbatches_per_inner_step: int = Field(default=4, ge=0)
    average_stage: bool = True
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    num_threads: int = Field(default=0, ge=0, le=1024)
    trainer_steps: int = Field(default=0, ge=0)
    min_servers_per_stage: int = Field(default=1, ge=1, le=1024)

    @property
    def pipelined(self) -> bool:
        """Whether these settings describe a pipeline (``num_stages`` >= 1)."""
        return self.num_stages >= 1

    def __post_init__(self) -> None:
        if self.layers_per_stage and len(self.layers_per_stage) != self.num_stages:
            raise ValueError(
                f"swarm.layers_per_stage has {len(self.layers_per_stage)} entries for swarm.num_stages "
                f"= {self.num_stages}"
            )
        if any(n < 0 for n in self.layers_per_stage):
            raise ValueError("swarm.layers_per_stage entries must be >= 0")
        if self.record_ttl_s <= self.announce_interval_s:
            raise ValueError(
                f"swarm.record_ttl_s ({self.record_ttl_s}) must exceed swarm.announce_interval_s "
                f"({self.announce_interval_s}), or live servers' records expire between refreshes"
            )
        if self.ban_max_s < self.ban_base_s:
            raise ValueError(f"swarm.ban_max_s ({self.ban_max_s}) must be >= swarm.ban_base_s ({self.ban_base_s})")
        if self.step_timeout_s <= self.request_timeout_s:
            raise ValueError(
                f"swarm.step_timeout_s ({self.step_timeout_s}) must exceed swarm.request_timeout_s "
                f"({self.request_timeout_s})"
            )

    def check_unset(self) -> None:
        """Raise ValueError if ``num_stages`` is 0 (not pipelined) while another field differs from its default:
        a ``[swarm]`` table that sets pipeline fields but ``num_stages = 0`` is a mistake, not a data-parallel run."""
        if self.num_stages == 0 and self != NOT_PIPELINED:
            changed = [f.name for f in fields(self) if getattr(self, f.name) != getattr(NOT_PIPELINED, f.name)]
            raise ValueError(
                f"swarm.num_stages = 0 means not pipelined, but [swarm] also sets {', '.join(changed)}: set "
                "swarm.num_stages >= 1 for a pipelined run, or remove the [swarm] table for a data-parallel one"
            )

    def num_microbatches(self, batch_size: int) -> int:
        """Microbatches in one trainer step of ``batch_size`` windows.

        Raises:
            ValueError: ``batch_size`` is not a multiple of ``microbatch_size``.
        """
        if batch_size % self.microbatch_size:
            raise ValueError(
                f"data.batch_size ({batch_size}) must be a multiple of swarm.microbatch_size ({self.microbatch_size})"
            )
        return batch_size // self.microbatch_size


NOT_PIPELINED = SwarmConfig(num_stages=0)
"""``RunConfig.swarm`` of a data-parallel run (no ``[swarm]`` table)."""
