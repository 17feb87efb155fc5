"""Matchmaking entries in shards (``averaging.entry_shards``): in a sharded swarm no entry lands under the round key
itself, each goes to its peer's shard one level coarser than the records, and readers still see every entry, on a
fake DHT and on real DHT peers with their record guards."""

from __future__ import annotations

import os
import time

import torch

from hivetrain.averaging import AveragingConfig, RoundResult
from hivetrain.averaging.entry_shards import entry_key, entry_levels, read_keys
from hivetrain.averaging.matchmaker import Matchmaker
from hivetrain.peers.record_shards import shard_of

from .conftest import run_threads
from .test_matchmaking import GRACE, PREFIX, FakeDHT, FakeNode, keys  # noqa: F401


def test_entry_levels_are_one_coarser_than_the_records_and_keys_cover_every_shard() -> None:
    assert entry_levels([4]) == (3,) and entry_levels([4, 3]) == (3, 2)  # a level change: both, current first
    assert entry_levels([0]) == entry_levels([1]) == entry_levels([]) == (0,)
    assert entry_levels([1, 0]) == (0,)
    assert entry_key("k", "Qmabc", 0) == "k" and entry_key("k", "Qmabc", 2) == f"k.b2.{shard_of('Qmabc', 2)}"
    assert read_keys("k", (0,)) == ["k"]
    assert read_keys("k", (2, 1)) == ["k", "k.b2.0", "k.b2.1", "k.b2.2", "k.b2.3", "k.b1.0", "k.b1.1"]


def test_entries_go_to_their_shards_and_a_reader_sees_them_all(keys) -> None:  # noqa: F811
    dht = FakeDHT()
    mms = [
        Matchmaker(
            FakeNode(pid, key, dht), PREFIX, poll_interval_s=0.05, declare_grace_s=GRACE, record_levels=lambda: (3,)
        )  # fmt: skip
        for pid, key in keys
    ]
    entries = [mm.make_entry("e1", os.urandom(16), "127.0.0.1", 4000, bytes(32), 5.0) for mm in mms]
    for mm, e in zip(mms, entries, strict=True):
        assert mm.announce(e, 30.0).result()
    base = f"{PREFIX}.e1.mm"
    assert base not in dht.data  # nothing under the round key itself
    for mm, e in zip(mms, entries, strict=True):
        assert mm.node.owner_marker + b"|ready" in dht.data[f"{base}.b2.{shard_of(e.peer_id, 2)}"]
    seen, _ = mms[0].read("e1")
    assert {e.peer_id for e in seen} == {e.peer_id for e in entries}
    mms[1].record_levels = lambda: (0,)  # a reader at another level misses them: the level is the swarm's
    assert {e.peer_id for e in mms[1].read("e1")[0]} == set()
    mms[1].record_levels = lambda: (4, 3)  # while the swarm moves from 3 to 4, both levels are read
    assert {e.peer_id for e in mms[1].read("e1")[0]} == {e.peer_id for e in entries}


def test_a_sharded_swarm_averages_on_real_dht_peers(make_averagers) -> None:
    """Three averagers at record level 3 (entries at level 2: 4 shards): they find each other and commit one mean."""
    config = AveragingConfig(matchmaking_time_s=10.0, round_timeout_s=40.0, part_timeout_s=10.0,
                             commit_timeout_s=10.0, connect_timeout_s=10.0)  # fmt: skip
    avgs = make_averagers(3, config)
    for a in avgs:
        a.record_levels = lambda: (3,)
    expected = frozenset(a.node.peer_id for a in avgs)
    g = torch.Generator().manual_seed(3)
    inputs = [[torch.randn(256, generator=g)] for _ in avgs]
    started = time.monotonic()
    calls = [
        lambda a=a, x=x: a.average(x, 1.0, 0, 40.0, expected_peers=expected) for a, x in zip(avgs, inputs, strict=False)
    ]
    results = run_threads(calls, 60.0)
    assert all(isinstance(r, RoundResult) and len(r.group) == 3 for r in results), results
    assert time.monotonic() - started < 10.0  # closed "complete": every expected entry was found in the shards
    mean = sum(x[0].double() for x in inputs) / 3
    for r in results:
        torch.testing.assert_close(r.tensors[0], mean.float(), atol=1e-6, rtol=0)
    base = avgs[0].matchmaker._key("e0")
    dht = avgs[0].node.dht
    under_base = dht.get(base, latest=True)
    assert not [k for k in (under_base.value if under_base is not None else {}) if k.endswith(b"|ready")]
    shards = [dht.get(f"{base}.b2.{s}", latest=True) for s in range(4)]
    assert sum(len(found.value) for found in shards if found is not None) == 3  # one entry each, in its shard
