"""Real-length inner phases: liveness does not depend on the train loop, and overlap keeps peers bit-identical.

Before, the DHT view was refreshed only between phases, so any inner phase plus round longer than the lost-DHT
timeout made a healthy peer quit ("lost the DHT") after the first outer step. Here the timeout is 4 s and every
inner phase lasts longer than that.
"""

import json

import pytest

from hivetrain.localswarm.summary import read_events
from tests.e2e.conftest import LOADED_HOGS, run_local_swarm, write_config


def run_swarm(tmp_path, peers: int, extra: list[str], **overrides) -> tuple[dict, dict[str, list[dict]]]:
    config = write_config(tmp_path / "run.toml", **overrides)
    out = tmp_path / "out"
    proc = run_local_swarm(
        ["--peers", str(peers), "--config", str(config), "--out", str(out), "--timeout", "400", *extra], 460
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = {f"peer{i}": read_events(out / f"peer{i}.jsonl") for i in range(peers)}
    return json.loads((out / "summary.json").read_text()), events


@pytest.mark.slow
def test_inner_phases_longer_than_the_lost_dht_timeout_keep_every_peer_in_every_epoch(tmp_path, cpu_hogs):
    cpu_hogs(LOADED_HOGS)  # issue 22: here two loaded peers never met for 5 minutes, then one outer step wrecked θ
    # Each phase must outlast the 4 s timeout on any machine: a step count alone does not (CI's 2-core machine ran
    # 200 steps in 3.8 s, this one in 8 s idle and 14-21 s beside the hogs). A duty cycle of 1/5 makes the phase's
    # wall time at least 5x its compute time, sleeping rather than computing, so faster machines still qualify.
    summary, events = run_swarm(
        tmp_path,
        2,
        ["--duty-cycles", "0.2,0.2", "--peer-args", "--dht-lost-timeout 4"],
        **{"diloco.inner_steps": 120, "diloco.outer_steps": 2, "diloco.schedule": "steps"},
    )
    for name, evs in events.items():
        phases = [e for e in evs if e["event"] == "inner_phase"]
        assert phases and min(e["wall_s"] for e in phases) > 4.0, f"{name}: phases too short to test liveness"
        assert [e["epoch"] for e in evs if e["event"] == "outer_step"] == [1, 2], f"{name} missed an outer step"
        assert [e["group_size"] for e in evs if e["event"] == "outer_step"] == [2, 2]
    assert summary["peers_left"] == [] and summary["outer_steps"] == 2
    for epoch in ("1", "2"):
        assert len(summary["state_hashes"][epoch]) == 2 and len(set(summary["state_hashes"][epoch].values())) == 1


@pytest.mark.slow
def test_overlapped_rounds_keep_every_peer_bit_identical_and_commit_every_sample(tmp_path, cpu_hogs):
    cpu_hogs(LOADED_HOGS)
    summary, events = run_swarm(
        tmp_path,
        2,
        [],
        **{"diloco.inner_steps": 60, "diloco.outer_steps": 4, "diloco.overlap": "eager"},
    )
    for name, evs in events.items():
        rounds = [e for e in evs if e["event"] == "outer_step"]
        assert [e["epoch"] for e in rounds] == [1, 2, 3, 4], f"{name} missed an outer step"
        keys = [e["round_key"] for e in evs if e["event"] == "inner_phase"]
        assert keys[:2] == [0, 1], f"{name}: the second phase did not start while round 0 was in flight: {keys}"
    for epoch in ("1", "2", "3", "4"):
        assert len(summary["state_hashes"][epoch]) == 2 and len(set(summary["state_hashes"][epoch].values())) == 1
    for name, peer in summary["per_peer"].items():
        assert peer["samples_discarded"] == 0 and peer["samples_committed"] == peer["samples_computed"], name
