"""A real swarm on loopback: peers agree bit-for-bit after every outer step, loss falls, late joiners catch up."""

import json

from hivetrain.testing.summary import build_summary, read_events
from tests.e2e.conftest import wait_for_event


def test_three_peers_train_with_equal_state_hashes_and_falling_loss(local_swarm):
    swarm = local_swarm()
    for _ in range(3):
        swarm.add_peer()
    assert swarm.wait_peers(timeout_s=240), "peers did not finish 3 outer steps in time"
    assert [p.popen.returncode for p in swarm.peers] == [0, 0, 0], [p.log_path.read_text()[-2000:] for p in swarm.peers]
    summary = build_summary(swarm.peers, inner_steps=10, wall_s=0)
    assert summary["outer_steps"] == 3
    for epoch in ("0", "1", "2", "3"):
        hashes = summary["state_hashes"][epoch]
        assert len(hashes) == 3 and len(set(hashes.values())) == 1, f"epoch {epoch}: {hashes}"
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.3
    # every committed step averaged over the whole group of three
    for peer in swarm.peers:
        steps = [e for e in read_events(peer.metrics_path) if e["event"] == "outer_step"]
        assert [e["group_size"] for e in steps] == [3, 3, 3]


def test_late_joiner_downloads_state_and_contributes_to_the_next_outer_step(local_swarm):
    swarm = local_swarm(**{"diloco.outer_steps": 6, "diloco.inner_steps": 40})
    first = [swarm.add_peer() for _ in range(2)]
    wait_for_event(first[0], lambda e: e["event"] == "outer_step" and e["epoch"] >= 1, timeout_s=120)
    late = swarm.add_peer(name="late")
    downloaded = wait_for_event(late, lambda e: e["event"] == "state_downloaded", timeout_s=120)
    assert downloaded["epoch"] >= 1
    joined = wait_for_event(late, lambda e: e["event"] == "outer_step", timeout_s=120)
    assert joined["group_size"] == 3, "the late joiner's pseudo-gradient must be averaged with the others'"
    assert swarm.wait_peers(timeout_s=240)
    summaries = [json.loads(p.summary_path.read_text()) for p in swarm.peers]
    late_summary = summaries[-1]
    for epoch, digest in late_summary["state_hashes"].items():
        for other in summaries[:2]:
            assert other["state_hashes"][epoch] == digest, f"epoch {epoch} differs"
    assert downloaded["state_hash"] == summaries[0]["state_hashes"][str(downloaded["epoch"])]
