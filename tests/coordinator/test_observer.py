"""The coordinator's memory of the swarm (pure: records and time in, dashboard snapshot out)."""

import pytest
import torch

from hivetrain.coordinator.dashboard import RunInfo
from hivetrain.coordinator.observer import MAX_SKETCH_EPOCHS, SwarmObserver
from hivetrain.diloco.drift import SKETCH_SIZE, encode_sketch, sketch_to_text
from tests.records import peer_record


def rec(peer, epoch, **kw):
    return peer_record(peer, epoch, **{"throughput": 10.0, **kw})


def test_loss_curve_rounds_and_contributors_survive_peers_leaving():
    obs = SwarmObserver(RunInfo("r", "tiny", 1000), seq_len=64)
    obs.observe(
        [
            rec("a", 1, eval_loss=4.0, last_group_size=2, last_round_s=1.5, samples_total=40, public_name="ann"),
            rec("b", 1, eval_loss=4.0, last_group_size=2, last_round_s=2.5, samples_total=40),
        ],
        now=100.0,
    )
    obs.observe(
        [
            rec(
                "a",
                2,
                eval_loss=3.0,
                last_group_size=1,
                last_round_s=1.0,
                samples_total=80,
                last_failure="epoch 1: peer_failed",
            )
        ],
        now=110.0,
    )  # b left
    snap = obs.snapshot(now=111.0)
    assert [(p.epoch, p.eval_loss) for p in snap.loss_curve] == [(1, 4.0), (2, 3.0)]
    committed = {r.epoch: r for r in snap.rounds if r.committed}
    assert committed[1].group_size == 2 and committed[1].duration_s == 2.0
    failed = [r for r in snap.rounds if not r.committed]
    assert len(failed) == 1 and "peer_failed" in failed[0].reason
    board = {c.peer_id: c for c in snap.contributors}
    assert board["a"].samples_contributed == 80 and board["a"].public_name == "ann"
    assert board["b"].samples_contributed == 40, "a peer that left keeps its credit"
    assert [p.peer_id for p in snap.peers] == ["a"]
    assert snap.tokens_per_s == 10.0 * 64 and snap.epoch == 2


def test_the_same_failure_is_counted_once():
    obs = SwarmObserver(RunInfo("r", "tiny", 1000), seq_len=64)
    for t in (1.0, 2.0, 3.0):
        obs.observe([rec("a", 3, last_failure="epoch 3: timeout")], now=t)
    assert obs.snapshot(4.0).rounds_failed_total == 1


def test_parameter_drift_is_estimated_per_epoch_from_sketches_arriving_over_several_polls():
    ones = sketch_to_text(encode_sketch(torch.ones(SKETCH_SIZE)))
    off = sketch_to_text(encode_sketch(torch.full((SKETCH_SIZE,), 1.2)))
    obs = SwarmObserver(RunInfo("r", "tiny", 1000), seq_len=64)
    obs.observe([rec("a", 1, param_sketch=ones), rec("b", 0)], now=1.0)  # b has not reached epoch 1 yet
    assert obs.snapshot(1.5).drift_curve == ()
    obs.observe([rec("a", 2, param_sketch=ones), rec("b", 1, param_sketch=off)], now=2.0)
    obs.observe(
        [
            rec("a", 2, param_sketch=ones),
            rec("b", 2, param_sketch=ones),
            rec("c", 2, param_sketch="junk!"),
            rec("d", 2, param_sketch="AAAA"),
        ],
        3.0,
    )
    snap = obs.snapshot(4.0)
    assert [(p.epoch, p.num_peers) for p in snap.drift_curve] == [(1, 2), (2, 2)]
    assert snap.drift_curve[0].drift == pytest.approx(0.1 / 1.1)  # a and b were 1.0 and 1.2 apart at epoch 1
    assert snap.drift_curve[1].drift == 0.0
    for epoch in range(3, 3 + MAX_SKETCH_EPOCHS + 5):  # sketches of old epochs are dropped, their figures kept
        obs.observe([rec("a", epoch, param_sketch=ones), rec("b", epoch, param_sketch=off)], now=float(epoch + 2))
    assert len(obs.sketches) == MAX_SKETCH_EPOCHS
    assert len(obs.snapshot(100.0).drift_curve) == 2 + MAX_SKETCH_EPOCHS + 5
