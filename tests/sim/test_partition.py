"""The simulated network partition (``sim.partition``): config checks, what each side sees, and a split-and-heal run."""

from __future__ import annotations

import numpy as np
import pytest

from hivetrain.sim.config import PartitionSettings, parse_scenario
from hivetrain.sim.dataparallel import DataParallelSim
from hivetrain.sim.dht import RecordBoard
from hivetrain.sim.partition import PartitionTracker, SideBoard
from hivetrain.sim.rounds import RoundEngine

from .conftest import tiny


def test_partition_config_is_validated():
    with pytest.raises(ValueError, match="heal_s"):
        parse_scenario({"partition": {"share": 0.3, "at_s": 100.0, "heal_s": 50.0}})
    with pytest.raises(ValueError, match="partition.share"):
        parse_scenario({"partition": {"share": 1.0, "at_s": 0.0, "heal_s": 50.0}})
    with pytest.raises(ValueError, match="unknown key"):
        parse_scenario({"partition": {"fraction": 0.3}})
    split = PartitionSettings(share=0.3, at_s=10.0, heal_s=20.0)
    assert [split.active(t) for t in (9.9, 10.0, 19.9, 20.0)] == [False, True, True, False]
    assert not PartitionSettings().active(0.0)  # share 0: no partition


def test_side_board_shows_only_its_side():
    board = RecordBoard(4)
    for slot in range(4):
        board.publish(slot, f"p{slot}", "h", epoch=1, phase_epoch=1, phase_samples=0, throughput=1.0, done_epoch=0,
                      done_samples=0, updated_at=5.0)  # fmt: skip
    side = np.array([0, 1, 0, 1], np.int8)
    one, zero = SideBoard(board, lambda: side, 1), SideBoard(board, lambda: side, 0)
    assert [r.peer_id for r in one.records()] == ["p1", "p3"]
    assert [r.peer_id for r in zero.records()] == ["p0", "p2"]
    assert len(board.records()) == 4  # the board itself is unchanged
    board.publish(1, "p1", "h2", epoch=2, phase_epoch=2, phase_samples=0, throughput=1.0, done_epoch=1,
                  done_samples=8, updated_at=6.0)  # fmt: skip
    assert [r.epoch for r in one.records()] == [2, 1]  # a view follows the board between ticks
    board.grow(6)  # the swarm grew; slots without a side yet are seen by nobody
    assert one.published.tolist() == [False, True, False, True, False, False]


def test_cut_time_of_transfers():
    t = PartitionTracker(PartitionSettings(share=0.5, at_s=100.0, heal_s=200.0), seed=0)
    for slot in range(40):
        t.add(slot)
    zero, one = np.flatnonzero(t.side[:40] == 0), np.flatnonzero(t.side[:40] == 1)
    assert len(zero) and len(one)
    across = np.array([zero[0], one[0]])
    assert t.cut_s(across, 50.0) == 100.0  # begun before the split: cut when it starts
    assert t.cut_s(across, 150.0) == 150.0  # begun during it: cut at once
    assert t.cut_s(across, 250.0) == float("inf")  # after the heal: fine
    assert t.cut_s(zero[:3], 150.0) == float("inf")  # one side: never cut


def _split_run(**tables) -> DataParallelSim:
    sc = tiny(sim={"num_peers": 30, "outer_steps": 500, "max_sim_s": 700.0},
              partition={"share": 0.4, "at_s": 150.0, "heal_s": 450.0}, **tables)  # fmt: skip
    sim = DataParallelSim(sc)
    sim.run()
    return sim


def test_split_sides_train_apart_and_never_group_across():
    declared: list[tuple[float, list[int]]] = []
    start_group = RoundEngine._start_group

    def spy(self, key, decl, now):
        declared.append((now, [self.sim.state.index_of[m.peer_id] for m in decl.members]))
        return start_group(self, key, decl, now)

    RoundEngine._start_group = spy
    try:
        sim = _split_run()
    finally:
        RoundEngine._start_group = start_group
    side = sim.partition.side
    during = [members for now, members in declared if 150.0 <= now < 450.0]
    assert during and all(len(set(side[members].tolist())) == 1 for members in during)
    assert any(len(set(side[members].tolist())) == 2 for now, members in declared if now < 150.0)
    p = sim.metrics.summary["partition"]
    assert p["both_sides_trained"] and p["diverged_outer_steps"] > 0
    assert sum(p["side_sizes_at_split"]) == 30
    steps = p["outer_steps_during_split"]
    assert steps == [p["median_epoch_at_heal"][k] - p["median_epoch_at_split"][k] for k in (0, 1)]


def test_each_side_reads_only_its_records_while_split():
    sc = tiny(sim={"num_peers": 30}, partition={"share": 0.4, "at_s": 0.0, "heal_s": 1e9})
    sim = DataParallelSim(sc)
    seen: list[tuple[int, set[str]]] = []
    real = sim.records_for

    def spy(slot):
        records = real(slot)
        seen.append((int(sim.partition.side[slot]), {r.peer_id for r in records}))
        return records

    sim.records_for = spy
    sim.run()
    side_of = {sim.state.peer_ids[s]: int(sim.partition.side[s]) for s in range(sim.state.size)}
    assert seen
    assert all(side_of[p] == side for side, ids in seen for p in ids)


def test_no_partition_report_has_none():
    sim = DataParallelSim(tiny())
    sim.run()
    assert sim.metrics.summary["partition"] is None
    assert not sim.partition.enabled


def test_lineage_follows_downloads_and_reconvergence_is_timed():
    t = PartitionTracker(PartitionSettings(share=0.5, at_s=10.0, heal_s=20.0), seed=1)
    for slot in range(6):
        t.add(slot)
    t.side[:6] = [0, 0, 0, 1, 1, 1]
    alive, holding = np.arange(6), np.ones(6, bool)
    t.sample(10.0, alive, holding, np.array([2, 2, 2, 2, 2, 2]), 0.0)
    assert t.lineage[:6].tolist() == [0, 0, 0, 1, 1, 1]  # at the split each holds its side's model
    t.sample(20.0, alive, holding, np.array([5, 5, 5, 4, 4, 4]), 0.1)
    t.on_download(3, 0, 25.0)  # after the heal, side-1 peers take side 0's state
    t.on_download(4, 1, 26.0)
    t.sample(26.0, alive, holding, np.array([5, 5, 5, 5, 5, 4]), 0.1)
    assert t.reconverged_at is None
    t.on_download(5, 2, 30.0)
    t.sample(30.0, alive, holding, np.array([6, 6, 6, 6, 6, 6]), 0.0)
    s = t.summary(30.0)
    assert s["outer_steps_during_split"] == [3.0, 2.0] and s["diverged_outer_steps"] == 2.0
    assert s["downloads_after_heal_by_lineage"] == [3, 0]
    assert s["reconverged_s_after_heal"] == 10.0 and s["reconverged95_s_after_heal"] == 10.0
    assert s["winning_lineage"] == 0 and s["side_sizes_at_split"] == [3, 3]
