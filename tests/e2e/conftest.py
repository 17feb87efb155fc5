"""Real multi-process swarms on 127.0.0.1 (coordinator + join-swarm processes), always cleaned up."""

import json
import subprocess
import time
from pathlib import Path

import pytest
import tomli_w

from hivetrain.config import load_run_config
from hivetrain.localswarm.forkserver import run as run_cli
from hivetrain.localswarm.launcher import LocalSwarm
from hivetrain.localswarm.summary import read_events

LOADED_HOGS = 4
"""CPU hogs beside the multi-peer tests that matter (issue 22): on a 2-core machine, four busy loops leave each of a
swarm's processes about a third of a core, as a volunteer's game or compile would. They must pass so."""

TINY_RUN = {
    "run_id": "e2e",
    "model": "tiny",
    "data": {"seq_len": 32, "batch_size": 4, "num_eval_windows": 8, "max_corpus_bytes": 1_000_000},
    "diloco": {"inner_steps": 10, "inner_lr": 0.003, "warmup_steps": 2, "outer_steps": 3},
    "averaging": {"matchmaking_time_s": 2.0, "round_timeout_s": 30.0},
}


def write_config(path: Path, **overrides) -> Path:
    raw = json.loads(json.dumps(TINY_RUN))
    for key, value in overrides.items():
        node = raw
        *parents, leaf = key.split(".")
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    load_run_config(None, {})  # import check
    path.write_text(tomli_w.dumps(raw))
    return path


@pytest.fixture
def local_swarm(tmp_path):
    """local_swarm(**config_overrides) -> LocalSwarm with a running coordinator; closed after the test."""
    swarms = []

    def factory(**overrides):
        config = write_config(tmp_path / "run.toml", **overrides)
        swarm = LocalSwarm(tmp_path / "swarm", config, threads_per_peer=1)
        swarms.append(swarm)
        swarm.start_coordinator(timeout_s=60)
        return swarm

    yield factory
    for swarm in swarms:
        swarm.close(grace_s=10)


def wait_for_event(peer, predicate, timeout_s: float) -> dict:
    """Block until ``peer`` logged an event matching ``predicate``; fails the test on timeout or peer exit."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for event in read_events(peer.metrics_path):
            if predicate(event):
                return event
        if not peer.alive():
            events = read_events(peer.metrics_path)
            if any(predicate(e) for e in events):
                return next(e for e in events if predicate(e))
            pytest.fail(
                f"{peer.name} exited ({peer.popen.returncode}) before the event; log:\n"
                + peer.log_path.read_text()[-3000:]
            )
        time.sleep(0.5)
    pytest.fail(f"{peer.name}: no matching event within {timeout_s}s; log:\n" + peer.log_path.read_text()[-3000:])


def run_local_swarm(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """``hivetrain local-swarm ARGS`` as a user starts it: in a session of its own, as a terminal gives it (forked from
    the pre-imported fork server, ``localswarm.forkserver.run``: the same process without ~6 s of CPU importing).

    Started in pytest's session instead, the CLI shared the kernel's per-session CPU share (autogroup) with
    whatever else runs from the shell that started the suite (the acceptance runs' busy loops): it got ~5% of a core
    and took minutes to import and start, where its peers (own sessions) got their fair share. On timeout the whole
    process group (the CLI and anything it started in it) is killed and ``subprocess.TimeoutExpired`` raised."""
    return run_cli(["hivetrain.cli.main", "local-swarm", *args], timeout_s)
