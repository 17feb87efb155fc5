"""``hivetrain status ADDRESS``: a run's live view without joining it (issue 26 item 5), on a real DHT."""

import json
import subprocess
import sys
import time

import pytest

from hivetrain import __version__
from hivetrain.config import RunConfig
from hivetrain.coordinator.observer import SwarmObserver
from hivetrain.coordinator.web.snapshot import RunInfo
from hivetrain.localswarm.forkserver import run as run_cli
from hivetrain.peers.link_probe import LinkProbeServer
from hivetrain.peers.loop import LoopThread
from hivetrain.peers.records import RunConfigRecord, publish_record, publish_run_config
from tests.records import peer_record

STATUS_ARGV = ["hivetrain.cli.main", "status"]  # run_cli forks it from the pre-imported fork server
STATUS = [sys.executable, "-m", *STATUS_ARGV]  # a fresh interpreter: what --help must answer without a node


def _records(coordinator, trainers, now):
    own = peer_record(coordinator.peer_id, 3, now, role="coordinator", run_id="status-run", throughput=0.0)
    fast = peer_record(
        trainers[0].peer_id, 3, now, run_id="status-run", throughput=40.0, public_name="fast one",
        samples_total=2000, witnessed=((trainers[1].peer_id, 320),), witnessed_epoch=3,
    )  # fmt: skip
    slow = peer_record(
        trainers[1].peer_id,
        2,
        now,
        run_id="status-run",
        throughput=10.0,
        rounds_failed=1,
        last_failure="epoch 2: member died",
        samples_total=900,
        witnessed=((trainers[0].peer_id, 640),),
        witnessed_epoch=2,
    )
    return own, fast, slow


@pytest.mark.slow
def test_status_shows_the_runs_epoch_trainers_and_speeds_as_the_dashboard_counts_them(make_node):
    coordinator = make_node(name="coordinator")
    trainers = [make_node(coordinator.visible_maddrs(), name=f"t{i}") for i in range(2)]
    config = RunConfig.from_dict({"run_id": "status-run", "model": "tiny", "admission": {"mode": "token"}})
    now = time.time()
    signed = RunConfigRecord(
        run_config=config.to_dict(), version=__version__, coordinator_id=coordinator.peer_id, published_at=now
    )
    assert publish_run_config(coordinator.dht, coordinator.owner_marker, signed, 60)
    records = _records(coordinator, trainers, now)
    for node, record in zip([coordinator, *trainers], records, strict=True):
        assert publish_record(node.dht, node.owner_marker, record, 60)
    # what the coordinator's dashboard computes from the same records (its /api/status fields), and the credit table
    # it serves over libp2p (a real coordinator folds it over the whole run)
    dashboard = SwarmObserver(RunInfo("status-run", "tiny", 0), config.data.seq_len)
    dashboard.observe(list(records), now)
    loop = LoopThread(name="status-test")
    server = LinkProbeServer(credit_table=dashboard.credit_table)
    loop.run(server.register(loop.run(coordinator.dht.replicate_p2p(), 30), "status-run"), 30)

    address = str(coordinator.visible_maddrs()[0])
    proc = run_cli([*STATUS_ARGV, address, "--json"], 120)
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    snap = dashboard.snapshot(now)
    assert body["epoch"] == snap.epoch == 3
    assert body["tokens_per_s"] == pytest.approx(snap.tokens_per_s) == 50.0 * config.data.seq_len
    assert body["num_peers_alive"] == snap.num_peers_alive(120.0) == 2
    assert [(p["peer_id"], p["role"], p["epoch"]) for p in body["peers"]] == [
        (p.peer_id, p.role, p.epoch) for p in snap.peers
    ]
    assert [r["reason"] for r in body["rounds"] if not r["committed"]] == [
        r.reason for r in snap.rounds if not r.committed
    ]
    assert body["run"]["run_id"] == "status-run" and body["run"]["model_preset"] == "tiny"
    assert body["admission"] == "token" and body["coordinator"] == coordinator.peer_id
    # credit: each trainer's samples as the other witnessed them, beside its own claim, most witnessed first
    fast, slow = trainers[0].peer_id, trainers[1].peer_id
    assert [(c["peer_id"], c["samples_witnessed"], c["samples_claimed"]) for c in body["credit"]] == [
        (fast, 640, 2000),
        (slow, 320, 900),
    ]
    assert [(c.peer_id, c.samples_credited) for c in snap.contributors] == [(fast, 640), (slow, 320)]

    text = run_cli([*STATUS_ARGV, address], 120)
    assert text.returncode == 0, text.stderr
    assert "run status-run: model tiny, epoch 3, admission token" in text.stdout
    assert "2 trainer(s), 50.0 samples/s" in text.stdout and "fast one" in text.stdout
    assert "member died" in text.stdout
    assert "credit (samples witnessed" in text.stdout and "fast one" in text.stdout.split("credit (")[1]
    loop.stop(timeout_s=2)


@pytest.mark.slow
def test_status_of_an_address_that_is_no_runs_coordinator_is_one_error_line(make_node):
    lone = make_node(name="lone")  # a DHT peer with no run config signed by it
    proc = run_cli([*STATUS_ARGV, str(lone.visible_maddrs()[0]), "--timeout", "3"], 120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no run config signed by" in errors[0] and lone.peer_id in errors[0]


@pytest.mark.slow
def test_status_help_and_a_bad_address_answer_without_a_node():
    assert subprocess.run([*STATUS, "--help"], capture_output=True, text=True, timeout=60).returncode == 0
    proc = subprocess.run([*STATUS, "not-an-address"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "Traceback" not in proc.stderr
