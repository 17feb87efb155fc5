"""Ctrl+C / SIGTERM: a peer leaves within a few seconds and leaves no p2pd daemon behind."""

import signal
import time

import psutil
import pytest

from tests.e2e.conftest import wait_for_event


@pytest.mark.slow
def test_sigterm_leaves_quickly_without_orphan_p2pd(local_swarm):
    swarm = local_swarm(**{"diloco.outer_steps": 50, "diloco.inner_steps": 200})
    peer = swarm.add_peer()
    wait_for_event(peer, lambda e: e["event"] == "start", timeout_s=90)
    children = psutil.Process(peer.pid).children(recursive=True)
    daemons = [c for c in children if "p2pd" in c.name()]
    assert daemons, "expected the peer to run a p2pd daemon"
    started = time.monotonic()
    peer.popen.send_signal(signal.SIGTERM)  # the process only, as a terminal's Ctrl+C or `kill PID` would
    code = peer.popen.wait(timeout=30)
    assert time.monotonic() - started < 10, "peer took too long to leave"
    assert code == 130
    gone, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, f"left behind: {[p.name() for p in alive]}"
