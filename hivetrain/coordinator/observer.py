"""What the coordinator remembers of the swarm for its dashboard: loss curve, rounds, peers, contributors.

Peer records expire when peers leave, so the coordinator folds every poll into a bounded history: the eval loss of
each epoch (all members of a committed step hold the same θ, so their held-out losses agree), the committed rounds
and failures peers reported, the samples and compute seconds each peer contributed (as it claims them, and as the
members of its groups witnessed them: ``diloco/credit.py``), and the peers that left (with the reason their last
record gave, or "record expired"). ``observe(records, now)``
and ``snapshot(...)`` are plain functions of their inputs (time injected), so tests need no swarm. A pipelined run's
stages, trainers and rebalances are folded by ``pipeline`` (``coordinator/pipeline.py``), fed by the coordinator.
"""

from __future__ import annotations

import statistics
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from hivetrain.coordinator.dashboard import (
    CheckpointRow,
    ContributorRow,
    DashboardSnapshot,
    DriftPoint,
    LeftPeerRow,
    LossPoint,
    PeerRow,
    RoundRow,
    RunInfo,
)
from hivetrain.coordinator.pipeline import PipelineObserver
from hivetrain.diloco.credit import CreditLedger
from hivetrain.diloco.drift import drift_by_epoch, sketch_from_text
from hivetrain.peers.records import PeerRecord

MAX_POINTS = 5000
MAX_ROUNDS = 500
MAX_CONTRIBUTORS = 10_000
MAX_SKETCH_EPOCHS = 8  # epochs whose sketches are still collected (peers pass through an epoch in one outer step)
MAX_SKETCHES_PER_EPOCH = 1024  # 2 KiB each: at most 16 MiB held; beyond that the figure is over the first 1024 peers
MAX_LEFT = 1000  # peers that left, remembered with why (the oldest are forgotten first)


@dataclass
class _Contribution:
    public_name: str = ""
    samples: int = 0
    compute_s: float = 0.0


@dataclass
class SwarmObserver:
    """Accumulates what peer records say. Thread-safe; memory bounded by the MAX_* constants."""

    run: RunInfo
    seq_len: int
    loss_by_epoch: OrderedDict[int, LossPoint] = field(default_factory=OrderedDict)
    rounds: OrderedDict[tuple[int, str], RoundRow] = field(default_factory=OrderedDict)
    contributors: OrderedDict[str, _Contribution] = field(default_factory=OrderedDict)
    records: list[PeerRecord] = field(default_factory=list)
    failures_seen: set[tuple[str, str]] = field(default_factory=set)
    checkpoints: list[CheckpointRow] = field(default_factory=list)
    checkpoints_written: int = 0
    drift: OrderedDict[int, DriftPoint] = field(default_factory=OrderedDict)
    sketches: OrderedDict[int, dict[str, bytes]] = field(default_factory=OrderedDict)
    left: OrderedDict[str, LeftPeerRow] = field(default_factory=OrderedDict)
    pipeline: PipelineObserver | None = None
    max_samples_per_round: int = 1_000_000  # the run's averaging.max_samples_per_round (caps each witnessed count)
    credit: CreditLedger | None = None  # samples witnessed by group members (diloco/credit.py); made at first use
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, records: list[PeerRecord], now: float) -> None:
        """Fold one poll of the run's records (``now``: unix seconds)."""
        trainers = [r for r in records if r.role == "trainer"]
        with self._lock:
            self._fold_departures(records)
            self.records = list(records)
            by_epoch: dict[int, list[PeerRecord]] = {}
            for r in trainers:
                by_epoch.setdefault(r.epoch, []).append(r)
            for epoch, group in by_epoch.items():
                losses = [r.eval_loss for r in group if r.eval_loss is not None]
                if losses and epoch not in self.loss_by_epoch:
                    self.loss_by_epoch[epoch] = LossPoint(now, epoch, statistics.median(losses))
                committed = [r for r in group if r.last_group_size and r.last_round_s is not None]
                if committed and epoch > 0 and (epoch, "") not in self.rounds:
                    size = max(r.last_group_size for r in committed)
                    duration = statistics.median(r.last_round_s for r in committed)
                    self.rounds[(epoch, "")] = RoundRow(epoch, size, float(duration), True, "", now)
            for r in trainers:
                if r.last_failure and (r.peer_id, r.last_failure) not in self.failures_seen:
                    self.failures_seen.add((r.peer_id, r.last_failure))
                    epoch_text, _, reason = r.last_failure.partition(": ")
                    epoch = int(epoch_text.split()[-1]) if epoch_text.split()[-1].isdigit() else r.epoch
                    self.rounds[(epoch, r.peer_id)] = RoundRow(epoch, 0, 0.0, False, f"{r.peer_id[:10]}: {reason}", now)
                entry = self.contributors.setdefault(r.peer_id, _Contribution())
                entry.public_name = r.public_name or entry.public_name
                entry.samples = max(entry.samples, r.samples_total)
                entry.compute_s = max(entry.compute_s, r.compute_s)
            self._fold_sketches(trainers)
            if self.credit is None:
                self.credit = CreditLedger(self.max_samples_per_round)
            self.credit.observe(trainers)
            _trim(self.loss_by_epoch, MAX_POINTS)
            _trim(self.rounds, MAX_ROUNDS)
            _trim(self.contributors, MAX_CONTRIBUTORS)
            _trim(self.left, MAX_LEFT)

    def _fold_departures(self, records: list[PeerRecord]) -> None:
        """Remember peers that left: a record carrying ``left_reason`` (the peer said why), or a record of the last
        poll that is gone from this one ("record expired": it vanished without saying). A peer seen again without
        ``left_reason`` is back (it rejoined, or one poll missed its record) and is forgotten here."""
        now_ids = {r.peer_id for r in records}
        for r in records:
            if r.role == "coordinator":
                continue
            if r.left_reason:
                if r.peer_id not in self.left or self.left[r.peer_id].reason != r.left_reason:
                    self.left[r.peer_id] = _left_row(r, r.left_reason)
            else:
                self.left.pop(r.peer_id, None)
        for r in self.records:
            if r.role != "coordinator" and r.peer_id not in now_ids and r.peer_id not in self.left:
                self.left[r.peer_id] = _left_row(r, "record expired")

    def _fold_sketches(self, trainers: list[PeerRecord]) -> None:
        """Collect each peer's sketch of θ per epoch (a record shows only its current epoch, so the sketches of an
        epoch arrive over several polls) and re-estimate the drift of the epochs that changed."""
        changed = set()
        for r in trainers:
            try:
                sketch = sketch_from_text(r.param_sketch)
            except ValueError:  # not base64: drift_by_epoch leaves out what does not decode, this too
                continue
            held = self.sketches.setdefault(r.epoch, {})
            if r.peer_id not in held and len(held) >= MAX_SKETCHES_PER_EPOCH:
                continue
            if sketch and held.get(r.peer_id) != sketch:
                self.sketches[r.epoch][r.peer_id] = sketch
                changed.add(r.epoch)
        self.sketches = OrderedDict(sorted(self.sketches.items()))
        _trim(self.sketches, MAX_SKETCH_EPOCHS)
        estimates = drift_by_epoch({e: self.sketches[e] for e in changed if e in self.sketches})
        for epoch, (value, num_peers) in estimates.items():
            self.drift[epoch] = DriftPoint(epoch, value, num_peers)
        self.drift = OrderedDict(sorted(self.drift.items()))
        _trim(self.drift, MAX_POINTS)

    def credit_table(self, limit: int) -> list[tuple[str, str, int, int]]:
        """The top ``limit`` contributors as (peer id, public name, witnessed samples, claimed samples), most
        witnessed first (``hivetrain status`` asks for it through ``peers.link_probe``)."""
        with self._lock:
            credited = self.credit.credited() if self.credit is not None else {}
            rows = [(pid, c.public_name, credited.get(pid, 0), c.samples) for pid, c in self.contributors.items()]
        return sorted(rows, key=lambda row: (-row[2], -row[3], row[0]))[:limit]

    def set_checkpoints(self, rows: list[CheckpointRow], written_total: int) -> None:
        with self._lock:
            self.checkpoints, self.checkpoints_written = rows, written_total

    def snapshot(self, now: float) -> DashboardSnapshot:
        """The dashboard's view at ``now`` (unix seconds)."""
        with self._lock:
            present = [r for r in self.records if not r.left_reason]
            trainers = [r for r in present if r.role == "trainer"]
            tokens_per_s = sum(r.throughput for r in trainers) * self.seq_len
            pipeline = self.pipeline.view(now) if self.pipeline is not None else None
            if pipeline is not None:  # pipeline trainers' rate, from credited microbatches
                tokens_per_s = pipeline.microbatches_per_s * pipeline.microbatch_size * self.seq_len
            peers = tuple(
                PeerRow(
                    r.peer_id,
                    r.role,
                    r.stage,
                    r.throughput,
                    r.epoch,
                    max(0.0, now - r.updated_at),
                    "public" if r.reachable else "client mode",
                    r.public_name,
                )
                for r in sorted(present, key=lambda r: (r.role != "coordinator", -r.epoch, r.peer_id))
            )
            rounds = tuple(sorted(self.rounds.values(), key=lambda row: (row.epoch, row.finished_at), reverse=True))
            credited = self.credit.credited() if self.credit is not None else {}
            ranked = sorted(self.contributors.items(), key=lambda kv: (-credited.get(kv[0], 0), -kv[1].samples))
            contributors = tuple(
                ContributorRow(pid, c.public_name, c.samples, c.compute_s, credited.get(pid, 0)) for pid, c in ranked
            )
            return DashboardSnapshot(
                run=self.run,
                epoch=max((r.epoch for r in self.records), default=0),
                tokens_per_s=tokens_per_s,
                loss_curve=tuple(self.loss_by_epoch.values()),
                peers=peers,
                rounds=rounds,
                checkpoints=tuple(self.checkpoints),
                contributors=contributors,
                rounds_committed_total=sum(1 for row in self.rounds.values() if row.committed),
                rounds_failed_total=sum(1 for row in self.rounds.values() if not row.committed),
                checkpoints_written_total=self.checkpoints_written,
                taken_at=now,
                drift_curve=tuple(self.drift.values()),
                peers_left=tuple(sorted(self.left.values(), key=lambda row: -row.last_seen_at)),
                pipeline=pipeline,
            )


def _left_row(record: PeerRecord, reason: str) -> LeftPeerRow:
    return LeftPeerRow(record.peer_id, record.role, record.public_name, record.epoch, record.updated_at, reason)


def _trim(mapping: OrderedDict, limit: int) -> None:
    while len(mapping) > limit:
        mapping.popitem(last=False)
