"""A 2-rank gloo node (torchrun, ``diloco/node_ranks.py``) and a single-process peer in one local swarm."""

import json
import socket
import sys

import pytest

from hivetrain.localswarm.summary import read_events


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_two_rank_node_and_a_single_peer_end_bit_identical(local_swarm):
    # min_group_size 2: no solo outer step while the node (torchrun, two imports) is still starting
    swarm = local_swarm(**{"diloco.outer_steps": 2, "averaging.min_group_size": 2})
    single = swarm.add_peer(name="single")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "--no-python"]
    node = swarm.add_peer(name="node", prefix=torchrun)
    assert swarm.wait_peers(timeout_s=120), "peers did not finish in time"
    assert single.popen.returncode == 0 and node.popen.returncode == 0, node.log_path.read_text()[-3000:]
    a, b = (json.loads(p.summary_path.read_text()) for p in (single, node))
    assert a["epoch"] == b["epoch"] == 2
    assert a["state_hashes"] == b["state_hashes"]  # bit-identical shared state at every epoch
    phases = [e for e in read_events(node.metrics_path) if e["event"] == "inner_phase"]
    assert phases and all(e["samples"] == e["steps"] * 4 * 2 for e in phases)  # batch 4 x 2 ranks
    log = node.log_path.read_text()
    # a phase of no step (the single peer's phase ended before the node's step would: the node joins its round with
    # weight 0) starts nothing on rank 1
    stepped = [e for e in phases if e["steps"]]
    steps = sum(e["steps"] for e in stepped)
    assert f"node rank 1: {len(stepped)} phases, {steps} inner steps" in log  # rank 1 followed every step


@pytest.mark.slow
def test_a_sharded_two_rank_node_and_a_single_peer_end_bit_identical(local_swarm):
    # --node-sharding fsdp: each rank holds half of the model; rank 0's trainer works on its host copy
    swarm = local_swarm(**{"diloco.outer_steps": 2, "averaging.min_group_size": 2})
    single = swarm.add_peer(name="single")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "--no-python"]
    node = swarm.add_peer(["--node-sharding", "fsdp"], name="node", prefix=torchrun)
    assert swarm.wait_peers(timeout_s=120), "peers did not finish in time"
    assert single.popen.returncode == 0 and node.popen.returncode == 0, node.log_path.read_text()[-3000:]
    a, b = (json.loads(p.summary_path.read_text()) for p in (single, node))
    assert a["epoch"] == b["epoch"] == 2
    assert a["state_hashes"] == b["state_hashes"]  # the sharded node's outer steps agree bit for bit
    log = node.log_path.read_text()
    assert "node of 2 ranks: FSDP (sharded model)" in log
    phases = [e for e in read_events(node.metrics_path) if e["event"] == "inner_phase"]
    stepped = [e for e in phases if e["steps"]]
    steps = sum(e["steps"] for e in stepped)
    evaluations = [e for e in read_events(node.metrics_path) if e.get("eval_loss") is not None]
    assert evaluations and all(0 < e["eval_loss"] < 10 for e in evaluations)
    assert f"node rank 1: {len(stepped)} phases, {steps} inner steps, 0 aborted, 0 diverged" in log
    assert "evaluations (fsdp)" in log
