"""Evaluation off the critical path in a real swarm (``diloco.eval_overlap = "on"``, on CPU as a test)."""

import json

import pytest

from hivetrain.localswarm.summary import read_events


@pytest.mark.slow
def test_background_evaluations_report_each_epoch_and_peers_stay_bit_identical(local_swarm):
    swarm = local_swarm(**{"diloco.outer_steps": 3, "averaging.min_group_size": 2, "diloco.eval_overlap": "on"})
    peers = [swarm.add_peer(name=f"p{i}") for i in range(2)]
    assert swarm.wait_peers(timeout_s=120), "peers did not finish in time"
    summaries = [json.loads(p.summary_path.read_text()) for p in peers]
    assert all(p.popen.returncode == 0 for p in peers), peers[0].log_path.read_text()[-3000:]
    assert summaries[0]["state_hashes"] == summaries[1]["state_hashes"]
    for peer, summary in zip(peers, summaries, strict=True):
        events = read_events(peer.metrics_path)
        steps = [e for e in events if e["event"] == "outer_step"]
        evals = [e for e in events if e["event"] == "eval"]
        assert steps and all(e["eval_loss"] is None for e in steps)  # the trainer did not wait for them
        epochs = [e["epoch"] for e in evals]
        # one per committed epoch unless a newer state replaced a waiting one; never out of order, never twice
        assert epochs == sorted(set(epochs)) and epochs[-1] == summary["epoch"]
        assert set(epochs) <= {e["epoch"] for e in steps}
        assert all(0 < e["eval_loss"] < 10 and e["eval_s"] > 0 for e in evals)
        finish = next(e for e in events if e["event"] == "finish")
        assert finish["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], rel=1e-6)  # the same θ, evaluated twice
