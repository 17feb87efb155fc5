"""Stochastic wiring and bans: which server of a stage gets the next microbatch. Pure; time and randomness injected.

SWARM parallelism (Ryabinin et al., ICML 2023, Sec. 3.2) sends each microbatch to a server of the next stage chosen
at random with probability proportional to the server's throughput, so faster servers get more work and a slow or
dead server costs only the microbatches it held. Here the weight also divides by the work already waiting there:

    weight(server) = throughput / (1 + announced queue length + microbatches this trainer has in flight there)

A server that fails a call (timeout, connection error, malformed or non-finite output) is banned on the one ban list
(``hivetrain.peers.bans``): it gets no microbatch until ``now + ban_base_s * 2**(strikes - 1)`` (at most
``ban_max_s``); a success clears its strikes.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping

from hivetrain.peers.bans import BanList
from hivetrain.swarm.announce import StageRecord

DEFAULT_THROUGHPUT = 1.0
"""Throughput assumed for a server that has not measured itself yet (microbatches/s)."""


def server_weight(record: StageRecord, local_inflight: int = 0) -> float:
    """Routing weight of a server: throughput over (1 + queued work). Unmeasured servers get a default throughput."""
    throughput = record.throughput if record.throughput > 0 else DEFAULT_THROUGHPUT
    return throughput / (1.0 + record.queue_len + local_inflight)


def choose_server(
    records: Iterable[StageRecord],
    stage: int,
    now: float,
    bans: BanList,
    rng: random.Random,
    inflight: Mapping[str, int] | None = None,
    exclude: Iterable[str] = (),
) -> tuple[StageRecord | None, str]:
    """Pick a server of ``stage`` at random, proportionally to ``server_weight``.

    Args:
        records: live stage records (any stages; only ``stage``'s serving ones are candidates).
        now: the time ``bans`` are checked against.
        bans: servers to skip while banned.
        rng: the random source (seeded in tests).
        inflight: peer_id -> microbatches this trainer currently has at that server.
        exclude: peer IDs not to use for this call (e.g. the one that just failed it).

    Returns:
        (record, reason): the chosen server, or None and why none could be chosen.
    """
    inflight = inflight or {}
    excluded = set(exclude)
    stage_records = [r for r in records if r.stage == stage]
    candidates = [
        r
        for r in stage_records
        if r.status == "serving" and r.peer_id not in excluded and not bans.is_banned(r.peer_id, now)
    ]
    if not candidates:
        if not stage_records:
            return None, f"no server announces stage {stage}"
        busy = sum(r.status != "serving" for r in stage_records)
        banned = sum(bans.is_banned(r.peer_id, now) for r in stage_records)
        return None, f"stage {stage}: {len(stage_records)} server(s), {busy} not serving, {banned} banned"
    weights = [server_weight(r, inflight.get(r.peer_id, 0)) for r in candidates]
    chosen = rng.choices(candidates, weights=weights, k=1)[0]
    share = weights[candidates.index(chosen)] / sum(weights)
    return chosen, f"stage {stage}: {chosen.peer_id[:12]} (p={share:.2f} of {len(candidates)} candidates)"
