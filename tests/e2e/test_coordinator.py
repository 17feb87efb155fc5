"""The hosted coordinator with a real swarm: dashboard in a browser, checkpoints, 40 s down and catching up."""

import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
from playwright.sync_api import expect

from hivetrain.coordinator.checkpoint import CheckpointStore
from hivetrain.localswarm.launcher import LocalSwarm
from hivetrain.localswarm.summary import read_events
from tests.coordinator.test_dashboard_browser import browser_page  # noqa: F401 - fixture
from tests.e2e.conftest import wait_for_event, write_config


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("coord")
    # Rounds close as soon as both peers are ready, so epochs of 10 steps took 0.2 s and the run ended before the
    # coordinator test's 40 s outage was over: epochs of about a second, and more than any test here waits for.
    config = write_config(tmp / "run.toml", **{"diloco.outer_steps": 1000, "diloco.inner_steps": 100})
    swarm = LocalSwarm(tmp / "swarm", config, threads_per_peer=1)
    try:
        swarm.start_coordinator(extra_args=["--checkpoint-dir", str(tmp / "ckpt"), "--http-port", "0"])
        swarm.ckpt = tmp / "ckpt"
        for _ in range(2):
            swarm.add_peer()
        yield swarm
    finally:
        swarm.close(grace_s=10)


def _dashboard_url(swarm) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.findall(r"dashboard: (http://\S+)", swarm.coordinator.log_path.read_text())
        if found:
            return found[-1]
        time.sleep(0.5)
    pytest.fail("the coordinator printed no dashboard URL")


@pytest.mark.slow
def test_dashboard_shows_the_running_swarm_in_a_browser(swarm, browser_page, tmp_path):  # noqa: F811
    for peer in swarm.peers:
        wait_for_event(peer, lambda e: e["event"] == "outer_step" and e["epoch"] >= 2, timeout_s=120)
    errors = []
    browser_page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    browser_page.on("pageerror", lambda exc: errors.append(str(exc)))
    browser_page.goto(_dashboard_url(swarm))
    peer_ids = [read_events(p.metrics_path)[0]["peer"] for p in swarm.peers]
    for peer_id in peer_ids:
        expect(browser_page.locator("body")).to_contain_text(peer_id[-8:], timeout=20_000)  # shown as …XXXXXXXX
    assert browser_page.locator("svg").count() >= 1, "no loss chart"
    expect(browser_page.locator("body")).not_to_contain_text("No evaluations yet", timeout=20_000)
    # the peers' θ sketches reached the coordinator through the DHT; butterfly peers hold the same θ: zero drift
    expect(browser_page.locator("body")).to_contain_text("Parameter drift", timeout=20_000)
    expect(browser_page.locator("body")).to_contain_text("0.00e+00", timeout=20_000)
    shot = tmp_path / "dashboard-live-swarm.png"
    browser_page.screenshot(path=str(shot), full_page=True)
    if os.environ.get("HIVETRAIN_ARTIFACTS_DIR"):
        shutil.copy(shot, Path(os.environ["HIVETRAIN_ARTIFACTS_DIR"]) / shot.name)
    assert errors == []


@pytest.mark.slow
def test_training_goes_on_with_the_coordinator_down_40s_and_it_catches_up(swarm):
    """Down past its record's 30 s TTL: the peers no longer see it at all, and keep training."""
    store = CheckpointStore(swarm.ckpt, keep_last=3)
    deadline = time.monotonic() + 60
    while not any(c.status == "ok" for c in store.list()) and time.monotonic() < deadline:
        time.sleep(1)
    before = max(c.epoch for c in store.list() if c.status == "ok")
    swarm.coordinator.signal_group(signal.SIGKILL)
    swarm.coordinator.popen.wait(timeout=10)
    epoch_at_kill = max(e["epoch"] for e in read_events(swarm.peers[0].metrics_path))
    time.sleep(40)
    for peer in swarm.peers:
        assert peer.alive(), peer.log_path.read_text()[-2000:]
        steps = [e for e in read_events(peer.metrics_path) if e["event"] == "outer_step" and e["epoch"] > epoch_at_kill]
        assert len(steps) >= 3, "peers must keep committing outer steps while the coordinator is down"
        assert all(e["group_size"] == 2 for e in steps)
    swarm.restart_coordinator()
    log = swarm.coordinator.log_path
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not re.search(
        r"downloaded epoch (\d+)", log.read_text().split("restored")[-1]
    ):
        time.sleep(1)
    text = log.read_text().split("restored checkpoint of epoch")[-1]  # what the restarted coordinator logged
    restored = int(text.split()[0])
    assert restored >= before, "the restarted coordinator must load its newest complete checkpoint"
    caught_up = int(re.findall(r"downloaded epoch (\d+)", text)[-1])
    assert caught_up > epoch_at_kill + 2, "the restarted coordinator must catch up to the current epoch"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and max(c.epoch for c in store.list() if c.status == "ok") <= epoch_at_kill:
        time.sleep(1)
    assert max(c.epoch for c in store.list() if c.status == "ok") > epoch_at_kill
