"""Calibrating the simulation against a real local swarm: one log format for both, figures, fits and the comparison.

``scripts/bench/sim_calibrate.py`` runs ``hivetrain local-swarm`` and then the simulation with the same settings; this
module holds its pure parts, so that they are tested without a swarm:

- ``RunLog``: what happened in a run, real or simulated: each peer's inner phases, commits, failed rounds and state
  downloads, with times in seconds after the swarm started. ``real_log`` builds it from the peers' metrics events
  (``peerK.jsonl``); the script builds the simulated one from observers on the simulation.
- ``figures``: the compared figures over the first ``num_rounds`` round keys (later rounds of a real run are distorted
  by peers that reached their last outer step and left).
- ``fit_speeds`` / ``fit_speed_jitter`` / ``fit_outer_step_s`` / ``fit_round_s``: what the simulation cannot know,
  taken from the real run.
- ``compare``: real against simulated (``median_figures`` over seeds), one row per figure, each with its stated
  tolerance and a verdict.

Peer ``k`` of the simulation is given the speed measured for real ``peerK`` (``peers.compute = "list"``), so per-peer
figures are compared index by index.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Phase:
    """An inner phase of peer ``peer`` for round key ``round_key``: ``samples`` in ``compute_s`` (``wall_s`` with
    pauses), ended at ``end_s``."""

    peer: int
    round_key: int
    end_s: float
    samples: float
    compute_s: float
    wall_s: float = 0.0


@dataclass(frozen=True)
class Commit:
    """Peer ``peer`` applied the round of ``round_key`` at ``time_s`` with ``samples`` of its own, in a group of
    ``group_size`` that committed state ``group`` (a hash); ``round_s``: its averaging call's duration (real runs)."""

    peer: int
    round_key: int
    time_s: float
    samples: float
    group_size: int
    group: str
    round_s: float = 0.0


@dataclass(frozen=True)
class Failure:
    """A failed round attempt of ``peer`` at ``round_key`` (``reason``: "late", "alone", "peer_failed", ...)."""

    peer: int
    round_key: int
    time_s: float
    reason: str


@dataclass
class RunLog:
    """A run's events, seconds after the swarm started. ``starts_s[k]``: when peer k started training."""

    num_peers: int
    starts_s: list[float]
    phases: list[Phase] = field(default_factory=list)
    commits: list[Commit] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    downloads: list[tuple[int, float]] = field(default_factory=list)  # (peer, time_s)


def failure_reason(event: dict) -> str:
    """The matchmaking verdict or failure of a ``round_failed`` event, as the simulation names it: the averaging
    engine reports ``decide``'s "late" as reason "not_in_group" (``averaging.engine._FAILURES``); its detail keeps
    ``decide``'s text, "... closed at T before we announced", which only "late" says."""
    reason = str(event.get("reason", ""))
    return "late" if "before we announced" in str(event.get("detail", "")) else reason


def real_log(events_by_peer: list[list[dict]]) -> RunLog:
    """A ``RunLog`` from each real peer's metrics events (``peerK.jsonl`` as dicts, in peer order).

    An ``outer_step`` event's ``epoch`` is the epoch after the commit: its round key is ``epoch - 1``; a
    ``round_failed`` event's ``epoch`` is the round key it failed at. Time 0 is the earliest ``start`` event.

    Raises:
        ValueError: a peer without a ``start`` event (it never trained: nothing to calibrate on).
    """
    starts = []
    for k, events in enumerate(events_by_peer):
        start = next((e["time"] for e in events if e.get("event") == "start"), None)
        if start is None:
            raise ValueError(f"peer{k} has no start event")
        starts.append(float(start))
    t0 = min(starts, default=0.0)
    log = RunLog(len(events_by_peer), [s - t0 for s in starts])
    for k, events in enumerate(events_by_peer):
        for e in events:
            kind, t = e.get("event"), float(e.get("time", t0)) - t0
            if kind == "inner_phase":
                log.phases.append(Phase(k, int(e.get("round_key", e["epoch"])), t, float(e["samples"]),
                                        float(e["compute_s"]), float(e.get("wall_s", e["compute_s"]))))  # fmt: skip
            elif kind == "outer_step":
                log.commits.append(Commit(k, int(e["epoch"]) - 1, t, float(e["samples"]), int(e["group_size"]),
                                          str(e["state_hash"]), float(e.get("round_s", 0.0))))  # fmt: skip
            elif kind == "round_failed":
                log.failures.append(Failure(k, int(e["epoch"]), t, failure_reason(e)))
            elif kind == "state_downloaded":
                log.downloads.append((k, t))
    return log


def _median_commit_s(log: RunLog, num_rounds: int) -> dict[int, float]:
    times: dict[int, list[float]] = defaultdict(list)
    for c in log.commits:
        if c.round_key < num_rounds:
            times[c.round_key].append(c.time_s)
    return {r: statistics.median(t) for r, t in times.items()}


def figures(log: RunLog, num_rounds: int) -> dict[str, float | list[float]]:
    """The compared figures over round keys ``0 .. num_rounds - 1`` (window end T: the median commit of the last).

    Returns:
        ``outer_steps_per_peer`` (commits per peer, mean), ``committed_samples`` (total) and
        ``committed_samples_per_peer`` (list, peer order), ``computed_samples`` (phases ended by T),
        ``failed_rounds`` and ``late_verdicts`` (failed attempts, all reasons / "late"), ``state_downloads`` (by T),
        ``group_size_mean`` (over members' commits), ``time_per_outer_step_s`` (median over rounds r >= 1 of the
        gap between the median commits of rounds r - 1 and r), ``utilization`` (mean over peers of compute seconds
        of phases ended by T / (T - the peer's start)), ``window_s`` (T).
    """
    medians = _median_commit_s(log, num_rounds)
    end = medians.get(num_rounds - 1, max((c.time_s for c in log.commits), default=0.0))
    commits = [c for c in log.commits if c.round_key < num_rounds]
    per_peer = [0.0] * log.num_peers
    steps = [0] * log.num_peers
    for c in commits:
        per_peer[c.peer] += c.samples
        steps[c.peer] += 1
    gaps = [medians[r] - medians[r - 1] for r in range(1, num_rounds) if r in medians and r - 1 in medians]
    phases = [p for p in log.phases if p.end_s <= end + 1e-9]
    compute = [0.0] * log.num_peers
    for p in phases:
        compute[p.peer] += p.compute_s
    utilization = [compute[k] / (end - log.starts_s[k]) for k in range(log.num_peers) if end > log.starts_s[k]]
    failures = [f for f in log.failures if f.round_key < num_rounds]
    return {
        "outer_steps_per_peer": sum(steps) / max(log.num_peers, 1),
        "committed_samples": sum(per_peer),
        "committed_samples_per_peer": per_peer,
        "computed_samples": sum(p.samples for p in phases),
        "failed_rounds": float(len(failures)),
        "late_verdicts": float(sum(f.reason == "late" for f in failures)),
        "state_downloads": float(sum(t <= end + 1e-9 for _, t in log.downloads)),
        "group_size_mean": statistics.fmean(c.group_size for c in commits) if commits else 0.0,
        "time_per_outer_step_s": statistics.median(gaps) if gaps else 0.0,
        "utilization": statistics.fmean(utilization) if utilization else 0.0,
        "window_s": end,
    }


def median_figures(runs: list[dict]) -> dict:
    """The median of each figure over several simulated runs (seeds); lists element by element.

    Raises:
        ValueError: no runs.
    """
    if not runs:
        raise ValueError("no runs to take the median of")
    out: dict = {}
    for name, first in runs[0].items():
        if isinstance(first, list):
            out[name] = [statistics.median(r[name][k] for r in runs) for k in range(len(first))]
        else:
            out[name] = statistics.median(r[name] for r in runs)
    return out


def fit_speeds(log: RunLog) -> list[float]:
    """Each peer's measured speed, samples/s: its samples over the wall seconds of its inner phases (a duty cycle's
    sleeps count: the simulation has no duty cycle, only speeds), over all its phases.

    Raises:
        ValueError: a peer that computed nothing.
    """
    samples, compute = [0.0] * log.num_peers, [0.0] * log.num_peers
    for p in log.phases:
        samples[p.peer] += p.samples
        compute[p.peer] += max(p.wall_s, p.compute_s)
    if any(c <= 0 or s <= 0 for s, c in zip(samples, compute, strict=True)):
        raise ValueError("every peer must have run inner steps to measure its speed")
    return [s / c for s, c in zip(samples, compute, strict=True)]


def fit_speed_jitter(log: RunLog) -> float:
    """Standard deviation of log(a phase's speed / its peer's speed, ``fit_speeds``) over every inner phase: how much
    a peer's speed varies from phase to phase (``peers.speed_jitter``). 0 with fewer than 2 phases."""
    speeds = fit_speeds(log)
    logs = [math.log(p.samples / max(p.wall_s, p.compute_s) / speeds[p.peer]) for p in log.phases
            if p.samples > 0 and max(p.wall_s, p.compute_s) > 0]  # fmt: skip
    return statistics.pstdev(logs) if len(logs) >= 2 else 0.0


def fit_outer_step_s(log: RunLog) -> float:
    """Median time from the end of a peer's round to the start of its next inner phase, seconds (applying the outer
    step, evaluating, its state check): next phase's end - its wall time - (commit's phase end + round_s). 0 if no
    commit is followed by a phase."""
    phases = defaultdict(list)
    for p in log.phases:
        phases[p.peer].append(p)
    gaps = []
    for c in log.commits:
        own = sorted(phases[c.peer], key=lambda p: p.end_s)
        before = [p for p in own if p.end_s <= c.time_s and p.round_key == c.round_key]
        after = [p for p in own if p.end_s > c.time_s]
        if before and after:
            round_end = before[-1].end_s + c.round_s
            gaps.append(max(0.0, after[0].end_s - after[0].wall_s - round_end))
    return statistics.median(gaps) if gaps else 0.0


def fit_round_s(log: RunLog) -> float:
    """Median over committed groups of the shortest averaging call among the group's members, seconds: the member
    that arrived last waited for nobody, so its call is matchmaking plus the all-reduce, the fixed cost per round.
    0 if no group committed."""
    groups: dict[tuple[int, str], list[float]] = defaultdict(list)
    for c in log.commits:
        if c.group_size > 1:
            groups[(c.round_key, c.group)].append(c.round_s)
    return statistics.median(min(v) for v in groups.values()) if groups else 0.0


@dataclass(frozen=True)
class Tolerance:
    """``kind``: "rel" (|sim - real| <= value x |real|), "abs" (|sim - real| <= value) or "rel_each" (a list:
    every element within value x |real element|)."""

    kind: str
    value: float

    def text(self) -> str:
        return {"rel": f"±{self.value:.0%}", "abs": f"±{self.value:g}", "rel_each": f"each ±{self.value:.0%}"}[
            self.kind
        ]


TOLERANCES: dict[str, Tolerance] = {
    "outer_steps_per_peer": Tolerance("rel", 0.10),
    "committed_samples": Tolerance("rel", 0.10),
    "committed_samples_per_peer": Tolerance("rel_each", 0.25),
    "failed_rounds": Tolerance("abs", 1.0),
    "late_verdicts": Tolerance("abs", 1.0),
    "state_downloads": Tolerance("abs", 1.0),
    "group_size_mean": Tolerance("rel", 0.10),
    "time_per_outer_step_s": Tolerance("rel", 0.20),
    "utilization": Tolerance("abs", 0.10),
}


def within(real: float | list[float], sim: float | list[float], tol: Tolerance) -> bool:
    """Whether ``sim`` is within ``tol`` of ``real`` (lists of unequal length never are)."""
    if tol.kind == "rel_each":
        assert isinstance(real, list) and isinstance(sim, list)
        return len(real) == len(sim) and all(
            abs(s - r) <= tol.value * abs(r) + 1e-9 for r, s in zip(real, sim, strict=True)
        )
    assert not isinstance(real, list) and not isinstance(sim, list)
    bound = tol.value * abs(real) if tol.kind == "rel" else tol.value
    return abs(sim - real) <= bound + 1e-9


@dataclass(frozen=True)
class Row:
    """One line of the side-by-side table."""

    name: str
    real: float | list[float]
    sim: float | list[float]
    tolerance: str
    ok: bool


def compare(real: dict, sim: dict, tolerances: dict[str, Tolerance] = TOLERANCES) -> list[Row]:
    """Real against simulated ``figures``, one ``Row`` per figure that has a tolerance (in that order)."""
    return [Row(name, real[name], sim[name], tol.text(), within(real[name], sim[name], tol))
            for name, tol in tolerances.items()]  # fmt: skip
