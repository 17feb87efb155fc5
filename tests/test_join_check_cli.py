"""``join-swarm --check ADDRESS``: every check with its measured figure and a predicted contribution, without joining
(issue 26 item 4), against a real coordinator node on loopback."""

import json
import time

import pytest

from hivetrain import __version__
from hivetrain.config import RunConfig
from hivetrain.diloco.forecast import forecast
from hivetrain.localswarm.forkserver import run as run_cli
from hivetrain.peers.link_probe import LinkProbeServer
from hivetrain.peers.loop import LoopThread
from hivetrain.peers.records import RunConfigRecord, publish_record, publish_run_config
from tests.records import peer_record

JOIN = ["hivetrain.cli.join_swarm"]
LOCAL = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]


@pytest.mark.slow
def test_check_prints_every_figure_and_a_forecast_made_from_them(make_node):
    coordinator = make_node(name="coordinator")
    trainer = make_node(coordinator.visible_maddrs(), name="trainer")
    config = RunConfig.from_dict({"run_id": "check-run", "model": "tiny", "diloco": {"inner_steps": 20}})
    now = time.time()
    signed = RunConfigRecord(
        run_config=config.to_dict(), version=__version__, coordinator_id=coordinator.peer_id, published_at=now
    )
    assert publish_run_config(coordinator.dht, coordinator.owner_marker, signed, 60)
    own = peer_record(coordinator.peer_id, 3, now, role="coordinator", run_id="check-run", throughput=0.0)
    busy = peer_record(trainer.peer_id, 3, now, run_id="check-run", throughput=40.0)
    assert publish_record(coordinator.dht, coordinator.owner_marker, own, 60)
    assert publish_record(trainer.dht, trainer.owner_marker, busy, 60)
    loop = LoopThread(name="check-test")
    server = LinkProbeServer()
    try:
        loop.run(server.register(loop.run(coordinator.dht.replicate_p2p(), 30), "check-run"), 30)
        address = str(coordinator.visible_maddrs()[0])
        proc = run_cli([*JOIN, "--check", address, "--json", "--device", "cpu", *LOCAL], 180)
    finally:
        loop.stop(timeout_s=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    body = json.loads(proc.stdout)
    checks = {c["name"]: c for c in body["checks"]}
    assert list(checks) == ["run", "memory", "speed", "data port", "upload", "download", "forecast"]
    assert all(c["status"] == "ok" for c in checks.values()), checks
    assert checks["run"]["value"] == 1 and "epoch 3" in checks["run"]["detail"]
    assert checks["memory"]["value"] == pytest.approx(0.46e6, rel=0.05)  # the tiny preset's parameters
    speed, up, down = checks["speed"]["value"], checks["upload"]["value"], checks["download"]["value"]
    assert speed > 0 and up > 0 and down > 0
    assert server.served == 3  # the dial and both rates went through the coordinator's probe
    # the forecast is the pure function of the figures printed above (no other input)
    want = forecast(
        samples_per_s=speed, swarm_samples_per_s=40.0, num_trainers=1, schedule="swarm", inner_steps=20,
        samples_per_step=config.data.batch_size, target_samples_per_epoch=0, strategy="butterfly",
        target_group_size=config.averaging.target_group_size, moshpit_rounds=config.averaging.moshpit_rounds,
        wire_bytes=body["forecast"]["round_bytes"], upload_bytes_per_s=up, download_bytes_per_s=down, overlap=False,
    )  # fmt: skip
    assert body["forecast"]["group_size"] == 2
    assert body["forecast"]["share"] == pytest.approx(want.share) == pytest.approx(speed / (speed + 40.0))
    assert body["forecast"]["phase_s"] == pytest.approx(want.phase_s)
    assert 0 < body["forecast"]["utilization"] <= 1

    # the coordinator's probe handler is gone (its loop stopped), its node is not: the link checks fail, in text
    text = run_cli([*JOIN, "--check", address, "--device", "cpu", *LOCAL], 180)
    assert text.returncode == 4, text.stderr[-2000:]
    lines = text.stdout.splitlines()
    assert lines[0].startswith("ok   run ") and any(line.startswith("ok   speed ") for line in lines)
    assert any(line.startswith("WARN data port ") for line in lines)
    assert any(line.startswith("FAIL upload ") for line in lines) and not any("forecast" in line for line in lines)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [(["--check"], "--check needs the run's coordinator address"), (["--json", "--config", "x.toml"], "--json goes")],
)
def test_check_flags_without_what_they_need_are_one_error_line(args, message):
    proc = run_cli([*JOIN, *args, *LOCAL], 60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error:") and message in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr
