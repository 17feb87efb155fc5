"""Where a stage server should serve: pure decisions from the announced records and ``now``.

A pipeline runs at the speed of its slowest stage, so its throughput is min over stages of the summed throughput of
the stage's servers (microbatches/s). SWARM (Ryabinin et al., ICML 2023, Sec. 3.3) periodically moves servers from the
stage with the most throughput to the bottleneck stage. ``decide_move`` moves this server only when

* its stage is the one with the most throughput and another stage is the bottleneck,
* its stage keeps at least ``min_servers_per_stage`` servers,
* among its stage's servers, moving it gives the best new pipeline throughput (ties: lowest peer ID), so servers
  that all see the same records do not all move at once,
* the estimated pipeline throughput improves by more than ``margin`` (a fraction: 0.2 = 20%).

The mover's throughput at the target stage is estimated from the per-server throughput ratio of the two stages
(stages cost differently: the last one also runs the LM head); with no server at the target, equal cost is assumed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from hivetrain.swarm.announce import StageRecord
from hivetrain.swarm.routing import DEFAULT_THROUGHPUT


def _throughput(record: StageRecord) -> float:
    return record.throughput if record.throughput > 0 else DEFAULT_THROUGHPUT


def _live(records: Iterable[StageRecord], now: float, max_age_s: float) -> list[StageRecord]:
    return [r for r in records if now - r.updated_at <= max_age_s and r.status != "moving"]


def stage_throughputs(records: Iterable[StageRecord], num_stages: int) -> list[float]:
    """Summed throughput (microbatches/s) of each stage's servers; 0 for a stage nobody serves."""
    totals = [0.0] * num_stages
    for record in records:
        if record.stage < num_stages:
            totals[record.stage] += _throughput(record)
    return totals


def choose_stage(records: Iterable[StageRecord], num_stages: int, now: float, max_age_s: float) -> tuple[int, str]:
    """The stage a joining server should serve: the one with the least throughput (ties: fewest servers, then
    lowest index). Returns (stage, reason)."""
    live = _live(records, now, max_age_s)
    totals = stage_throughputs(live, num_stages)
    counts = [sum(1 for r in live if r.stage == s) for s in range(num_stages)]
    stage = min(range(num_stages), key=lambda s: (totals[s], counts[s], s))
    return stage, f"stage {stage} has the least throughput ({totals[stage]:.2f} mb/s, {counts[stage]} server(s))"


def pipeline_throughput(totals: list[float]) -> float:
    return min(totals) if totals else 0.0


def decide_move(
    records: Iterable[StageRecord],
    my_stage: int,
    now: float,
    margin: float,
    *,
    my_peer_id: str | None = None,
    num_stages: int | None = None,
    max_age_s: float = math.inf,
    min_servers_per_stage: int = 1,
) -> tuple[int | None, str]:
    """Decide whether a server of ``my_stage`` should move, and where.

    Args:
        records: stage records of the run (this server's included).
        my_stage: the stage this server serves.
        now: current time (unix seconds) for record freshness.
        margin: required relative gain of the pipeline throughput (0.2 = 20%).
        my_peer_id: this server; None = decide for "some server of my_stage" (the best mover is assumed).
        num_stages: S; None = the largest ``num_stages`` the records announce.
        max_age_s: ignore records not updated for this long.
        min_servers_per_stage: never leave a stage with fewer servers.

    Returns:
        (target stage or None, reason).

    Raises:
        ValueError: negative margin or ``my_stage`` out of range.
    """
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    live = _live(records, now, max_age_s)
    num_stages = num_stages or max((r.num_stages for r in live), default=my_stage + 1)
    if not 0 <= my_stage < num_stages:
        raise ValueError(f"my_stage {my_stage} is outside [0, {num_stages})")
    totals = stage_throughputs(live, num_stages)
    bottleneck = min(range(num_stages), key=lambda s: (totals[s], s))
    donor = max(range(num_stages), key=lambda s: (totals[s], -s))
    if bottleneck == my_stage:
        return None, f"stage {my_stage} is the bottleneck ({totals[my_stage]:.2f} mb/s)"
    if donor != my_stage:
        return None, f"stage {donor} has more spare throughput ({totals[donor]:.2f}) than stage {my_stage}"
    mine = sorted((r for r in live if r.stage == my_stage), key=lambda r: r.peer_id)
    if len(mine) - 1 < min_servers_per_stage:
        return None, f"stage {my_stage} would keep fewer than {min_servers_per_stage} server(s)"
    same_stage_tp = totals[my_stage] / len(mine)
    target_servers = [r for r in live if r.stage == bottleneck]
    ratio = (totals[bottleneck] / len(target_servers)) / same_stage_tp if target_servers else 1.0

    def after_move(record: StageRecord) -> float:
        new = list(totals)
        new[my_stage] -= _throughput(record)
        new[bottleneck] += _throughput(record) * ratio
        return pipeline_throughput(new)

    best = min(mine, key=lambda r: (-after_move(r), r.peer_id))
    if my_peer_id is not None and best.peer_id != my_peer_id:
        return None, f"{best.peer_id[:12]} is the better server of stage {my_stage} to move"
    before, after = pipeline_throughput(totals), after_move(best)
    gain = math.inf if before <= 0 < after else (after - before) / before if before > 0 else 0.0
    summary = (
        f"stage throughputs {[round(t, 2) for t in totals]} mb/s: moving stage {my_stage} -> {bottleneck} "
        f"changes the pipeline from {before:.2f} to {after:.2f} mb/s ({gain:+.0%})"
    )
    if gain <= margin:
        return None, f"{summary}, not above the {margin:.0%} margin"
    return bottleneck, summary
