"""Each injector fires exactly when armed, and the firing is counted and recorded.

Process injectors run against a stand-in peer: a process group holding ``sleep`` (the peer) and a copy of ``sleep``
named ``p2pd`` (its daemon), so no training is needed. Hook injectors go through the production FaultInjector with the
``--fault`` spec the harness passes to join-swarm.
"""

import json
import shutil
import signal
import subprocess
import time

import pytest

from hivetrain.chaos import process
from hivetrain.chaos.facts import PeerRun
from hivetrain.chaos.runner import ChaosRunner, _Peer
from hivetrain.chaos.scenario import parse_scenario
from hivetrain.faults import FaultInjected, FaultInjector, parse_fault_spec
from hivetrain.localswarm.launcher import PeerProcess


@pytest.fixture
def fake_peer(tmp_path):
    """A PeerProcess whose group holds a main process and a child named p2pd; killed in finally."""
    daemon = tmp_path / "p2pd"
    shutil.copy(shutil.which("sleep"), daemon)
    popen = subprocess.Popen(
        ["bash", "-c", f'"{daemon}" 60 & exec sleep 60'], start_new_session=True, stdout=subprocess.DEVNULL
    )
    peer = PeerProcess(name="fake", popen=popen, log_path=tmp_path / "fake.log")
    deadline = time.monotonic() + 10
    # until the child has exec'd the copy named p2pd (before that it is a bash fork, and p2pd_pids finds nothing)
    while (len(peer.group_pids()) < 2 or not process.p2pd_pids(peer)) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield peer
    finally:
        peer.signal_group(signal.SIGKILL)
        popen.wait(timeout=10)


def wait_for(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.slow
def test_kill_takes_the_whole_group(fake_peer):
    assert len(process.p2pd_pids(fake_peer)) == 1
    assert process.kill(fake_peer) is True
    assert wait_for(lambda: not fake_peer.group_pids())
    fake_peer.popen.wait(timeout=5)
    assert process.kill(fake_peer) is False  # already gone: reported, nothing signalled


@pytest.mark.slow
def test_pause_and_resume(fake_peer):
    assert not process.is_stopped(fake_peer)
    assert process.pause(fake_peer)
    assert wait_for(lambda: process.is_stopped(fake_peer))
    process.resume(fake_peer)
    assert wait_for(lambda: not process.is_stopped(fake_peer))


@pytest.mark.slow
def test_kill_p2pd_leaves_the_peer_running(fake_peer):
    seen: dict[int, float] = {}
    process.remember_p2pds(fake_peer, seen)
    assert len(seen) == 1
    assert process.leftovers([fake_peer], seen)  # everything is still running
    killed = process.kill_p2pd(fake_peer)
    assert killed == list(seen)
    assert wait_for(lambda: not process.p2pd_pids(fake_peer))
    assert fake_peer.alive()
    assert process.group_rss_bytes(fake_peer) > 0
    process.kill(fake_peer)
    fake_peer.popen.wait(timeout=5)
    assert wait_for(lambda: not process.leftovers([fake_peer], seen))


def test_hook_fault_fires_only_when_armed_and_matching():
    scenario = parse_scenario(
        {
            "name": "h",
            "description": "d",
            "peers": 2,
            "max_duration_s": 60,
            "run": {"diloco": {"outer_steps": 3}},
            "faults": [
                {"kind": "hook", "peer": 1, "point": "averaging.before_send", "action": "raise", "when": {"epoch": 2}}
            ],
        }
    )
    unarmed = FaultInjector()
    unarmed.check("averaging.before_send", epoch=2)
    assert unarmed.fired_count("averaging.before_send") == 0

    injector = FaultInjector()
    injector.arm(parse_fault_spec(scenario.faults[0].spec()))
    injector.check("averaging.before_send", epoch=1)
    injector.check("averaging.mid_transfer", epoch=2)
    assert injector.fired_count("averaging.before_send") == 0
    with pytest.raises(FaultInjected):
        injector.check("averaging.before_send", epoch=2)
    injector.check("averaging.before_send", epoch=2)  # times=1: fires once
    assert injector.fired_count("averaging.before_send") == 1


def runner_with(tmp_path, fake_peer, *faults):
    scenario = parse_scenario(
        {
            "name": "r",
            "description": "d",
            "peers": 2,
            "max_duration_s": 60,
            "run": {"diloco": {"outer_steps": 3}},
            "faults": list(faults),
        }
    )
    runner = ChaosRunner(scenario, tmp_path, log=lambda line: None)
    runner.t0 = time.time()
    peer = _Peer(proc=fake_peer, run=PeerRun(name="peer1", index=1))
    runner.peers.append(peer)
    runner.by_index[1] = peer
    return runner


@pytest.mark.slow
def test_runner_records_each_process_fault_when_it_fires(tmp_path, fake_peer):
    runner = runner_with(
        tmp_path,
        fake_peer,
        {"kind": "pause", "peer": 1, "at_s": 1, "duration_s": 2},
        {"kind": "kill_p2pd", "peer": 1, "at_s": 2},
        {"kind": "kill", "peer": 1, "at_s": 3},
        {"kind": "kill", "peer": 0, "at_s": 4},  # peer 0 was never started: must not count as fired
    )
    assert all(f["fired_at_s"] is None for f in runner.faults)
    runner._fire(0, "test")
    assert runner.faults[0]["fired_at_s"] is not None and runner.faults[0]["ended_at_s"] is not None
    assert wait_for(lambda: process.is_stopped(fake_peer))
    assert len(runner.timers) == 1  # the SIGCONT
    runner.timers.pop().action()
    assert wait_for(lambda: not process.is_stopped(fake_peer))
    runner._fire(1, "test")
    assert runner.faults[1]["fired_at_s"] is not None and wait_for(lambda: not process.p2pd_pids(fake_peer))
    runner._fire(2, "test")
    assert runner.faults[2]["fired_at_s"] is not None and runner.peers[0].run.killed
    assert wait_for(lambda: not fake_peer.group_pids())
    runner._fire(3, "test")
    assert runner.faults[3]["fired_at_s"] is None and "not running" in runner.faults[3]["detail"]
    assert sum(f["fired_at_s"] is not None for f in runner.faults) == 3


@pytest.mark.slow
def test_a_peer_that_stops_itself_at_a_hook_is_paused_whole_then_resumed(tmp_path, fake_peer):
    """A ``stop`` hook SIGSTOPs only the peer's own process; the harness stops the rest of its group (p2pd, DHT
    process) when it sees that, as a laptop lid would, and SIGCONTs them all ``seconds`` later."""
    import os

    import psutil

    runner = runner_with(
        tmp_path,
        fake_peer,
        {"kind": "hook", "peer": 1, "point": "averaging.mid_transfer", "action": "stop", "seconds": 2},
    )
    runner.peers[0].hooks = [0]
    (daemon,) = process.p2pd_pids(fake_peer)
    os.kill(fake_peer.pid, signal.SIGSTOP)  # what the hook does to itself
    assert wait_for(lambda: process.is_stopped(fake_peer))
    assert psutil.Process(daemon).status() != psutil.STATUS_STOPPED
    runner._check_hooks(runner.peers[0])
    assert runner.faults[0]["fired_at_s"] is not None and len(runner.timers) == 1
    assert wait_for(lambda: psutil.Process(daemon).status() == psutil.STATUS_STOPPED)
    runner.timers.pop().action()
    assert wait_for(lambda: not process.is_stopped(fake_peer))
    assert wait_for(lambda: psutil.Process(daemon).status() != psutil.STATUS_STOPPED)


def test_a_hook_fault_fires_when_its_peer_reports_a_matching_fault_fired_event(tmp_path):
    """The trainer writes a ``fault_fired`` event (FaultInjector.on_fire) before the action runs; the runner records
    the hook fault whose point, action and ``when`` match it, at the event's time, and no other."""
    metrics = tmp_path / "peer1.jsonl"
    proc = PeerProcess(name="peer1", popen=None, log_path=tmp_path / "peer1.log", metrics_path=metrics)
    vote = {"kind": "hook", "peer": 1, "point": "averaging.vote", "action": "raise"}
    runner = runner_with(tmp_path, proc, {**vote, "when": {"epoch": 2}}, {**vote, "when": {"epoch": 3}})
    runner.peers[0].hooks = [0, 1]

    def fired(point, epoch):
        event = {"event": "fault_fired", "time": runner.t0 + 5.0, "epoch": 1, "point": point, "action": "raise"}
        return json.dumps({**event, "context": {"epoch": epoch, "to": "peer0-id"}}) + "\n"

    metrics.write_text(fired("averaging.before_commit", 2) + fired("averaging.vote", 2))
    runner._read_events(runner.peers[0])
    assert runner.faults[0]["fired_at_s"] == 5.0 and "fault_fired event" in runner.faults[0]["detail"]
    assert runner.faults[1]["fired_at_s"] is None  # its epoch 3 has not come


@pytest.mark.slow
def test_cpu_starve_duty_cycles_the_peers_group_until_teardown_and_leaves_it_running(tmp_path, fake_peer):
    """The runner starts a duty cycler on the peer's process group (its p2pd stopped with it), records the fault as
    fired, and at teardown stops the cycler before anything else: the group ends running, the counts in the record."""
    import psutil

    runner = runner_with(tmp_path, fake_peer, {"kind": "cpu_starve", "peer": 1, "at_s": 1, "period_s": 0.1})
    (daemon,) = process.p2pd_pids(fake_peer)
    runner._fire(0, "test")
    assert runner.faults[0]["fired_at_s"] is not None and "runs 0.2 of every 0.1s" in runner.faults[0]["detail"]
    assert wait_for(lambda: psutil.Process(daemon).status() == psutil.STATUS_STOPPED)  # the whole group
    time.sleep(0.5)
    runner._teardown()  # no swarm here: only the cycler to stop
    record = runner.faults[0]
    assert not runner.cyclers and record["starve"]["stops"] >= 3 and record["starve"]["ended_by"] == "stopped"
    assert record["ended_at_s"] is not None and record["ended_at_s"] > record["fired_at_s"]
    assert not process.is_stopped(fake_peer) and psutil.Process(daemon).status() != psutil.STATUS_STOPPED
