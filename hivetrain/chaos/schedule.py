"""When faults fire: pure functions of the scenario, the metrics events seen so far and ``now_s``.

Times are seconds since the swarm started (the coordinator's launch). The runner calls ``due_faults`` a few times a
second and applies what it returns; nothing here does I/O, so the schedule is tested offline.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from hivetrain.chaos.fault_models import LAUNCH_TIME_KINDS, ChurnFault
from hivetrain.chaos.scenario import Scenario


@dataclass(frozen=True)
class Observed:
    """One metrics event of a peer, as the runner saw it.

    Attributes:
        peer: the peer's index (None for peers started by churn).
        event: the event name ("inner_phase", "outer_step", ...).
        epoch: the peer's epoch when it emitted the event (for "outer_step": the epoch just committed into).
        t_s: seconds since the swarm started.
    """

    peer: int | None
    event: str
    epoch: int
    t_s: float


def trigger_time(fault, events: Iterable[Observed]) -> tuple[float | None, str]:
    """When ``fault`` should fire (seconds since start), or None while its trigger has not happened.

    Returns:
        (time or None, reason).
    """
    if fault.kind in LAUNCH_TIME_KINDS:
        return 0.0, "armed at launch"
    if fault.at_s is not None:
        return fault.at_s + fault.delay_s, f"at {fault.at_s:g}s" + (f" + {fault.delay_s:g}s" if fault.delay_s else "")
    for e in events:
        if e.event != fault.on_event:
            continue
        if fault.on_peer is not None and e.peer != fault.on_peer:
            continue
        if fault.on_epoch is not None and e.epoch < fault.on_epoch:
            continue  # at that epoch or later: a peer that missed its round and caught up by download still triggers
        who = f"peer {e.peer}" if e.peer is not None else "a churn peer"
        return e.t_s + fault.delay_s, f"{who} emitted {e.event} at epoch {e.epoch} ({e.t_s:.1f}s) + {fault.delay_s:g}s"
    return None, f"waiting for {fault.on_event}"


def due_faults(
    pending: Sequence[int], scenario: Scenario, events: Sequence[Observed], now_s: float
) -> list[tuple[int, str]]:
    """The indices (into ``scenario.faults``) among ``pending`` that should fire now, in order, with reasons."""
    due = []
    for index in pending:
        when, reason = trigger_time(scenario.faults[index], events)
        if when is not None and when <= now_s:
            due.append((when, index, reason))
    return [(index, reason) for _, index, reason in sorted(due)]


@dataclass(frozen=True)
class ChurnStep:
    """One planned churn event: at ``t_s``, a join or a kill (victim ``victim_rank`` in [0, 1) of the live peers)."""

    t_s: float
    action: Literal["join", "kill"]
    victim_rank: float


def churn_plan(fault: ChurnFault, start_s: float, seed: int) -> list[ChurnStep]:
    """The seeded plan of a churn fault: Poisson arrivals over ``[start_s, start_s + duration_s)``, each a join or
    a kill with equal probability. The same (fault, start_s, seed) always gives the same plan."""
    rng = random.Random(f"churn|{seed}|{fault.mean_interval_s}|{fault.duration_s}")
    steps, t = [], start_s
    while True:
        t += rng.expovariate(1.0 / fault.mean_interval_s)
        if t >= start_s + fault.duration_s:
            return steps
        steps.append(ChurnStep(t_s=t, action=rng.choice(("join", "kill")), victim_rank=rng.random()))


def churn_decision(
    step: ChurnStep, live: Sequence[int], protected: Iterable[int], min_peers: int, max_peers: int
) -> tuple[Literal["join", "kill", "skip"], int | None, str]:
    """Apply a planned step to the live peers: a kill that would leave fewer than ``min_peers`` becomes a join, a
    join that would exceed ``max_peers`` becomes a kill. ``protected`` peers (byzantine ones) are never killed.

    Args:
        live: ids of the live peers (any stable ids; sorted here).
        protected: ids that must not be chosen as victims.

    Returns:
        (action, victim id or None, reason).
    """
    action = step.action
    if action == "kill" and len(live) <= min_peers:
        action, why = "join", f"kill planned but only {len(live)} live (min {min_peers})"
    elif action == "join" and len(live) >= max_peers:
        action, why = "kill", f"join planned but {len(live)} live (max {max_peers})"
    else:
        why = "as planned"
    if action == "join":
        return "join", None, why
    protected = set(protected)
    candidates = sorted(p for p in live if p not in protected)
    if not candidates or len(live) <= min_peers:
        return "skip", None, f"{why}; no peer may be killed"
    return "kill", candidates[int(step.victim_rank * len(candidates))], why
