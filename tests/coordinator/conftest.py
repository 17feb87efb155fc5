"""Shared fixtures for the coordinator tests: a realistic dashboard snapshot and a running dashboard server."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from hivetrain.coordinator.dashboard import (
    CheckpointRow,
    ContributorRow,
    DashboardServer,
    DashboardSnapshot,
    DriftPoint,
    LossPoint,
    PeerRow,
    RoundRow,
    RunInfo,
    summarize_config,
)

FAKE_PRIVATE_KEY = (
    "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEAsupersecretkeymaterial\n-----END RSA PRIVATE KEY-----"
)
FAKE_SECRET = "hunter2-coordinator-admin-secret"

RUN_CONFIG = {
    "run_id": "demo-run",
    "model": "small",
    "seed": 0,
    "data": {"paths": ["/home/coordinator/private/corpus"], "tokenizer": "", "seq_len": 128, "batch_size": 8},
    "diloco": {"inner_steps": 50, "outer_lr": 0.7, "outer_momentum": 0.9},
    "averaging": {"target_group_size": 64, "min_group_size": 1, "round_timeout_s": 60.0},
    "identity": {"private_key": FAKE_PRIVATE_KEY, "key_path": "/etc/hivetrain/identity.pem"},
    "admin_secret": FAKE_SECRET,
    "innocent_looking": FAKE_PRIVATE_KEY,
}
SECRETS = (FAKE_SECRET, "supersecretkeymaterial", "identity.pem", "/home/coordinator/private")


def make_snapshot(num_epochs: int = 24, num_peers: int = 6, now: float | None = None) -> DashboardSnapshot:
    """A run in progress: a decaying loss curve, trainers and pipeline stages, a failed round, a torn checkpoint."""
    now = time.time() if now is None else now
    start = now - 3600
    curve = [
        LossPoint(start + 120 * e, e, 5.55 * math.exp(-e / 9) + 1.9 + 0.04 * math.sin(e)) for e in range(num_epochs)
    ]
    names = ["alice-3090", "bob's <b>laptop</b>", "", "carol@lab", "dave-colab", "", "erin-m2", "frank"]
    peers = [
        PeerRow(
            peer_id=f"12D3KooWxYzAbCdEfGhJkLmNoPqRsTuV{7919 * (i + 3):06d}Qm",
            role="stage" if i % 3 == 2 else "trainer",
            stage=(i % 2) if i % 3 == 2 else None,
            throughput_samples_per_s=12.5 + 7.3 * i,
            epoch=max(0, num_epochs - 1 - (i == 4)),
            last_seen_s_ago=2.0 + 3 * i if i != 5 else 400.0,
            reachability=("direct", "relayed", "direct", "unreachable")[i % 4],
            public_name=names[i % len(names)],
        )
        for i in range(num_peers)
    ]
    rounds = [
        RoundRow(
            epoch=e,
            group_size=num_peers - (e % 3 == 0),
            duration_s=1.8 + 0.1 * (e % 5),
            committed=e != num_epochs - 3,
            reason="" if e != num_epochs - 3 else "timeout: peer 12D3…TuV stalled",
            finished_at=start + 120 * e + 100,
        )
        for e in range(num_epochs - 1, max(-1, num_epochs - 12), -1)
    ]
    checkpoints = [
        CheckpointRow(epoch=num_epochs - 1, created_at=now - 30, status="ok"),
        CheckpointRow(epoch=num_epochs - 6, created_at=now - 600, status="torn", reason="state.safetensors truncated"),
        CheckpointRow(epoch=num_epochs - 11, created_at=now - 1200, status="ok"),
    ]
    contributors = sorted(
        (
            ContributorRow(p.peer_id, p.public_name, samples_contributed=4000 * (i + 1) ** 2, compute_s=600.0 * (i + 1))
            for i, p in enumerate(peers)
        ),
        key=lambda c: -c.samples_contributed,
    )
    run = RunInfo("demo-run", "small", 4_907_264, summarize_config(RUN_CONFIG), started_at=start)
    return DashboardSnapshot(
        run=run,
        epoch=num_epochs - 1,
        tokens_per_s=48_213.5,
        loss_curve=curve,
        peers=peers,
        rounds=rounds,
        checkpoints=checkpoints,
        contributors=contributors,
        rounds_committed_total=num_epochs - 1,
        rounds_failed_total=1,
        checkpoints_written_total=num_epochs // 5,
        taken_at=now,
        drift_curve=[DriftPoint(e, 0.004 + 0.002 * math.exp(-e / 5), num_peers - 1) for e in range(1, num_epochs)],
    )


class SnapshotHolder:
    """A thread-safe, swappable snapshot provider (what a coordinator would pass as snapshot_fn)."""

    def __init__(self, snapshot: DashboardSnapshot) -> None:
        self._lock = threading.Lock()
        self._snapshot = snapshot
        self.fail = False
        self.calls = 0

    def __call__(self) -> DashboardSnapshot:
        with self._lock:
            self.calls += 1
            if self.fail:
                raise RuntimeError("coordinator state unavailable")
            return replace(self._snapshot, taken_at=time.time())

    def set(self, snapshot: DashboardSnapshot) -> None:
        with self._lock:
            self._snapshot = snapshot


@pytest.fixture
def holder() -> SnapshotHolder:
    return SnapshotHolder(make_snapshot())


@pytest.fixture
def dashboard(holder: SnapshotHolder) -> Iterator[DashboardServer]:
    server = DashboardServer(holder, "127.0.0.1", 0, refresh_interval_s=0.5, snapshot_ttl_s=0.0)
    server.start()
    try:
        server.wait_ready(timeout_s=15)
        yield server
    finally:
        server.shutdown(timeout_s=5)
