"""Large group declarations in the DHT by reference: a small signed pointer under the round key, the declaration in
chunks under keys of their own (issue 23 item 3: no DHT value grows with the swarm).

A ``GroupDeclaration`` embeds every member's signed entry (~0.9 KB each, ``sim.dht.declaration_bytes``): the one
declaration of a 1,000-peer epoch (the two-stage round lists every member) is ~0.9 MB. Stored inline under the round
key (``{prefix}.{round_key}.mm``), it made that value, which every waiting peer reads at every poll, grow with the
swarm, and past ~1,160 members it exceeded the size every honest DHT node accepts for a declaration
(``peers.validators.RecordBounds``), so it was not stored at all. Now a declaration larger than ``INLINE_BYTES`` is
stored as:

- a ``DeclarationRef`` under the round key (subkey: the leader's owner marker + ``b"|group"``, as an inline one):
  round id, member count, byte count and sha256 of the declaration's msgpack bytes (855 B stored, with the owner
  marker and hivemind's signature);
- ``DeclarationChunk`` records of at most ``CHUNK_BYTES`` of those bytes, chunk i under ``{round key's key}.d.{round
  id}.{i}`` (subkey: the leader's owner marker + ``b"|chunk"``), so no DHT value exceeds ~200 KiB.

Both are signed by the DHT's owner-marker check (only the leader can store them) and bounded by
``peers.validators``; a reader fetches the chunks of a reference once (``DeclarationFetcher``), checks the byte count
and hash, and then verifies the declaration as any other (the leader's signature and every member's entry): a forged,
missing or inconsistent chunk yields no declaration, never a wrong one. Smaller declarations (up to ~200 members) stay
inline, as before.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hivetrain.averaging.group_records import MAX_MEMBERS, GroupDeclaration
from hivetrain.averaging.wire import MAX_DECLARE_META_BYTES
from hivetrain.peers.records import parse_signed

logger = logging.getLogger(__name__)

CHUNK_BYTES = 192 * 1024  # one chunk's data: a DHT value of ~200 KiB with its record overhead
INLINE_BYTES = CHUNK_BYTES  # a declaration up to this size (~200 members) is stored whole under the round key
MAX_DECLARATION_BYTES = MAX_DECLARE_META_BYTES  # 8 MiB: MAX_MEMBERS entries of ~0.9 KB with room to spare
MAX_CHUNKS = math.ceil(MAX_DECLARATION_BYTES / CHUNK_BYTES)
FETCH_ATTEMPTS = 3  # reads of one reference's chunks at most (a chunk stored after its reference shows up later)
FETCH_TIMEOUT_S = 10.0  # one fetch gives up on chunks not read by then, seconds
RETRY_S = 0.5  # a fetch asks again for the chunks it did not find this often, seconds
MAX_TRACKED = 256  # round ids whose fetch attempts are remembered


class _LeadersRecord(BaseModel):
    """What a reference and each chunk say of the declaration they carry (and must agree on)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    leader: str = Field(min_length=1, max_length=128)
    round_key: str = Field(min_length=1, max_length=128)
    round_id: str = Field(min_length=1, max_length=64, pattern=r"^[0-9a-f]+$")
    declared_at: float = Field(ge=0.0)


class DeclarationRef(_LeadersRecord):
    """Where a leader's declaration of round ``round_id`` is: ``num_bytes`` msgpack bytes with this ``sha256``, in
    ceil(num_bytes / ``CHUNK_BYTES``) chunks. Units: bytes, seconds of DHT time."""

    num_members: int = Field(ge=1, le=MAX_MEMBERS)
    num_bytes: int = Field(ge=1, le=MAX_DECLARATION_BYTES)
    sha256: bytes = Field(min_length=32, max_length=32)

    @property
    def num_chunks(self) -> int:
        return math.ceil(self.num_bytes / CHUNK_BYTES)


class DeclarationChunk(_LeadersRecord):
    """Bytes ``index * CHUNK_BYTES`` .. of the declaration of round ``round_id`` (its leader's record)."""

    index: int = Field(ge=0, lt=MAX_CHUNKS)
    data: bytes = Field(min_length=1, max_length=CHUNK_BYTES)


_SAME = tuple(_LeadersRecord.model_fields)  # what a chunk, its reference and the declaration agree on


def group_record_model(value: object) -> type[GroupDeclaration] | type[DeclarationRef]:
    """Which model a record under a round key's ``|group`` subkey is: a ``DeclarationRef`` (it names a hash) or an
    inline ``GroupDeclaration`` (the matchmaker's reads and the record guard ask alike)."""
    return DeclarationRef if isinstance(value, dict) and "sha256" in value else GroupDeclaration


def chunk_key(round_key_key: str, round_id: str, index: int) -> str:
    """The DHT key of chunk ``index`` of round ``round_id``, next to the round key's own ``round_key_key``."""
    return f"{round_key_key}.d.{round_id}.{index}"


def declaration_bytes(decl: GroupDeclaration) -> bytes:
    """The msgpack bytes a reference points at: the declaration as stored inline (``model_dump``)."""
    return msgpack.packb(decl.model_dump(), use_bin_type=True)


def split_declaration(decl: GroupDeclaration) -> tuple[DeclarationRef, list[DeclarationChunk]]:
    """The reference and chunks of ``decl``. Raises ValueError if it is larger than ``MAX_DECLARATION_BYTES``."""
    raw = declaration_bytes(decl)
    if len(raw) > MAX_DECLARATION_BYTES:
        raise ValueError(f"a declaration of {len(raw)} bytes exceeds {MAX_DECLARATION_BYTES}")
    common = {f: getattr(decl, f) for f in _SAME}
    ref = DeclarationRef(**common, num_members=len(decl.members), num_bytes=len(raw), sha256=_digest(raw))
    chunks = [
        DeclarationChunk(**common, index=i, data=raw[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES])
        for i in range(ref.num_chunks)
    ]
    return ref, chunks


def assemble(ref: DeclarationRef, chunks: Sequence[DeclarationChunk | None]) -> GroupDeclaration | None:
    """The declaration ``ref`` points at, from its ``chunks`` (in order; None = not found), or None when one is
    missing or does not match ``ref`` (other round, leader or index; wrong total size or hash). Never raises. The
    result's signatures are not checked here (``group_records.verify_declaration``)."""
    if len(chunks) != ref.num_chunks:
        return None
    for i, chunk in enumerate(chunks):
        if chunk is None or chunk.index != i or any(getattr(chunk, f) != getattr(ref, f) for f in _SAME):
            return None
    raw = b"".join(c.data for c in chunks if c is not None)
    if len(raw) != ref.num_bytes or _digest(raw) != ref.sha256:
        return None
    try:
        decl = GroupDeclaration.model_validate(msgpack.unpackb(raw, raw=False))
    except (ValidationError, ValueError, TypeError, msgpack.UnpackException):
        return None
    if any(getattr(decl, f) != getattr(ref, f) for f in _SAME) or len(decl.members) != ref.num_members:
        return None
    return decl


class DeclarationFetcher:
    """Reads the chunks behind references (``want``), each reference's at most ``FETCH_ATTEMPTS`` times and one
    read at a time per round id, on a thread per read, and hands each declaration they assemble to ``on_found`` (not
    yet verified: the caller checks its signatures). ``dht``: a ``hivemind.DHT`` (``get(key, latest=True,
    return_future=True)``); ``timeout_s``: one read's limit, seconds. Thread-safe; a failed read (a DHT error, a
    missing or forged chunk) only costs an attempt."""

    def __init__(self, dht, on_found: Callable[[GroupDeclaration], None], timeout_s: float = FETCH_TIMEOUT_S):
        self._dht, self._on_found, self.timeout_s = dht, on_found, timeout_s
        self._lock = threading.Lock()
        self._attempts: dict[str, int] = {}  # round id -> reads started (FETCH_ATTEMPTS once one succeeded)
        self._pending: dict[str, tuple[str, Future]] = {}  # round id -> (round key, the read's future)

    def want(self, key: str, ref: DeclarationRef) -> Future | None:
        """Start reading the chunks of ``ref`` (stored next to DHT key ``key``) unless a read of them is running (its
        future is returned) or its attempts are spent (None). The future's result: the declaration, or None."""
        with self._lock:
            running = self._pending.get(ref.round_id)
            if running is not None:
                return running[1]
            if self._attempts.get(ref.round_id, 0) >= FETCH_ATTEMPTS:
                return None
            self._attempts[ref.round_id] = self._attempts.get(ref.round_id, 0) + 1
            while len(self._attempts) > MAX_TRACKED:
                del self._attempts[next(iter(self._attempts))]
            future: Future = Future()
            self._pending[ref.round_id] = (ref.round_key, future)
        threading.Thread(target=self._fetch, args=(key, ref, future), name="hivetrain-decl-fetch", daemon=True).start()
        return future

    def pending(self, round_key: str) -> list[Future]:
        """The reads still running for declarations of ``round_key``."""
        with self._lock:
            return [f for rk, f in self._pending.values() if rk == round_key]

    def _fetch(self, key: str, ref: DeclarationRef, future: Future) -> None:
        decl = None
        try:  # chunks not found yet are asked again (their stores may land after the reference's), until timeout_s
            deadline = time.monotonic() + self.timeout_s
            chunks: list[DeclarationChunk | None] = [None] * ref.num_chunks
            while True:
                gets = {i: self._dht.get(chunk_key(key, ref.round_id, i), latest=True, return_future=True)
                        for i, c in enumerate(chunks) if c is None}  # fmt: skip
                for i, got in gets.items():
                    chunks[i] = _chunk_of(got.result(timeout=max(0.0, deadline - time.monotonic())), ref)
                if all(c is not None for c in chunks) or time.monotonic() + RETRY_S > deadline:
                    break
                time.sleep(RETRY_S)
            decl = assemble(ref, chunks)
        except Exception as exc:  # noqa: BLE001 - a failed read is retried at the next sight of the reference
            logger.debug("reading the declaration of round %s failed: %s", ref.round_id, exc)
        with self._lock:
            del self._pending[ref.round_id]
            if decl is not None:
                self._attempts[ref.round_id] = FETCH_ATTEMPTS
        try:
            if decl is not None:
                self._on_found(decl)
        finally:  # whoever waits on the read wakes, even if the caller's check raised
            future.set_result(decl)


def _chunk_of(found, ref: DeclarationRef) -> DeclarationChunk | None:
    """The chunk of ``ref``'s leader in one DHT read's answer (signed by it: ``parse_signed``), or None."""
    items = found.value if found is not None and isinstance(found.value, dict) else {}
    for subkey, item in items.items():
        if isinstance(subkey, bytes) and subkey.endswith(b"|chunk"):
            chunk = parse_signed(subkey, getattr(item, "value", None), DeclarationChunk, "leader")
            if chunk is not None and chunk.leader == ref.leader and chunk.round_id == ref.round_id:
                return chunk
    return None


def _digest(raw: bytes) -> bytes:
    return hashlib.sha256(raw).digest()
