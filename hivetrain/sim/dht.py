"""The simulated DHT: the swarm's record board (one key, a subkey per peer) and operation/size accounting.

What is stored is what hivetrain stores: ``PeerRecord`` under ``"{run_id}.peers"`` (``peers.records``), and per round
key ``ReadyEntry`` and ``GroupDeclaration`` under ``"{prefix}.{round_key}.mm"`` (``averaging.matchmaking``; a
declaration of more than ~200 members by reference, its chunks under keys of their own: ``stored_declaration``). Their
sizes are measured once from real instances serialised the way hivemind stores them (msgpack of the pydantic dump)
plus the subkey a signed value carries (hivemind's ``RSASignatureValidator`` owner marker with a 2048-bit RSA public
key, and the value's signature). The routing of a DHT get (log N hops) is not modelled: a get or store is one
operation, and its bytes are the value's size. Past ~96 trainers the records live in shards
(``peers/record_shards.py``): the peers key's size is then that of the fullest shard, and a heartbeat reads the
level-0 key, the peer's own shard and one more (``ShardPlan``, ``extra_shards`` 1). The decision functions still see
every record (the board): the sample a sharded view holds is not modelled.

``RecordBoard`` keeps every peer's latest published record as numpy columns (for the vectorised schedule model) and as
real ``PeerRecord`` objects (for the production decision functions), rebuilding only the records that changed.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import msgpack
import numpy as np

from hivetrain.averaging import decl_store
from hivetrain.averaging.group_records import GroupDeclaration, ReadyEntry
from hivetrain.peers import record_shards
from hivetrain.peers.records import PeerRecord

RUN_ID = "sim"
PEERS_KEY = f"{RUN_ID}.peers"
_SIGNATURE_BYTES = 256 + 13  # an RSA-2048 signature in hivemind's "[signature:...]" suffix
_FAKE_KEY = b"ssh-rsa " + b"A" * 364  # the length of a 2048-bit key in hivemind's ssh format (372 bytes)


def _owner_marker_bytes() -> int:
    return len(b"[owner:" + _FAKE_KEY + b"]")


SKETCH_TEXT_BYTES = 2732  # ``PeerRecord.param_sketch`` when carried (base64 of 2 KiB)


def mean_record_bytes(shard_bits: int) -> float:
    """Bytes of a stored trainer record on average at shard level ``shard_bits``: every record carries its θ sketch
    at level 0, one in 2^SKETCH_BITS in a sharded swarm (``record_shards.carries_sketch``)."""
    share = 1.0 if shard_bits == 0 else 1.0 / (1 << record_shards.SKETCH_BITS)
    return record_bytes() - (1.0 - share) * (SKETCH_TEXT_BYTES + 3)  # msgpack's str header: 3 bytes


def shard_loads(peer_ids: list[str], shard_bits: int) -> np.ndarray:
    """Records per shard at level ``shard_bits`` for these peers (int64, 2^bits entries)."""
    shards = [record_shards.shard_of(p, shard_bits) for p in peer_ids]
    return np.bincount(np.asarray(shards, dtype=np.int64), minlength=1 << shard_bits)


@functools.cache
def record_bytes() -> int:
    """Bytes of one stored ``PeerRecord`` (a trainer's, with its 2 KiB parameter sketch), subkey and signature."""
    record = PeerRecord(
        peer_id="Qm" + "x" * 44, role="trainer", version="0.1.0", run_id=RUN_ID, model_fingerprint="f" * 64,
        epoch=123, throughput=12.5, state_hash="a" * 64, param_sketch="s" * 2732, samples_total=10**6,
        compute_s=1e4, maddrs=("/ip4/203.0.113.7/tcp/31337/p2p/Qm" + "x" * 44,), loss=3.2, eval_loss=3.3,
        rounds_committed=100, last_round_s=12.0, last_group_size=64, phase_epoch=123, phase_samples=400,
        done_epoch=122, done_samples=800, updated_at=1.7e9,
    )  # fmt: skip
    value = msgpack.packb(record.model_dump(mode="json"), use_bin_type=True)
    return len(value) + _owner_marker_bytes() + _SIGNATURE_BYTES


def fake_entry(
    peer_id: str, round_key: str, session: bytes, announced_at: float, deadline: float, window_closes_at: float = 0.0
) -> ReadyEntry:
    """A ``ReadyEntry`` with the sizes of a real one; its signature is not valid (``decide`` does not check it: the
    matchmaker verifies entries before they reach ``decide``). ``window_closes_at`` 0 = the window closes at
    ``deadline``."""
    return ReadyEntry.model_construct(
        peer_id=peer_id, round_key=round_key, session=session, host="203.0.113.7", port=31337, kx_public=b"k" * 32,
        announced_at=announced_at, deadline=deadline, window_closes_at=window_closes_at, public_key=_FAKE_KEY,
        signature=b"s" * 256,
    )  # fmt: skip


@functools.cache
def entry_bytes() -> int:
    """Bytes of one stored ``ReadyEntry`` (subkey and hivemind signature included)."""
    e = fake_entry("Qm" + "x" * 44, "e123", b"0" * 16, 1.7e9, 1.7e9 + 5)
    return len(msgpack.packb(e.model_dump(), use_bin_type=True)) + _owner_marker_bytes() + _SIGNATURE_BYTES


def declaration_bytes(num_members: int) -> int:
    """Bytes of a stored ``GroupDeclaration`` listing ``num_members`` signed entries."""
    e = fake_entry("Qm" + "x" * 44, "e123", b"0" * 16, 1.7e9, 1.7e9 + 5)
    d = GroupDeclaration.model_construct(
        leader=e.peer_id, round_key="e123", round_id="r" * 32, members=(e,), declared_at=1.7e9, reason="full",
        signature=b"s" * 256,
    )  # fmt: skip
    one = len(msgpack.packb(d.model_dump(), use_bin_type=True))
    per_member = len(msgpack.packb(e.model_dump(), use_bin_type=True))
    return one + (num_members - 1) * per_member + _owner_marker_bytes() + _SIGNATURE_BYTES


class StoredDeclaration(NamedTuple):
    """How a declaration is stored (``averaging.decl_store``), in bytes: its value under the round key (inline, or
    its ``DeclarationRef``), its largest chunk's value, and what one reader reads (gets: ``chunks``) to assemble it
    (0 for an inline one: read with the round key)."""

    under_key: int
    chunk: int = 0
    fetch: int = 0
    chunks: int = 0


@functools.cache
def stored_declaration(num_members: int) -> StoredDeclaration:
    """How a declaration of ``num_members`` signed entries is stored (``StoredDeclaration``)."""
    full = declaration_bytes(num_members)
    raw = full - _owner_marker_bytes() - _SIGNATURE_BYTES
    if raw <= decl_store.INLINE_BYTES:
        return StoredDeclaration(full)
    fields = {"leader": "Qm" + "x" * 44, "round_key": "e123", "round_id": "a" * 32, "declared_at": 1.7e9}
    ref = decl_store.DeclarationRef(**fields, num_members=num_members, num_bytes=raw, sha256=b"h" * 32)
    chunk = decl_store.DeclarationChunk(**fields, index=0, data=b"d" * decl_store.CHUNK_BYTES)
    signed = _owner_marker_bytes() + _SIGNATURE_BYTES
    ref_bytes = len(msgpack.packb(ref.model_dump(), use_bin_type=True)) + signed
    chunk_bytes = len(msgpack.packb(chunk.model_dump(), use_bin_type=True)) + signed
    fetch = raw + ref.num_chunks * (chunk_bytes - decl_store.CHUNK_BYTES)
    return StoredDeclaration(ref_bytes, chunk_bytes, fetch, ref.num_chunks)


@dataclass
class RoundKey:
    """What the DHT holds for one round key, and which slots wait on it."""

    epoch: int
    entries: dict[str, ReadyEntry] = field(default_factory=dict)  # peer id -> its newest entry (one DHT subkey each)
    declarations: list[GroupDeclaration] = field(default_factory=list)
    declarations_bytes: int = 0  # under the round key: inline declarations, references to the others
    fetch: StoredDeclaration = StoredDeclaration(0)  # what a newcomer reads to assemble those stored by reference
    waiting: dict[int, ReadyEntry] = field(default_factory=dict)

    def largest_value(self, entry_level: int) -> int:
        """The largest DHT value this round key's records make with entries at shard level ``entry_level``
        (``averaging.entry_shards``): the round key's own (declarations; entries at level 0), or the fullest shard."""
        if entry_level == 0 or not self.entries:
            return len(self.entries) * entry_bytes() + self.declarations_bytes
        fullest = int(shard_loads(list(self.entries), entry_level).max())
        return max(self.declarations_bytes, fullest * entry_bytes())

    def declare(self, decl: GroupDeclaration) -> StoredDeclaration:
        """Store ``decl``; returns how (``stored_declaration``)."""
        self.declarations.append(decl)
        stored = stored_declaration(len(decl.members))
        self.declarations_bytes += stored.under_key
        self.fetch = StoredDeclaration(0, 0, self.fetch.fetch + stored.fetch, self.fetch.chunks + stored.chunks)
        return stored


@dataclass
class DhtStats:
    """DHT operations and bytes read, summed over peers (the report divides by peers and steps), and the largest
    value seen per key (bytes)."""

    ops_total: int = 0
    read_bytes_total: int = 0
    peak_value_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    peak_value_bytes_steady: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    read_bytes_by_key: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    steady_after_s: float = 0.0  # simulated seconds: the sim sets one record TTL

    def ops(self, num_peers: int, count_each: int = 1, read_bytes_each: int = 0, key: str = "") -> None:
        """``num_peers`` peers each do ``count_each`` operations that read ``read_bytes_each`` bytes in all (under
        ``key``: "peers" or "matchmaking", for the per-key split)."""
        self.ops_total += num_peers * count_each
        self.read_bytes_total += num_peers * read_bytes_each
        if key:
            self.read_bytes_by_key[key] += num_peers * read_bytes_each

    def value_size(self, key: str, num_bytes: int, now: float | None = None) -> None:
        """A value of ``num_bytes`` under ``key`` at simulated time ``now``: counted in the peak, and in the steady
        peak from ``steady_after_s`` on (a simulation starts every peer within one heartbeat: a crowd that the
        peers-key level cannot have followed yet)."""
        if num_bytes > self.peak_value_bytes[key]:
            self.peak_value_bytes[key] = num_bytes
        if (now is None or now >= self.steady_after_s) and num_bytes > self.peak_value_bytes_steady[key]:
            self.peak_value_bytes_steady[key] = num_bytes


class RecordBoard:
    """Every peer's latest published ``PeerRecord`` (slot-indexed columns + the real objects).

    Columns are float64/int64 arrays of ``capacity`` slots; ``published`` marks slots with a record. A record is
    "live" for the decision functions while ``now - updated_at <= stale_after_s`` (they check that themselves);
    it is kept (and counted in the key's size) until ``record_ttl_s`` after its last refresh.
    """

    COLUMNS = ("epoch", "phase_epoch", "phase_samples", "throughput", "done_epoch", "done_samples", "updated_at")

    def __init__(self, capacity: int):
        self.capacity = 0
        self.published = np.zeros(0, bool)
        self.cols: dict[str, np.ndarray] = {c: np.zeros(0) for c in self.COLUMNS}
        self.state_hash: list[str] = []
        self.peer_ids: list[str] = []
        self.objects: list[PeerRecord | None] = []
        self._records: list[PeerRecord] | None = None  # the last ``records()``, until a record changes
        self.version = 0  # incremented whenever a record is published or expires (``records()`` changes)
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        extra = capacity - self.capacity
        self.published = np.concatenate([self.published, np.zeros(extra, bool)])
        for c in self.COLUMNS:
            self.cols[c] = np.concatenate([self.cols[c], np.zeros(extra)])
        self.state_hash += [""] * extra
        self.peer_ids += [""] * extra
        self.objects += [None] * extra
        self.capacity = capacity

    def publish(self, slot: int, peer_id: str, state_hash: str, **values: float) -> None:
        """Store the record of ``slot`` (every column in ``values``, ``updated_at`` included)."""
        self.publish_many(np.array([slot]), [peer_id], [state_hash], **{c: np.array([values[c]]) for c in self.COLUMNS})

    def publish_many(
        self, slots: np.ndarray, peer_ids: list[str], state_hashes: list[str], **columns: np.ndarray
    ) -> None:
        """Store the records of ``slots`` at once: ``columns`` holds one array per column, aligned with ``slots``."""
        self.published[slots] = True
        for c in self.COLUMNS:
            self.cols[c][slots] = columns[c]
        for k, slot in enumerate(slots.tolist()):
            self.peer_ids[slot] = peer_ids[k]
            self.state_hash[slot] = state_hashes[k]
            self.objects[slot] = None  # rebuilt on demand
        self._records = None
        self.version += 1

    def expire(self, now: float, record_ttl_s: float) -> None:
        """Drop records not refreshed for ``record_ttl_s`` seconds (the DHT forgets them)."""
        gone = self.published & (now - self.cols["updated_at"] > record_ttl_s)
        if gone.any():
            self.published[gone] = False
            self._records = None
            self.version += 1

    def num_live(self, now: float, stale_after_s: float) -> int:
        """Stored records with ``now - updated_at <= stale_after_s`` (the decision functions' liveness test, in the
        same float64 arithmetic). Within one ``version`` the records are fixed, so a record only ever goes from live
        to stale as ``now`` grows: two times with the same count see the same live records."""
        return int((self.published & (now - self.cols["updated_at"] <= stale_after_s)).sum())

    def num_stored(self) -> int:
        return int(self.published.sum())

    def record(self, slot: int) -> PeerRecord:
        """The real ``PeerRecord`` of ``slot`` (built by ``_build`` once per publication)."""
        if self.objects[slot] is None:
            self._build([slot])
        return self.objects[slot]

    def _build(self, slots: list[int]) -> None:
        """Build the records of ``slots``: the template record's fields with each slot's values (``_record_of``; not
        validated: the values are ours and valid). Columns are read for all of them at once (``tolist``): numpy
        scalar reads, one per field and record, cost more than the record itself."""
        c, index = self.cols, np.array(slots, np.int64)
        ints = {k: c[k][index].astype(np.int64).tolist() for k in ("epoch", "phase_epoch", "phase_samples",
                                                                     "done_epoch", "done_samples")}  # fmt: skip
        throughput, updated_at = c["throughput"][index].tolist(), c["updated_at"][index].tolist()
        for k, slot in enumerate(slots):
            self.objects[slot] = _record_of(
                {
                    "peer_id": self.peer_ids[slot], "epoch": ints["epoch"][k], "throughput": throughput[k],
                    "state_hash": self.state_hash[slot], "phase_epoch": ints["phase_epoch"][k],
                    "phase_samples": ints["phase_samples"][k], "done_epoch": ints["done_epoch"][k],
                    "done_samples": ints["done_samples"][k], "updated_at": updated_at[k],
                }
            )  # fmt: skip

    def records(self) -> list[PeerRecord]:
        """Every stored record, as a DHT get of the peers key returns them. The same list object is returned until a
        record is published or expires (callers must not mutate it): every decision in one tick reads one list."""
        if self._records is None:
            slots = np.flatnonzero(self.published).tolist()
            objects = self.objects
            missing = [s for s in slots if objects[s] is None]
            if missing:
                self._build(missing)
            self._records = [objects[s] for s in slots]
        return self._records


@functools.cache
def _template_record() -> PeerRecord:
    return PeerRecord.model_construct(
        peer_id="template", role="trainer", version="0.1.0", run_id=RUN_ID, model_fingerprint="f", epoch=0,
        throughput=0.0, state_hash="", phase_epoch=0, phase_samples=0, done_epoch=0, done_samples=0, updated_at=0.0,
        left_reason="", paused=False,
    )  # fmt: skip


_object_setattr = object.__setattr__


def _record_of(values: dict) -> PeerRecord:
    """A ``PeerRecord`` with the template's fields updated by ``values``, built the way pydantic's
    ``model_construct`` builds one (``__dict__`` and the fields-set, no validation) without its per-field default
    lookup: 3.6 us against ``model_copy(update=...)``'s 8 us. ``tests/sim/test_models.py`` checks it equals a
    validated record."""
    template = _template_record()
    fields = template.__dict__.copy()
    fields.update(values)
    rec = PeerRecord.__new__(PeerRecord)
    _object_setattr(rec, "__dict__", fields)
    _object_setattr(rec, "__pydantic_fields_set__", template.__pydantic_fields_set__)
    _object_setattr(rec, "__pydantic_extra__", None)
    _object_setattr(rec, "__pydantic_private__", None)
    return rec
