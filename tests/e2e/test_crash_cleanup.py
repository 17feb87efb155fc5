"""A peer that dies without cleanup leaves nothing behind; a peer whose p2pd dies never forks the run."""

import os
import signal

import psutil
import pytest

from hivetrain.localswarm.summary import read_events
from tests.e2e.conftest import wait_for_event


@pytest.mark.slow
def test_sigkilled_peer_leaves_no_dht_process_or_p2pd(local_swarm):
    swarm = local_swarm(**{"diloco.outer_steps": 50, "diloco.inner_steps": 200})
    peer = swarm.add_peer()
    wait_for_event(peer, lambda e: e["event"] == "start", timeout_s=90)
    helpers = [c for c in psutil.Process(peer.pid).children(recursive=True) if "reaper" not in " ".join(c.cmdline())]
    assert any("p2pd" in c.name() for c in helpers)
    os.kill(peer.pid, signal.SIGKILL)  # the peer only: no finally, no atexit
    peer.popen.wait(timeout=10)
    gone, alive = psutil.wait_procs(helpers, timeout=10)
    assert not alive, f"orphans: {[(p.pid, p.name()) for p in alive]}"


@pytest.mark.slow
def test_peer_whose_p2pd_dies_never_commits_alone_and_exits(local_swarm):
    swarm = local_swarm(**{"diloco.outer_steps": 40, "diloco.inner_steps": 10})
    a = swarm.add_peer(["--dht-lost-timeout", "6"])
    b = swarm.add_peer(["--dht-lost-timeout", "6"])
    wait_for_event(a, lambda e: e["event"] == "outer_step" and e["epoch"] >= 1, timeout_s=120)
    p2pd = [c for c in psutil.Process(a.pid).children(recursive=True) if "p2pd" in c.name()]
    assert p2pd
    for proc in p2pd:
        proc.kill()
    assert a.popen.wait(timeout=120) == 4, a.log_path.read_text()[-3000:]
    assert "lost the DHT" in a.log_path.read_text()
    solo = [e for e in read_events(a.metrics_path) if e["event"] == "outer_step" and e["group_size"] == 1]
    assert solo == [], "a peer that cannot see the swarm must not commit solo steps"
    b.signal_group(signal.SIGTERM)
