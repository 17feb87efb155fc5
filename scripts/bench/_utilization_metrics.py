"""The utilization bench's figures, computed from join-swarm metrics events (pure functions, no clock, no I/O).

Definitions (every time is unix seconds from the events' ``time`` field; events after ``stop_time`` are ignored):

- A peer's **window** runs from the start of its first inner phase to the stop. Startup (imports, bootstrap, the
  first evaluation) is outside it. The tail after its last completed phase left no event that says how it was spent
  (a phase half done, or waiting on a round): it counts as computing for at most one phase (the peer's median phase
  wall time), the rest as waiting. Before 2026-12-03 the window ended at the last completed phase, so a peer that
  finished two phases and then waited 180 s on a round it never completed (fp32 at 2.5 Mbit/s) scored 0.99.
- **utilization** = (seconds in inner steps within the window / window seconds) / duty cycle: 1.0 means the peer
  computed for its whole share of the machine; a peer waiting on a round, on matchmaking or on slower peers is below.
- **idle_s** = window - compute / duty cycle: seconds neither computing nor resting for its duty cycle.
- **committed sample share** = samples that reached a committed outer step / samples computed for rounds the swarm
  had resolved by the stop (round keys up to the highest committed one). Phases for rounds still open at the stop
  are left out of both: they were neither committed nor lost yet. (Samples of a resolved round that a peer carried
  into a round still open at the stop count as not committed: a small bias against carrying, at the end only.)

Events from older trainers lack some fields; the defaults: ``compute_s`` = samples * seq_len / ``tokens_per_s``,
``wall_s`` = compute_s / duty cycle, ``steps`` = samples / batch size, an ``inner_phase``'s ``round_key`` = its
``epoch``, an ``outer_step``'s round key = ``round_key`` if present else ``epoch`` - 1 (the epoch after the step),
and its ``samples`` = the samples of this peer's phases for that round key.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    """One completed inner phase of one peer (times in unix seconds)."""

    end_s: float
    wall_s: float
    compute_s: float
    steps: int
    samples: int
    round_key: int

    @property
    def start_s(self) -> float:
        return self.end_s - self.wall_s


@dataclass(frozen=True)
class Commit:
    """One committed outer step as one peer saw it."""

    time_s: float
    round_key: int
    samples: int
    round_s: float
    bytes_sent: int
    eval_loss: float | None
    epoch: int


@dataclass(frozen=True)
class PeerUsage:
    """One peer's figures over its window (see the module docstring)."""

    name: str
    duty_cycle: float
    window_s: float
    compute_s: float
    utilization: float
    idle_s: float
    num_phases: int
    samples_resolved: int  # computed for rounds resolved by the stop
    samples_committed: int


def _until(events: Iterable[dict], stop_time: float) -> list[dict]:
    return [e for e in events if e.get("time", 0.0) <= stop_time]


def phases(events: Iterable[dict], seq_len: int, batch_size: int, duty_cycle: float, stop_time: float) -> list[Phase]:
    """The peer's completed inner phases, oldest first, with the module docstring's defaults for missing fields."""
    found = []
    for e in _until(events, stop_time):
        if e.get("event") != "inner_phase":
            continue
        samples = int(e.get("samples", 0))
        compute_s = e.get("compute_s")
        if compute_s is None:
            tokens_per_s = e.get("tokens_per_s") or 0.0
            compute_s = samples * seq_len / tokens_per_s if tokens_per_s > 0 else 0.0
        wall_s = e.get("wall_s") or compute_s / duty_cycle
        found.append(
            Phase(
                end_s=float(e["time"]),
                wall_s=float(wall_s),
                compute_s=float(compute_s),
                steps=int(e.get("steps") or samples // max(batch_size, 1)),
                samples=samples,
                round_key=int(e.get("round_key", e.get("epoch", 0))),
            )
        )
    return sorted(found, key=lambda p: p.end_s)


def commits(events: Iterable[dict], stop_time: float, own_phases: list[Phase] | None = None) -> list[Commit]:
    """The peer's committed outer steps, oldest first; ``own_phases`` supplies ``samples`` for older events."""
    by_key: dict[int, int] = {}
    for p in own_phases or []:
        by_key[p.round_key] = by_key.get(p.round_key, 0) + p.samples
    found = []
    for e in _until(events, stop_time):
        if e.get("event") != "outer_step":
            continue
        key = int(e["round_key"]) if "round_key" in e else int(e.get("epoch", 1)) - 1
        samples = e.get("samples")
        found.append(
            Commit(
                time_s=float(e["time"]),
                round_key=key,
                samples=int(samples if samples is not None else by_key.get(key, 0)),
                round_s=float(e.get("round_s") or 0.0),
                bytes_sent=int(e.get("bytes_sent") or 0),
                eval_loss=e.get("eval_loss"),
                epoch=int(e.get("epoch", key + 1)),
            )
        )
    return sorted(found, key=lambda c: c.time_s)


def peer_usage(
    name: str,
    own_phases: list[Phase],
    own_commits: list[Commit],
    duty_cycle: float,
    last_round_key: int,
    stop_time: float | None = None,
) -> PeerUsage:
    """Utilization, idle seconds and samples of one peer, over the window up to ``stop_time`` (None: up to the end
    of its last completed phase). A peer without a completed phase has utilization 0."""
    if not own_phases:
        return PeerUsage(name, duty_cycle, 0.0, 0.0, 0.0, 0.0, 0, 0, 0)
    last_end = max(p.end_s for p in own_phases)
    end = last_end if stop_time is None else max(stop_time, last_end)
    window_s = end - min(p.start_s for p in own_phases)
    compute_s = sum(p.compute_s for p in own_phases)
    tail_s = end - last_end  # at most one more phase's work in it (module docstring)
    compute_s += min(tail_s, statistics.median(p.wall_s for p in own_phases)) * duty_cycle
    utilization = compute_s / (window_s * duty_cycle) if window_s > 0 else 0.0
    return PeerUsage(
        name=name,
        duty_cycle=duty_cycle,
        window_s=window_s,
        compute_s=compute_s,
        utilization=utilization,
        idle_s=max(0.0, window_s - compute_s / duty_cycle),
        num_phases=len(own_phases),
        samples_resolved=sum(p.samples for p in own_phases if p.round_key <= last_round_key),
        samples_committed=sum(c.samples for c in own_commits if c.round_key <= last_round_key),
    )


def last_eval(all_commits: Iterable[Commit]) -> Commit | None:
    """The newest committed step that carries an eval loss (highest epoch, then latest time), or None."""
    scored = [c for c in all_commits if c.eval_loss is not None]
    return max(scored, key=lambda c: (c.epoch, c.time_s)) if scored else None


def round_vs_phase(all_commits: dict[str, list[Commit]], fastest_phases: list[Phase]) -> tuple[float, float, float]:
    """(median round seconds, median phase wall seconds of the fastest peer, their ratio).

    A round's seconds are the smallest ``round_s`` any member reported for it (the last member to arrive waits the
    least on the others, so its figure is closest to the link's). Zeros when there is nothing to measure.
    """
    by_key: dict[int, float] = {}
    for peer_commits in all_commits.values():
        for c in peer_commits:
            if c.round_s > 0:
                by_key[c.round_key] = min(by_key.get(c.round_key, c.round_s), c.round_s)
    round_s = statistics.median(by_key.values()) if by_key else 0.0
    phase_s = statistics.median(p.wall_s for p in fastest_phases) if fastest_phases else 0.0
    return round_s, phase_s, (round_s / phase_s if phase_s > 0 else 0.0)


def arm_figures(usages: list[PeerUsage]) -> dict:
    """utilization_min, utilization_mean and committed_sample_share of an arm (share None: nothing resolved)."""
    utils = [u.utilization for u in usages]
    resolved = sum(u.samples_resolved for u in usages)
    return {
        "utilization_min": min(utils) if utils else 0.0,
        "utilization_mean": statistics.fmean(utils) if utils else 0.0,
        "committed_sample_share": sum(u.samples_committed for u in usages) / resolved if resolved else None,
    }
