"""Which role a volunteer takes in a pipelined run: a pure decision from the stage records and ``now``.

``join-swarm ADDRESS`` joins a pipelined run (its run config has a ``[swarm]`` table) as one of two roles:

* a **stage server** (``StageServer``) holds one stage's parameters and computes microbatches for trainers;
* a **pipeline trainer** (``PipelineTrainer``) holds data and pushes microbatches through one server per stage.

With ``--role auto`` (the default) ``decide_role`` serves while some stage has fewer than
``swarm.min_servers_per_stage`` live servers (the pipeline cannot train without every stage), at the stage that
``rebalance.choose_stage`` names (the least throughput: the bottleneck), and trains once every stage is served, if
the peer holds the run's data; a peer without the data serves the bottleneck stage.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from hivetrain.swarm.announce import StageRecord
from hivetrain.swarm.config import SwarmConfig
from hivetrain.swarm.rebalance import choose_stage

Role = Literal["server", "trainer"]
RoleRequest = Literal["server", "trainer", "auto"]


@dataclass(frozen=True)
class RoleDecision:
    """Args:
    role: "server" or "trainer".
    stage: the stage a server serves; None = a trainer, or a server that picks its stage itself when it starts
        (``StageServer(stage=None)`` runs ``choose_stage`` on fresher records).
    reason: for people (logs); nothing branches on it.
    """

    role: Role
    stage: int | None
    reason: str


def served_counts(records: Iterable[StageRecord], num_stages: int, now: float, max_age_s: float) -> list[int]:
    """Live servers of each stage: records updated within ``max_age_s`` seconds of ``now``, not moving."""
    counts = [0] * num_stages
    for record in records:
        if now - record.updated_at <= max_age_s and record.status != "moving" and record.stage < num_stages:
            counts[record.stage] += 1
    return counts


def decide_role(
    request: RoleRequest,
    records: Iterable[StageRecord],
    swarm: SwarmConfig,
    now: float,
    *,
    has_data: bool,
    stage: int | None = None,
) -> RoleDecision:
    """The role of a peer joining a pipelined run.

    Args:
        request: "server" or "trainer" to force a role, "auto" to let the swarm's needs decide.
        records: the run's stage records (``announce.fetch_stage_records``).
        swarm: the run's pipeline settings (``num_stages`` >= 1).
        now: unix seconds, for record freshness (``swarm.record_ttl_s``).
        has_data: whether this peer can read the run's training data (``data.paths``).
        stage: a stage to serve (``--stage``); None = the bottleneck stage.

    Returns:
        The decision; ``stage`` is set for a server whose stage is decided here.

    Raises:
        ValueError: ``stage`` outside [0, num_stages), a forced trainer without the data, or a stage given to a
            trainer.
    """
    records = list(records)
    num_stages = swarm.num_stages
    if stage is not None and not 0 <= stage < num_stages:
        raise ValueError(f"--stage {stage}: this run has stages 0..{num_stages - 1}")
    if request == "trainer":
        if stage is not None:
            raise ValueError("--stage is for stage servers; drop it or use --role server")
        if not has_data:
            raise ValueError("--role trainer needs the run's training data (data.paths) on this machine")
        return RoleDecision("trainer", None, "asked to train (--role trainer)")
    if stage is not None:
        return RoleDecision("server", stage, f"asked to serve stage {stage}")
    if request == "server":
        chosen, why = choose_stage(records, num_stages, now, swarm.record_ttl_s)
        return RoleDecision("server", chosen, f"asked to serve (--role server); {why}")
    counts = served_counts(records, num_stages, now, swarm.record_ttl_s)
    short = [s for s in range(num_stages) if counts[s] < swarm.min_servers_per_stage]
    if short or not has_data:
        chosen, why = choose_stage(records, num_stages, now, swarm.record_ttl_s)
        need = (
            f"stage(s) {short} have fewer than {swarm.min_servers_per_stage} server(s)"
            if short
            else "this peer does not hold the run's data"
        )
        return RoleDecision("server", chosen, f"{need}: serving; {why}")
    enough = f"every stage has >= {swarm.min_servers_per_stage} server(s) {counts}"
    return RoleDecision("trainer", None, f"{enough}: training")
