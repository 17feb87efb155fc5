"""Peer records in shards (issue 23 item 3): the level, the shard of a peer, what a heartbeat reads, and on real DHT
nodes, trainers that follow the coordinator's level, see each other through shards, and cannot fill another's."""

import time
from collections import Counter

import pytest

from hivetrain.diloco.swarm_view import SwarmView
from hivetrain.peers.loop import LoopThread
from hivetrain.peers.record_shards import (
    MAX_SHARD_BITS,
    ShardPlan,
    carries_sketch,
    decide_shard_bits,
    level_for,
    probe_level,
    shard_key,
    shard_of,
)
from hivetrain.peers.records import fetch_records_at, publish_record
from tests.records import peer_record


def test_a_peers_shard_is_fixed_by_its_id_and_spreads_peers_evenly():
    ids = [f"Qm{i:044d}" for i in range(8192)]
    assert all(shard_of(p, 0) == 0 for p in ids[:10])
    counts = Counter(shard_of(p, 4) for p in ids)
    assert set(counts) == set(range(16)) and max(counts.values()) < 1.25 * 512 and min(counts.values()) > 0.75 * 512
    assert [shard_of(p, 4) for p in ids[:50]] == [shard_of(p, 4) for p in ids[:50]]
    # one level deeper splits each shard in two: a prefix of the hash
    assert all(shard_of(p, 5) >> 1 == shard_of(p, 4) for p in ids[:500])
    with pytest.raises(ValueError):
        shard_of("x", MAX_SHARD_BITS + 1)


def test_the_level_rises_at_once_and_falls_one_step_at_a_time_with_hysteresis():
    assert decide_shard_bits(96, 0)[0] == 0  # 96 records per shard is still fine
    assert decide_shard_bits(97, 0)[0] == 1
    assert decide_shard_bits(60, 1)[0] == 1  # 30 per shard: inside the band, no flapping back
    assert decide_shard_bits(47, 1)[0] == 0  # 47 fit one key again
    assert decide_shard_bits(100_000, 3)[0] == 10  # up at once, however far: a crowd never waits in a full key
    assert decide_shard_bits(40, 4)[0] == 3  # down one step per call
    assert decide_shard_bits(10**9, MAX_SHARD_BITS)[0] == MAX_SHARD_BITS
    assert level_for(3) == 0 and level_for(100) == 1 and level_for(1000) == 4 and level_for(10_000) == 7
    # no shard ends over 512 KiB at 10,000 trainers (records of ~1.4 KiB without the sketch, ~4 KiB with it)
    assert 10_000 / (1 << level_for(10_000)) * 4077 < 512 * 1024


def test_at_level_0_a_heartbeat_reads_one_key_as_before():
    plan = ShardPlan("r", "me")
    assert plan.read_keys(0.0) == [(0, 0)] and plan.publish_keys(0.0) == ["r.peers"]
    plan.record_read(0, 0, [peer_record("a"), peer_record("me")], 0.0)
    assert [r.peer_id for r in plan.view(1.0)] == ["a", "me"] and plan.coverage(1.0) == 1.0


def test_a_sharded_view_reads_ours_and_rotates_through_the_others_within_a_ttl():
    plan = ShardPlan("r", "me", extra_shards=2, max_age_s=30.0)
    plan.set_level(3, now=-100.0)  # long settled: no level-0 records to fall back on
    own = shard_of("me", 3)
    seen: set[int] = set()
    for beat in range(4):  # 7 other shards, 2 per heartbeat: all covered in 4 heartbeats
        keys = plan.read_keys(float(beat))
        assert keys[0] == (0, 0) and (3, own) in keys
        for b, s in keys:
            plan.record_read(b, s, [peer_record(f"p{b}.{s}", updated_at=float(beat))] if b else [], float(beat))
        seen |= {s for b, s in keys if b == 3}
    assert seen == set(range(8)) and plan.coverage(4.0) == 1.0
    assert plan.coverage(31.5) < 1.0  # reads older than a TTL leave the view
    assert len(plan.view(4.0)) == 8


def test_after_a_level_change_both_levels_are_published_and_read_for_one_ttl():
    plan = ShardPlan("r", "me", extra_shards=1, max_age_s=30.0)
    plan.set_level(2, now=0.0)
    plan.record_read(2, shard_of("me", 2), [peer_record("old-level-peer")], 0.5)
    assert plan.set_level(3, now=1.0)
    assert plan.publish_keys(2.0) == [shard_key("r", 3, shard_of("me", 3)), shard_key("r", 2, shard_of("me", 2))]
    assert (2, shard_of("me", 2)) in plan.read_keys(2.0)
    assert "old-level-peer" in {r.peer_id for r in plan.view(2.0)}  # not lost while the swarm moves
    assert plan.publish_keys(40.0) == [shard_key("r", 3, shard_of("me", 3))]
    assert all(b == 3 or b == 0 for b, _ in plan.read_keys(40.0))


def test_without_a_coordinator_the_deepest_level_where_another_trainer_lives_wins():
    now = 1000.0
    found = {1: [peer_record("x", updated_at=now - 100)], 2: [peer_record("y", updated_at=now - 2)], 3: []}
    assert probe_level(found, "me", now, stale_after_s=30.0) == 2
    assert probe_level({1: [peer_record("me", updated_at=now)]}, "me", now, 30.0) == 0  # only ourselves


@pytest.mark.slow
def test_trainers_follow_the_coordinators_level_see_each_other_and_cannot_fill_another_shard(make_node):
    coordinator = make_node()
    trainers = [make_node(coordinator.visible_maddrs()) for _ in range(3)]
    for node in (coordinator, *trainers):
        node.guard_run("r")
    publish_record(
        coordinator.dht,
        coordinator.owner_marker,
        peer_record(coordinator.peer_id, role="coordinator", record_shard_bits=2, updated_at=time.time()),
        30,
    )
    loop = LoopThread()
    views = []
    clock = [0.0]  # monotonic, for the views: moved past the level change's TTL below
    try:
        for node in trainers:
            make = lambda node=node: peer_record(node.peer_id, epoch=3, updated_at=time.time())  # noqa: E731
            view = SwarmView(
                node, loop, "r", "f", make, record_ttl_s=30, record_interval_s=60,
                coordinator_id=coordinator.peer_id, extra_shards=3, clock=lambda: clock[0],
            )  # fmt: skip
            views.append(view)
            view.refresh()  # learns level 2 from the coordinator's record
            assert view.shard_bits == 2
        clock[0] = 31.0  # past the TTL in which the previous level (0) is still published and read
        for view in views:
            view.publish()
        for view in views:  # level 0 (the coordinator) and all 4 shards in one heartbeat
            view.refresh()
            assert view.view_ok and view.coverage == 1.0
            assert {r.peer_id for r in view.records} == {n.peer_id for n in (coordinator, *trainers)}
        # nobody's record is under the level-0 key but the coordinator's
        base = fetch_records_at(coordinator.dht, ["r.peers"], "r")["r.peers"]
        assert [r.peer_id for r in base] == [coordinator.peer_id]
        # a trainer storing its record in a shard not its own is refused by every honest node
        mine = shard_of(trainers[0].peer_id, 2)
        other = next(s for s in range(4) if s != mine)
        record = peer_record(trainers[0].peer_id, updated_at=time.time())
        trainers[0].dht.store(
            shard_key("r", 2, other), record.model_dump(mode="json"), time.time() + 30, subkey=trainers[0].owner_marker
        )
        for node in (coordinator, trainers[1]):
            found = fetch_records_at(node.dht, [shard_key("r", 2, other)], "r")[shard_key("r", 2, other)]
            assert trainers[0].peer_id not in {r.peer_id for r in found or []}
    finally:
        for view in views:
            view.stop()
        loop.stop(timeout_s=2)


def test_in_a_sharded_swarm_one_trainer_in_8_carries_its_sketch_each_epoch_and_every_one_in_turn():
    ids = [f"Qm{i:044d}" for i in range(800)]
    assert all(carries_sketch(p, 5, 0) for p in ids[:20])  # one key: everyone, as before
    per_epoch = [sum(carries_sketch(p, e, 3) for p in ids) for e in range(8)]
    assert all(70 <= n <= 130 for n in per_epoch)  # an eighth each (100 expected)
    assert all(any(carries_sketch(p, e, 3) for e in range(8)) for p in ids)  # and everyone once in 8 epochs


def test_a_crowd_in_the_level_0_key_moves_trainers_up_before_the_coordinator_says_so():
    class Node:
        peer_id, dht = "me", None

    view = SwarmView(Node(), None, "r", "f", lambda: None, record_ttl_s=30, record_interval_s=5, coordinator_id="c")
    coordinator = peer_record("c", role="coordinator", record_shard_bits=0)
    crowd = [peer_record(f"t{i}") for i in range(200)]
    assert view._level_from([coordinator, *crowd]) == level_for(200) == 2  # 200 trainers: 4 shards of 50
    assert view._level_from([coordinator.model_copy(update={"record_shard_bits": 5}), *crowd]) == 5
    assert view._level_from([coordinator, *crowd[:50]]) == 0  # the coordinator's level while the key is not full
    assert view._level_from(None) is None  # a failed read of the level-0 key changes nothing


def test_coverage_counts_the_id_space_the_view_holds_across_a_level_change():
    plan = ShardPlan("r", "me", extra_shards=1, max_age_s=30.0)
    assert plan.set_level(2, now=-100.0) and plan.coverage(-99.0) == 1.0  # leaving level 0: everyone is still there
    plan.record_read(2, 0, [], 1.0)
    plan.record_read(2, 1, [], 1.0)
    assert plan.coverage(2.0) == 0.5  # 2 of 4 shards
    plan.set_level(3, now=3.0)  # trainers publish at 2 and 3 for a TTL: the level-2 reads still count
    plan.record_read(3, 4, [], 4.0)
    assert plan.coverage(5.0) == 0.5 + 1 / 8
    assert plan.coverage(40.0) == 0.0  # past the TTL every read is stale
    plan.set_level(0, now=41.0)
    assert plan.coverage(42.0) == 1.0
