"""Closed-form checks of the simulation's arithmetic: group averaging, drift, link costs, config."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hivetrain.averaging.groups import max_relative_deviation, moshpit_groups
from hivetrain.peers.records import PeerRecord
from hivetrain.sim import dht as simdht
from hivetrain.sim.config import load_scenario, parse_scenario
from hivetrain.sim.consensus import group_means, labels_for, relative_deviation
from hivetrain.sim.network import allreduce_cost, download_cost


def test_group_means_is_the_weighted_mean_per_group() -> None:
    x = np.array([[1.0, 0.0], [3.0, 2.0], [10.0, 10.0], [7.0, 7.0]])
    w = np.array([1.0, 3.0, 2.0, 5.0])
    out, totals = group_means(x, w, np.array([0, 0, -1, 1]))
    np.testing.assert_allclose(out[0], [(1 * 1 + 3 * 3) / 4, (0 + 3 * 2) / 4])
    np.testing.assert_allclose(out[1], out[0])
    np.testing.assert_array_equal(out[2], x[2])  # no group: untouched
    np.testing.assert_array_equal(out[3], x[3])  # a group of one
    np.testing.assert_array_equal(totals, [4.0, 4.0, 2.0, 5.0])


def test_moshpit_on_a_full_grid_reaches_the_exact_mean_in_d_rounds() -> None:
    rng = np.random.default_rng(0)
    ids = [f"p{i:02d}" for i in range(16)]
    x = rng.standard_normal((16, 3)) + 2.0
    start = relative_deviation(x)
    for r in range(2):  # grid 4 x 4: d = 2
        groups, _ = moshpit_groups(ids, (4, 4), r, "seed")
        x, _ = group_means(x, np.ones(16), labels_for(groups, {p: i for i, p in enumerate(ids)}, 16))
        if r == 0:
            assert 1e-3 < relative_deviation(x) < start
    assert relative_deviation(x) < 1e-12


def test_relative_deviation_equals_the_production_metric() -> None:
    x = np.random.default_rng(1).standard_normal((7, 5)) + 1.0
    assert relative_deviation(x) == pytest.approx(max_relative_deviation([torch.tensor(r) for r in x]), rel=1e-12)


def test_allreduce_charges_each_member_its_butterfly_bytes_over_its_slowest_link() -> None:
    ids = ["a", "b", "c", "d"]
    up = np.array([100.0, 50.0, 200.0, 100.0])
    down = np.array([400.0, 400.0, 25.0, 400.0])
    cost = allreduce_cost(ids, 4000, up, down, np.array([0.01, 0.02, 0.01, 0.0]))
    moved = 3 / 4 * 4000 + 3 * 1 / 4 * 4000  # other slices out + reduced slice to 3 others = 6000 bytes each way
    np.testing.assert_array_equal(cost.sent_bytes, [moved] * 4)
    np.testing.assert_array_equal(cost.received_bytes, [moved] * 4)
    assert cost.duration_s == pytest.approx(moved / 25.0 + 4 * 0.02)  # c's download is the bottleneck


def test_download_splits_by_donor_share_and_is_capped_by_the_joiner() -> None:
    cost = download_cost(1000, 100, 10_000.0, 0.0, np.array([300.0, 100.0, 200.0]), np.zeros(3), np.array([1, 1, 2]))
    np.testing.assert_array_equal(cost.sent_bytes, [600, 200, 200])  # rates 300, 100, 100 of 500
    assert cost.duration_s == pytest.approx(1000 / 500)
    capped = download_cost(1000, 100, 100.0, 0.0, np.array([300.0, 100.0]), np.zeros(2), np.ones(2, np.int64))
    assert capped.duration_s == pytest.approx(1000 / 100)
    one_chunk = download_cost(100, 100, 1e9, 0.0, np.array([300.0, 100.0]), np.zeros(2), np.ones(2, np.int64))
    np.testing.assert_array_equal(one_chunk.sent_bytes, [100, 0])  # one chunk: one donor busy


def test_unknown_keys_are_refused_and_bundled_scenarios_load() -> None:
    with pytest.raises(ValueError, match="sim.num_peer: unknown key"):
        parse_scenario({"sim": {"num_peer": 5}})
    with pytest.raises(ValueError, match="averaging.strategy"):
        parse_scenario({"averaging": {"strategy": "allgather"}})
    from pathlib import Path

    paths = sorted(Path(__file__).resolve().parents[2].glob("scenarios/sim/*.toml"))
    assert len(paths) >= 4
    for path in paths:
        assert load_scenario(path).name == path.stem


def test_board_records_equal_validated_records_with_the_same_values() -> None:
    board = simdht.RecordBoard(4)
    board.publish(2, "QmPeer2", "h" * 16, epoch=3, phase_epoch=4, phase_samples=40, throughput=2.5, done_epoch=3,
                  done_samples=80, updated_at=12.5)  # fmt: skip
    (rec,) = board.records()
    fields = simdht._template_record().__dict__ | {
        "peer_id": "QmPeer2", "epoch": 3, "phase_epoch": 4, "phase_samples": 40, "throughput": 2.5,
        "done_epoch": 3, "done_samples": 80, "updated_at": 12.5, "state_hash": "h" * 16,
    }  # fmt: skip
    assert rec == PeerRecord.model_validate(fields)
    assert rec.model_dump() == PeerRecord.model_validate(fields).model_dump()
    assert board.records() is board.records()  # one list until a record changes
    board.publish(1, "QmPeer1", "", epoch=0, phase_epoch=0, phase_samples=0, throughput=0.0, done_epoch=0,
                  done_samples=0, updated_at=13.0)  # fmt: skip
    assert [r.peer_id for r in board.records()] == ["QmPeer1", "QmPeer2"]


@pytest.mark.parametrize(
    "key, value",
    [("aggregation", "centered_clip"), ("error_feedback", True), ("max_update_ratio", 0.0), ("clip_iters", 3)],
)
def test_a_scenario_that_sets_what_the_simulator_does_not_model_is_refused(key, value):
    """Issue 27 item 3: ``aggregation = "centered_clip"`` was silently simulated as a plain mean."""
    table = {key: value, **({"compression": "int8"} if key == "error_feedback" else {})}
    with pytest.raises(ValueError, match=f"averaging.{key} = .*the simulator does not model this"):
        parse_scenario({"averaging": table})


def test_what_the_simulator_models_is_accepted_and_exact_average_follows_the_strategy():
    assert parse_scenario({"averaging": {"compression": "int8", "drop_failed": True}}).averaging.exact_average
    assert not parse_scenario({"averaging": {"strategy": "moshpit", "target_group_size": 4}}).averaging.exact_average
