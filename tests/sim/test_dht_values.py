"""The simulated DHT's sizes follow the production storage: large declarations by reference (``decl_store``),
entries in shards once the swarm is sharded (``entry_shards``), so no value grows with the swarm."""

from __future__ import annotations

import pytest

from hivetrain.averaging.decl_store import CHUNK_BYTES
from hivetrain.averaging.entry_shards import entry_levels
from hivetrain.averaging.matchmaking import GroupDeclaration
from hivetrain.peers.record_shards import level_for
from hivetrain.sim import dht as simdht
from hivetrain.sim.dht import RoundKey

LIMIT = 512 * 1024  # issue 23: the largest DHT value at any swarm size


def _declaration(entries) -> GroupDeclaration:
    return GroupDeclaration.model_construct(leader=entries[0].peer_id, round_key="e0", round_id="a" * 32,
                                            members=tuple(entries), declared_at=1.7e9, reason="window")  # fmt: skip


def test_a_declaration_is_inline_up_to_a_chunk_and_by_reference_beyond() -> None:
    small, big = simdht.stored_declaration(64), simdht.stored_declaration(1000)
    assert small == simdht.StoredDeclaration(simdht.declaration_bytes(64))  # read with the round key
    assert big.under_key < 1024 and big.chunk < LIMIT and big.chunks == -(-big.fetch // CHUNK_BYTES)
    assert big.fetch >= simdht.declaration_bytes(1000) - 1024  # a reader still reads the whole declaration, once


def test_the_largest_matchmaking_value_at_a_thousand_peers_is_one_entry_shard() -> None:
    key = RoundKey(0)
    entries = [simdht.fake_entry(f"Qm{i:044d}", "e0", bytes(16), 1.7e9, 1.7e9 + 60) for i in range(1000)]
    key.entries = {e.peer_id: e for e in entries}
    one_key = key.largest_value(0)
    assert one_key == 1000 * simdht.entry_bytes() > 2 * LIMIT  # every entry under the round key: 1.55 MB
    at3 = key.largest_value(3)  # the level a swarm of 1,000 trainers' records call for, one coarser
    assert at3 == max(simdht.shard_loads(list(key.entries), 3)) * simdht.entry_bytes() < LIMIT
    key.declare(_declaration(entries))  # the epoch's two-stage declaration: by reference, not 0.9 MB here
    assert key.largest_value(3) == at3 and key.declarations_bytes < 1024


@pytest.mark.parametrize("num_peers", [1000, 10_000])
def test_at_the_swarms_level_no_entry_shard_reaches_the_limit(num_peers: int) -> None:
    """At the level the records rule picks for this many trainers (4 at 1,000, 7 at 10,000), entries one coarser."""
    key = RoundKey(0)
    ids = [f"Qm{i:044d}" for i in range(num_peers)]
    key.entries = {p: simdht.fake_entry(p, "e0", bytes(16), 1.7e9, 1.7e9 + 60) for p in ids}
    (level,) = entry_levels([level_for(num_peers)])
    assert level >= 3 and key.largest_value(level) < LIMIT < key.largest_value(0)
