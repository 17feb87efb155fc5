"""Where a stage server should serve: pure decisions from the announced records and ``now``.

A pipeline runs at the speed of its slowest stage, so its throughput is min over stages of the summed throughput of
the stage's servers (microbatches/s). SWARM (Ryabinin et al., ICML 2023, Sec. 3.3) periodically moves servers from the
stage with the most throughput to the bottleneck stage. ``decide_move`` moves this server only when

* its stage is the one with the most throughput and another stage is the bottleneck,
* its stage keeps at least ``min_servers_per_stage`` servers,
* among its stage's servers, moving it leaves the two stages best balanced (ties: lowest peer ID), so servers
  that all see the same records do not all move at once,
* after the move, both the bottleneck stage and the stage it leaves have more throughput than the bottleneck had, by
  more than ``margin`` times the mover's estimated throughput at the bottleneck (0.2 = a fifth of what it brings).

The rule is pairwise (the donor and the bottleneck), not the pipeline's minimum: when several stages tie at the
bottleneck, no single move raises the minimum, and a rule on the pipeline's gain never moved anyone out of a skewed
placement (the swarm simulation, ``scenarios/sim/swarm-100.toml`` without churn: stuck at 56 of 100 servers on stage
0). The margin is relative to the mover, not to the pipeline: one server of k in a stage changes it by about 1/k, so
a margin on the pipeline's relative gain (this module's rule until 2026-11-26) never let a server move once stages
had ~5 servers or more. A move happens while the two stages differ by more than about one server's worth and stops
near balance (the donor would fall below the bottleneck's throughput); the margin absorbs noise in the announced
throughput estimates. Servers on their way to a stage count there (``StageRecord.moving_to``), so the next decisions
do not send more servers to a bottleneck that is already being relieved.

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
    """Fresh records; a moving server counts at the stage it moves to (with the throughput it measured at its old
    stage), so that the servers deciding while it downloads see the bottleneck it is about to relieve."""
    live = []
    for r in records:
        if now - r.updated_at > max_age_s:
            continue
        if r.status != "moving":
            live.append(r)
        elif r.moving_to is not None:
            live.append(r.model_copy(update={"stage": r.moving_to}))
    return live


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
        margin: after the move, the donor and the bottleneck stage must both exceed the bottleneck's throughput by
            more than this fraction of the mover's estimated throughput at the bottleneck (0.2 = 20%).
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
    at_mine = [r for r in live if r.stage == my_stage]
    mine = sorted((r for r in at_mine if r.status != "moving"), key=lambda r: r.peer_id)  # movers: not arrived yet
    if not mine or len(at_mine) - 1 < min_servers_per_stage:
        return None, f"stage {my_stage} would keep fewer than {min_servers_per_stage} server(s)"
    same_stage_tp = totals[my_stage] / len(at_mine)
    target_servers = [r for r in live if r.stage == bottleneck]
    ratio = (totals[bottleneck] / len(target_servers)) / same_stage_tp if target_servers else 1.0

    def after_move(record: StageRecord) -> tuple[float, float]:
        """(the lower of the donor's and the bottleneck's throughput after ``record`` moves, the pipeline's)."""
        new = list(totals)
        new[my_stage] -= _throughput(record)
        new[bottleneck] += _throughput(record) * ratio
        return min(new[my_stage], new[bottleneck]), pipeline_throughput(new)

    best = min(mine, key=lambda r: (-after_move(r)[0], r.peer_id))
    if my_peer_id is not None and best.peer_id != my_peer_id:
        return None, f"{best.peer_id[:12]} is the better server of stage {my_stage} to move"
    pair_after, pipeline_after = after_move(best)
    brings = _throughput(best) * ratio  # the mover's estimated throughput at the bottleneck stage, mb/s
    summary = (
        f"stage throughputs {[round(t, 2) for t in totals]} mb/s: moving stage {my_stage} -> {bottleneck} leaves "
        f"both at >= {pair_after:.2f} mb/s (bottleneck now {totals[bottleneck]:.2f}; the mover brings {brings:.2f}); "
        f"the pipeline goes from {pipeline_throughput(totals):.2f} to {pipeline_after:.2f} mb/s"
    )
    if pair_after - totals[bottleneck] <= margin * brings:
        return None, f"{summary}: not above the {margin:.0%} margin"
    return bottleneck, summary
