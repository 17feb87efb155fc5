"""The coordinator's view of a pipelined (SWARM) run, folded from the records it polls.

Inputs, all signed and expiring (a signature proves who claims a number, not that it is true):

* ``StageRecord`` (``{run}.swarm.servers``): each server's stage, status, throughput, load, queue;
* ``TrainerReport`` (``{run}.swarm.trainer_reports``): each trainer's counters since it started;
* ``RebalanceReport`` (``{run}.swarm.rebalances``): each server's moves and last rebalance decision.

No claimed counter is taken as is. ``credit_claim`` (pure, ``now`` injected) credits a counter only as an increase
over the claim last seen from the same peer, and at most ``max_rate × elapsed`` of it: elapsed since that claim, or
for a peer seen for the first time since its claimed start, clamped to ``[0, max_first_sight_s]``. A decrease or a
new ``started_at`` is a restart: the claim counts from 0, under the same bound. The excess of a claim over its bound
is never credited later (the next baseline is the claim itself), so a peer that lies once gains at most the bound.
Totals are kept when peers leave; strings are length-capped and control-character-free (``web/pipeline_view.py``);
memory is bounded (``MAX_TRACKED_PEERS``, ``MAX_MOVES_KEPT``). Figures a record merely describes (a server's
throughput and load) are shown as announced: the record's schema bounds them (load in [0, 1]).

Sybil identities each get their own bound; the bound limits what one identity can inflate, not how many there are.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass

import hivemind

from hivetrain.coordinator.web.pipeline_view import (
    PipelineTrainerRow,
    PipelineView,
    RebalanceRow,
    StageRow,
    StageServerRow,
)
from hivetrain.swarm.announce import StageRecord, fetch_stage_records
from hivetrain.swarm.reports import RebalanceReport, TrainerReport, fetch_rebalance_reports, fetch_trainer_reports

MAX_TRACKED_PEERS = 10_000
MAX_MOVES_KEPT = 200
TRAINER_COUNTERS = ("microbatches", "reroutes", "replays", "deaths")


@dataclass(frozen=True)
class CreditLimits:
    """How much of a claimed counter the coordinator credits. Rates are per peer, per second.

    Args:
        max_microbatches_per_s: a trainer's microbatches (a small model on a fast GPU does tens per second).
        max_reroutes_per_s: a trainer's reroutes (at most ``max_attempts_per_hop`` per hop of a microbatch).
        max_replays_per_s: a trainer's replays.
        max_deaths_per_s: servers one trainer declares dead.
        max_rebalances_per_s: one server's moves (a move downloads a stage: seconds at least).
        max_first_sight_s: the longest span credited to a peer seen for the first time, seconds (work it did before
            the coordinator saw it, e.g. before a coordinator restart, is credited up to this span only).
        window_s: the span over which microbatches/s is measured, seconds.

    Raises:
        ValueError: a limit is not positive.
    """

    max_microbatches_per_s: float = 500.0
    max_reroutes_per_s: float = 2000.0
    max_replays_per_s: float = 500.0
    max_deaths_per_s: float = 10.0
    max_rebalances_per_s: float = 1.0
    max_first_sight_s: float = 60.0
    window_s: float = 60.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"CreditLimits.{name} must be > 0, got {value}")

    def rate_of(self, counter: str) -> float:
        return getattr(self, f"max_{counter}_per_s")


@dataclass(frozen=True)
class Baseline:
    """The claim last seen of one counter of one peer: its ``value``, when we saw it (``seen_at``, unix s) and the
    ``started_at`` (unix s) the peer claimed for that count."""

    value: int
    seen_at: float
    started_at: float


def credit_claim(
    baseline: Baseline | None,
    claimed: int,
    started_at: float,
    now: float,
    max_rate_per_s: float,
    max_first_sight_s: float,
) -> tuple[int, Baseline]:
    """How much of a claimed counter to credit, and the new baseline.

    Args:
        baseline: the claim last seen from this peer for this counter; None = first sight.
        claimed: the counter the peer claims now (>= 0, schema-checked).
        started_at: unix time (s) the peer claims it started counting; a change from the baseline's is a restart.
        now: unix time (s) of this observation.
        max_rate_per_s: the most this counter can grow per second.
        max_first_sight_s: at first sight, the span credited at most, seconds.

    Returns:
        (credited >= 0, the baseline to keep: ``Baseline(claimed, now, started_at)``).
    """
    if baseline is None:
        elapsed_s, increase = min(max(now - started_at, 0.0), max_first_sight_s), claimed
    elif started_at != baseline.started_at or claimed < baseline.value:  # restarted: counts from 0 again
        elapsed_s, increase = max(now - baseline.seen_at, 0.0), claimed
    else:
        elapsed_s, increase = max(now - baseline.seen_at, 0.0), claimed - baseline.value
    credited = max(0, min(increase, math.floor(max_rate_per_s * elapsed_s)))
    return credited, Baseline(claimed, now, started_at)


def fetch_pipeline_records(
    dht: hivemind.DHT, run_id: str
) -> tuple[list[StageRecord], list[TrainerReport], list[RebalanceReport]]:
    """The run's stage records, trainer reports and rebalance reports (valid, unexpired, signer-checked)."""
    return fetch_stage_records(dht, run_id), fetch_trainer_reports(dht, run_id), fetch_rebalance_reports(dht, run_id)


class PipelineObserver:
    """Folds polls of a pipelined run's records into totals and a ``PipelineView``. Thread-safe; bounded memory.

    Args:
        num_stages: S of the run's ``[swarm]`` table.
        microbatch_size: windows per microbatch.
        fingerprint: the run's model fingerprint; records of another model are left out.
        limits: what is credited (``CreditLimits``).
    """

    def __init__(self, num_stages: int, microbatch_size: int, fingerprint: str, limits: CreditLimits = CreditLimits()):
        self.num_stages, self.microbatch_size, self.fingerprint, self.limits = (
            num_stages,
            microbatch_size,
            fingerprint,
            limits,
        )
        self.totals = dict.fromkeys((*TRAINER_COUNTERS, "rebalances"), 0)
        self._lock = threading.Lock()
        self._baselines: OrderedDict[tuple[str, str], Baseline] = OrderedDict()  # (peer, counter) -> last claim
        self._credited: OrderedDict[str, dict[str, int]] = OrderedDict()  # peer -> counter -> credited total
        self._stages: list[StageRecord] = []
        self._trainers: list[TrainerReport] = []
        self._decisions: dict[str, str] = {}
        self._moves: OrderedDict[tuple[str, float, int, int], RebalanceRow] = OrderedDict()
        self._history: deque[tuple[float, int]] = deque()  # (unix s, microbatches_total) per poll, within window_s

    def _credit(self, peer_id: str, counter: str, claimed: int, started_at: float, now: float) -> int:
        key = (peer_id, counter)
        credited, self._baselines[key] = credit_claim(
            self._baselines.get(key),
            claimed,
            started_at,
            now,
            self.limits.rate_of(counter),
            self.limits.max_first_sight_s,
        )
        self._baselines.move_to_end(key)
        self.totals[counter] += credited
        per_peer = self._credited.setdefault(peer_id, {})
        per_peer[counter] = per_peer.get(counter, 0) + credited
        self._credited.move_to_end(peer_id)
        return credited

    def observe(
        self,
        stages: list[StageRecord],
        trainers: list[TrainerReport],
        rebalances: list[RebalanceReport],
        now: float,
    ) -> None:
        """Fold one poll (``now``: unix seconds)."""
        with self._lock:
            self._stages = [r for r in stages if r.model_fingerprint == self.fingerprint and r.stage < self.num_stages]
            self._trainers = [r for r in trainers if r.model_fingerprint == self.fingerprint]
            for r in self._trainers:
                for counter in TRAINER_COUNTERS:
                    self._credit(r.peer_id, counter, getattr(r, counter), r.started_at, now)
            for r in rebalances:
                if r.model_fingerprint != self.fingerprint:
                    continue
                self._decisions[r.peer_id] = r.last_decision
                credited = self._credit(r.peer_id, "rebalances", r.rebalances, r.started_at, now)
                new = [m for m in r.moves if (r.peer_id, min(m.at, now), m.from_stage, m.to_stage) not in self._moves]
                for m in new[len(new) - credited :] if credited else ():  # shown only as far as credited
                    at = min(m.at, now)
                    self._moves[(r.peer_id, at, m.from_stage, m.to_stage)] = RebalanceRow(
                        r.peer_id, at, m.from_stage, m.to_stage, m.reason
                    )
            self._history.append((now, self.totals["microbatches"]))
            while len(self._history) > 1 and self._history[0][0] < now - self.limits.window_s:
                self._history.popleft()
            _trim(self._baselines, MAX_TRACKED_PEERS * (len(TRAINER_COUNTERS) + 1))
            _trim(self._credited, MAX_TRACKED_PEERS)
            _trim(self._moves, MAX_MOVES_KEPT)
            live = {r.peer_id for r in self._stages} | {r.peer_id for r in rebalances}
            self._decisions = {p: d for p, d in self._decisions.items() if p in live}

    def microbatches_per_s(self) -> float:
        """Credited microbatches per second between the oldest and newest poll within ``window_s``."""
        if len(self._history) < 2:
            return 0.0
        (t0, total0), (t1, total1) = self._history[0], self._history[-1]
        return (total1 - total0) / (t1 - t0) if t1 > t0 else 0.0

    def view(self, now: float) -> PipelineView:
        """The pipeline at ``now`` (unix seconds)."""
        with self._lock:
            by_stage: list[list[StageRecord]] = [[] for _ in range(self.num_stages)]
            for r in self._stages:
                by_stage[r.stage].append(r)
            totals = [sum(r.throughput for r in rs) for rs in by_stage]
            bottleneck = min(range(self.num_stages), key=lambda s: (totals[s], s)) if self.num_stages else -1
            stages = tuple(
                StageRow(
                    index,
                    tuple(self._server_row(r, now) for r in sorted(rs, key=lambda r: r.peer_id)),
                    totals[index],
                    bottleneck=index == bottleneck,
                )
                for index, rs in enumerate(by_stage)
            )
            trainers = tuple(
                PipelineTrainerRow(
                    r.peer_id,
                    *(self._credited.get(r.peer_id, {}).get(c, 0) for c in TRAINER_COUNTERS),
                    last_seen_s_ago=max(0.0, now - r.updated_at),
                    last_reasons=r.last_reasons,
                    left_reason=r.left_reason,
                )
                for r in self._trainers
            )
            return PipelineView(
                num_stages=self.num_stages,
                microbatch_size=self.microbatch_size,
                stages=stages,
                trainers=trainers,
                pipeline_throughput_mb_per_s=min(totals, default=0.0),
                microbatches_per_s=self.microbatches_per_s(),
                microbatches_total=self.totals["microbatches"],
                reroutes_total=self.totals["reroutes"],
                replays_total=self.totals["replays"],
                deaths_total=self.totals["deaths"],
                rebalances_total=self.totals["rebalances"],
                rebalances=tuple(sorted(self._moves.values(), key=lambda m: -m.at)),
                window_s=self.limits.window_s,
            )

    def _server_row(self, r: StageRecord, now: float) -> StageServerRow:
        return StageServerRow(
            r.peer_id,
            r.status,
            r.throughput,
            r.load,
            r.queue_len,
            r.epoch,
            max(0.0, now - r.updated_at),
            rebalances=self._credited.get(r.peer_id, {}).get("rebalances", 0),
            last_decision=self._decisions.get(r.peer_id, ""),
        )


def _trim(mapping: OrderedDict, limit: int) -> None:
    while len(mapping) > limit:
        mapping.popitem(last=False)
