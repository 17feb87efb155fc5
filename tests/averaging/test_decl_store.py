"""Large group declarations go into the DHT as a small reference plus chunks (``averaging.decl_store``): no DHT value
grows with the group, and what a reader assembles is the declaration the leader signed, or nothing."""

from __future__ import annotations

import os
import time

import msgpack
import pytest
from hivemind.utils import ValueWithExpiration

from hivetrain.averaging import decl_store, matchmaker
from hivetrain.averaging.decl_store import (
    CHUNK_BYTES,
    MAX_DECLARATION_BYTES,
    DeclarationChunk,
    DeclarationRef,
    assemble,
    split_declaration,
)
from hivetrain.averaging.matchmaker import Matchmaker
from hivetrain.peers.validators import RecordBounds, check_record

from .conftest import start_swarm
from .test_matchmaking import GRACE, PREFIX, TTL, FakeDHT, FakeNode, declaration, entry, keys  # noqa: F401


def _member(i: int, name: str = "P"):
    """An entry the size of a real signed one (RSA-2048 public key and signature: ~0.9 KB)."""
    return entry(f"{name}{i:04d}").model_copy(update={"public_key": b"k" * 270, "signature": b"s" * 256})


def test_a_declaration_of_a_thousand_members_splits_into_bounded_chunks_and_back() -> None:
    decl = declaration([_member(i) for i in range(1000)], 100.0)
    ref, chunks = split_declaration(decl)
    raw = msgpack.packb(decl.model_dump(), use_bin_type=True)
    assert ref.num_bytes == len(raw) > 3 * CHUNK_BYTES and len(chunks) == ref.num_chunks
    assert all(len(c.data) <= CHUNK_BYTES for c in chunks)
    assert len(msgpack.packb(ref.model_dump(), use_bin_type=True)) < 512  # what every poll of the round key reads
    assert assemble(ref, chunks) == decl


def _tampered(chunks: list[DeclarationChunk], i: int, **update) -> list[DeclarationChunk]:
    return [c.model_copy(update=update) if j == i else c for j, c in enumerate(chunks)]


def test_assembly_refuses_a_missing_reordered_altered_or_foreign_chunk() -> None:
    decl = declaration([_member(i) for i in range(400)], 100.0)
    ref, chunks = split_declaration(decl)
    assert len(chunks) >= 2
    assert assemble(ref, [*chunks[:-1], None]) is None
    assert assemble(ref, chunks[:-1]) is None
    assert assemble(ref, [chunks[1], chunks[0], *chunks[2:]]) is None
    flipped = bytes([chunks[0].data[0] ^ 1]) + chunks[0].data[1:]
    assert assemble(ref, _tampered(chunks, 0, data=flipped)) is None  # the hash
    assert assemble(ref, _tampered(chunks, 1, round_id="ab" * 16)) is None
    assert assemble(ref, _tampered(chunks, 1, leader="Mallory")) is None
    assert assemble(ref.model_copy(update={"num_members": 399}), chunks) is None  # says other than it holds
    other_ref, _ = split_declaration(declaration([_member(i, "Q") for i in range(400)], 100.0))
    assert assemble(other_ref, chunks) is None
    with pytest.raises(ValueError):
        DeclarationRef(**{**ref.model_dump(), "num_bytes": MAX_DECLARATION_BYTES + 1})


def _matchmaker(pid, key, dht) -> Matchmaker:
    return Matchmaker(FakeNode(pid, key, dht), PREFIX, poll_interval_s=0.05, declare_grace_s=GRACE)


def _by_reference(monkeypatch, chunk_bytes: int = 700) -> None:
    """Chunks of ``chunk_bytes``, and every declaration stored by reference: three signed members are enough."""
    monkeypatch.setattr(decl_store, "CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(matchmaker, "INLINE_BYTES", chunk_bytes)


def _declared(signers, monkeypatch):
    """Three signed members on a fake DHT whose first declares them all, by reference: (dht, declaration)."""
    _by_reference(monkeypatch)
    dht = FakeDHT()
    mms = [_matchmaker(pid, key, dht) for pid, key in signers]
    members = tuple(mm.make_entry("e0", os.urandom(16), "127.0.0.1", 4000, bytes(32), 5.0) for mm in mms)
    return dht, mms[0].declare(members[0], members, "full", TTL)


def _wait_for_declarations(mm: Matchmaker, round_key: str, timeout_s: float = 10.0) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = mm.read(round_key)[1]
        if found:
            return found
        time.sleep(0.05)
    return []


def test_a_reader_assembles_the_leaders_declaration_from_its_chunks(keys, monkeypatch) -> None:  # noqa: F811
    dht, decl = _declared(keys, monkeypatch)
    under_round_key = dht.data[f"{PREFIX}.e0.mm"]
    assert len(under_round_key) == 1  # the reference only
    ref = DeclarationRef.model_validate(next(iter(under_round_key.values())).value)
    chunk_keys = [k for k in dht.data if k.startswith(f"{PREFIX}.e0.mm.d.{decl.round_id}.")]
    assert ref.round_id == decl.round_id and ref.num_chunks == len(chunk_keys) >= 3
    stored = [len(msgpack.packb(v.value, use_bin_type=True)) for k in chunk_keys for v in dht.data[k].values()]
    assert max(stored) < 700 + 400  # no stored value holds more than a chunk (and its fields)
    reader = _matchmaker(*keys[2], dht)
    assert _wait_for_declarations(reader, "e0") == [decl]  # verified: the leader's signature, every member's entry


def test_a_forged_chunk_yields_no_declaration_and_is_not_read_forever(keys, monkeypatch) -> None:  # noqa: F811
    dht, decl = _declared(keys, monkeypatch)
    first = f"{PREFIX}.e0.mm.d.{decl.round_id}.0"
    ((subkey, item),) = dht.data[first].items()
    bad = DeclarationChunk.model_validate(item.value).model_copy(update={"data": b"x" * 700})
    dht.data[first][subkey] = ValueWithExpiration(bad.model_dump(), item.expiration_time)
    reader = _matchmaker(*keys[2], dht)
    assert _wait_for_declarations(reader, "e0", timeout_s=2.0) == []
    ref = DeclarationRef.model_validate(next(iter(dht.data[f"{PREFIX}.e0.mm"].values())).value)
    assert reader._fetcher.want(f"{PREFIX}.e0.mm", ref) is None  # its attempts are spent: polls stop reading it


def test_a_reference_and_its_chunks_pass_every_honest_nodes_guard(keys, monkeypatch) -> None:  # noqa: F811
    """What the matchmaker stores is what ``RecordGuard`` accepts, and an inline declaration past the cap is not."""
    pid, key = keys[0]
    dht = FakeDHT()
    mm = _matchmaker(pid, key, dht)
    decl = declaration([_member(i) for i in range(1000)], time.time()).model_copy(update={"leader": pid})
    ref, chunks = split_declaration(decl)
    marker, now, bounds = mm.node.owner_marker, time.time(), RecordBounds()

    def check(kind: str, record, tail: bytes):
        return check_record(kind, "", marker + tail, msgpack.packb(record.model_dump(), use_bin_type=True),
                            now + 60, now, bounds)  # fmt: skip

    assert check("group", ref, b"|group").ok
    assert all(check("chunk", c, b"|chunk").ok for c in chunks)
    assert check("group", decl, b"|group").rule == "size"  # 0.9 MB inline: refused
    assert check("chunk", chunks[0].model_copy(update={"leader": "Qm" + "z" * 44}), b"|chunk").rule == "signer"


@pytest.mark.slow
def test_real_dht_nodes_store_and_serve_a_declaration_by_reference(monkeypatch) -> None:
    """Three real DHT peers with their record guards: the leader's reference and chunks are stored, and another
    peer assembles and verifies the declaration."""
    _by_reference(monkeypatch, chunk_bytes=1000)
    nodes = start_swarm(3)
    try:
        mms = [Matchmaker(n, PREFIX, poll_interval_s=0.05, declare_grace_s=GRACE) for n in nodes]
        mms.sort(key=lambda mm: mm.node.peer_id)
        members = tuple(mm.make_entry("e5", os.urandom(16), "127.0.0.1", 4000, bytes(32), 20.0) for mm in mms)
        decl = mms[0].declare(members[0], members, "window", TTL)
        assert _wait_for_declarations(mms[2], "e5", timeout_s=20.0) == [decl]
    finally:
        for n in nodes:
            n.shutdown()


def test_a_chunk_stored_after_its_reference_is_read_when_it_lands(keys, monkeypatch) -> None:  # noqa: F811
    """The leader's stores are asynchronous: a reader may see the reference before a chunk. Its fetch asks again
    for what it did not find (``decl_store.RETRY_S``) instead of spending an attempt at once."""
    dht, decl = _declared(keys, monkeypatch)
    last = f"{PREFIX}.e0.mm.d.{decl.round_id}.{len([k for k in dht.data if '.d.' in k]) - 1}"
    late = dht.data.pop(last)
    reader = _matchmaker(*keys[2], dht)
    for _ in range(10):  # polls meanwhile: each would spend an attempt if a fetch gave up on a missing chunk at once
        assert reader.read("e0")[1] == []
        time.sleep(decl_store.RETRY_S / 5)
    dht.data[last] = late
    assert _wait_for_declarations(reader, "e0", timeout_s=5.0) == [decl]
    assert reader._fetcher._attempts[decl.round_id] == decl_store.FETCH_ATTEMPTS  # found: never read again
