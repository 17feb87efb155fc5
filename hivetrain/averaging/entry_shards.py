"""Matchmaking entries in shards, so that no round key's DHT value grows with the swarm (issue 23 item 3).

Every ready peer stores a signed ``ReadyEntry`` (~1.55 KB stored) for its round key. Under one key,
``{prefix}.{round_key}.mm``, they made a value of 1.55 MB at 1,000 ready peers and 15.5 MB at 10,000: past hivemind's
4 MiB message limit, where a read of the key fails whole. In a swarm whose peer records are sharded at level L
(``peers.record_shards``: ~64 records a shard, at most 96 before the level rises), entries go one level coarser,
L - ``ENTRY_SHARD_OFFSET``: under ``{round key's key}.b{bits}.{shard}``, the shard being the first ``bits`` bits of
sha256(peer id) (``record_shards.shard_of``), at most ~192 entries (~300 KB) a shard. Declarations stay under the
round key itself (large ones by reference: ``decl_store``).

A reader reads the round key and every shard of each level in use (``read_keys``): the same bytes as one key of
every entry, in values of bounded size (the reads are spaced by the matchmaker's read budget whatever their number).
The level is the swarm's (its coordinator's word, as the records follow it), so every peer stores and reads at the
same one; while the swarm moves to a new level a peer stores and reads at both (``SwarmView.shard_levels``: the
previous level for one record TTL after a change), as records do. Below ~96 trainers (level 0) everything stays under
the round key, as before.
"""

from __future__ import annotations

from collections.abc import Iterable

from hivetrain.peers.record_shards import shard_of

ENTRY_SHARD_OFFSET = 1  # entries are sharded this many levels coarser than the peer records


def entry_levels(record_levels: Iterable[int]) -> tuple[int, ...]:
    """The entry shard levels for the swarm's record levels (current first; (0,) when none are given)."""
    levels = tuple(dict.fromkeys(max(0, int(b) - ENTRY_SHARD_OFFSET) for b in record_levels))
    return levels or (0,)


def _shard_key(round_key_key: str, bits: int, shard: int) -> str:
    return f"{round_key_key}.b{bits}.{shard}"


def entry_key(round_key_key: str, peer_id: str, bits: int) -> str:
    """Where ``peer_id`` stores its entry at level ``bits``: the round key's key at level 0, else its shard's."""
    return round_key_key if bits == 0 else _shard_key(round_key_key, bits, shard_of(peer_id, bits))


def read_keys(round_key_key: str, levels: Iterable[int]) -> list[str]:
    """Every key a reader gets at ``levels``: the round key's (declarations; level-0 entries) and each shard."""
    keys = [round_key_key]
    for bits in levels:
        keys += [_shard_key(round_key_key, bits, shard) for shard in range(1 << bits)] if bits else []
    return keys
