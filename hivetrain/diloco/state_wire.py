"""Wire format of state downloads: framing, the chunk layout of a TrainingState, and manifests checked against bounds.

A state travels as one flat byte string: every tensor of ``TrainingState.to_flat_dict()`` (θ then outer momentum) as
raw little-endian fp32, in that order, cut into chunks of ``chunk_bytes`` (the last one shorter). A *manifest* names
the state (epoch, ``state_hash``) and the sha256 of every chunk. Control messages are a 4-byte big-endian length and
a msgpack map of at most ``MAX_CONTROL_BYTES``; chunk payloads are raw bytes. Nothing is unpickled.

Everything a donor claims is checked against what we know before it is used: the size of the state is our own
model's (``layout_num_bytes(reference)``), never the donor's number; chunk sizes are bounded and fp32-aligned; the
chunk count follows from both; hashes are 64 hex digits. A chunk payload is read as it arrives (see
``state_fetch``), so nothing is allocated for a claimed size before its bytes are here.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import math
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import torch

from hivetrain.diloco.state import TrainingState

MAX_CONTROL_BYTES = 2**20
DEFAULT_CHUNK_BYTES = 4 * 2**20
MIN_CHUNK_BYTES = 4 * 2**10
MAX_CHUNK_BYTES = 64 * 2**20
MAX_RECENT = 16
"""At most this many (epoch, state hash) pairs of retained snapshots are listed in, or read from, a meta reply."""

_HEX = frozenset("0123456789abcdef")


class ProtocolError(ValueError):
    """A peer sent a message that breaks the state protocol or its bounds."""


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


async def send_control(writer: asyncio.StreamWriter, message: dict) -> None:
    """Send one control message (4-byte big-endian length + msgpack map)."""
    payload = msgpack.packb(message, use_bin_type=True)
    if len(payload) > MAX_CONTROL_BYTES:
        raise ProtocolError(f"control message of {len(payload)} bytes exceeds {MAX_CONTROL_BYTES}")
    writer.write(struct.pack(">I", len(payload)) + payload)
    await writer.drain()


async def recv_control(reader: asyncio.StreamReader, timeout_s: float) -> dict:
    """Receive one control message; the whole message (length and body) must arrive within ``timeout_s`` seconds.

    Raises:
        ProtocolError: the claimed length exceeds ``MAX_CONTROL_BYTES`` (refused before reading the body) or the body
            is not a msgpack map.
        asyncio.TimeoutError: it did not arrive in time (a peer dripping bytes gets no more time than a silent one).
        asyncio.IncompleteReadError, ConnectionError: the stream closed.
    """

    async def read() -> dict:
        (size,) = struct.unpack(">I", await reader.readexactly(4))
        if size > MAX_CONTROL_BYTES:
            raise ProtocolError(f"control message of {size} bytes exceeds {MAX_CONTROL_BYTES}")
        try:
            message = msgpack.unpackb(await reader.readexactly(size), raw=False, strict_map_key=True)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise ProtocolError(f"control message is not valid msgpack: {exc!r}") from exc
        if not isinstance(message, dict):
            raise ProtocolError("control message is not a map")
        return message

    return await asyncio.wait_for(read(), timeout_s)


# ---- layout -------------------------------------------------------------------------------------------------------


def state_segments(state: TrainingState) -> list[memoryview]:
    """The raw bytes of every tensor of ``state``, ``to_flat_dict`` order, as views (no copy for contiguous tensors).

    The views share memory with the state: they are only a stable snapshot if the state is never modified in place.
    """
    assert sys.byteorder == "little", "the state wire format is little-endian fp32"
    return [memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()) for t in state.to_flat_dict().values()]


def layout_num_bytes(reference: TrainingState) -> int:
    """Size of the flat state of ``reference``'s model in bytes (θ plus momentum, fp32)."""
    return sum(t.numel() * 4 for t in reference.to_flat_dict().values())


def read_range(segments: Sequence[memoryview], start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of the concatenation of ``segments`` (one copy of ``end - start`` bytes)."""
    parts, offset = [], 0
    for segment in segments:
        seg_end = offset + len(segment)
        if seg_end > start and offset < end:
            parts.append(segment[max(start - offset, 0) : min(end, seg_end) - offset])
        offset = seg_end
        if offset >= end:
            break
    return b"".join(parts)


def flatten(state: TrainingState) -> bytes:
    """The state's tensors as one little-endian fp32 byte string, ``to_flat_dict`` order."""
    segments = state_segments(state)
    return read_range(segments, 0, sum(len(s) for s in segments))


def unflatten(buffer: bytes | bytearray, epoch: int, reference: TrainingState) -> TrainingState:
    """Inverse of ``flatten`` using ``reference`` for names and shapes.

    A ``bytearray`` is used in place (the tensors are views of it, no copy); ``bytes`` are copied once.

    Raises:
        ValueError: the size differs from ``reference``'s, or a tensor is not finite.
    """
    flat_ref = reference.to_flat_dict()
    expected = layout_num_bytes(reference)
    if len(buffer) != expected:
        raise ValueError(f"state buffer has {len(buffer)} bytes, expected {expected}")
    if not isinstance(buffer, bytearray):
        buffer = bytearray(buffer)
    values = torch.frombuffer(buffer, dtype=torch.float32) if expected else torch.empty(0)
    flat, offset = {}, 0
    for name, ref in flat_ref.items():
        flat[name] = values[offset : offset + ref.numel()].view(ref.shape)
        offset += ref.numel()
    return TrainingState.from_flat_dict(flat, epoch=epoch, reference=reference)


# ---- manifests ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """What a donor says it serves: the state's epoch and hash, and one sha256 per chunk of the flat state.

    Attributes:
        epoch: committed outer steps of the state.
        state_hash: ``TrainingState.state_hash()`` (hex), the value peers publish.
        num_bytes: size of the flat state, bytes.
        chunk_bytes: chunk size, bytes (a multiple of 4; the last chunk may be shorter).
        chunk_hashes: sha256 (hex) of each chunk, ``ceil(num_bytes / chunk_bytes)`` of them.
    """

    epoch: int
    state_hash: str
    num_bytes: int
    chunk_bytes: int
    chunk_hashes: tuple[str, ...]

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_hashes)

    def chunk_range(self, index: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of chunk ``index`` in the flat state."""
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.num_bytes)

    def to_message(self) -> dict:
        return {
            "epoch": self.epoch,
            "state_hash": self.state_hash,
            "num_bytes": self.num_bytes,
            "chunk_bytes": self.chunk_bytes,
            "chunk_hashes": list(self.chunk_hashes),
        }


def build_manifest(
    epoch: int, state_hash: str, read: Callable[[int, int], bytes], num_bytes: int, chunk_bytes: int
) -> Manifest:
    """Hash the flat state of ``num_bytes`` bytes chunk by chunk, reading bytes ``[start, end)`` with
    ``read(start, end)`` (one pass, one chunk in memory at a time)."""
    hashes = tuple(
        hashlib.sha256(read(start, min(start + chunk_bytes, num_bytes))).hexdigest()
        for start in range(0, num_bytes, chunk_bytes)
    )
    return Manifest(epoch, state_hash, num_bytes, chunk_bytes, hashes)


def parse_manifest(message: dict, num_bytes: int) -> Manifest:
    """A manifest from a donor's meta reply, checked against our model's flat size ``num_bytes``.

    Raises:
        ProtocolError: a field is missing, of the wrong type or out of bounds: the size is not ours, the chunk size is
            outside ``[MIN_CHUNK_BYTES, MAX_CHUNK_BYTES]`` or not a multiple of 4, the chunk count does not follow from
            both, or a hash is not 64 hex digits.
    """
    epoch, state_hash = message.get("epoch"), message.get("state_hash")
    claimed, chunk_bytes, hashes = message.get("num_bytes"), message.get("chunk_bytes"), message.get("chunk_hashes")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise ProtocolError(f"bad epoch {epoch!r}")
    if not _is_digest(state_hash):
        raise ProtocolError("state_hash is not a sha256 hex digest")
    if claimed != num_bytes or isinstance(claimed, bool):
        raise ProtocolError(f"state of {claimed!r} bytes offered, our model's is {num_bytes}")
    if not isinstance(chunk_bytes, int) or not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES or chunk_bytes % 4:
        raise ProtocolError(f"chunk size {chunk_bytes!r} outside [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}] or unaligned")
    num_chunks = math.ceil(num_bytes / chunk_bytes)
    if not isinstance(hashes, list) or len(hashes) != num_chunks:
        count = len(hashes) if isinstance(hashes, list) else hashes
        raise ProtocolError(f"manifest lists {count!r} chunk hashes, {num_chunks} expected")
    if not all(_is_digest(h) for h in hashes):
        raise ProtocolError("a chunk hash is not a sha256 hex digest")
    return Manifest(epoch, state_hash, num_bytes, chunk_bytes, tuple(hashes))


def parse_recent(message: dict) -> list[tuple[int, str]]:
    """The (epoch, state hash) pairs a meta reply lists under ``"recent"``; malformed entries are skipped, and at
    most ``MAX_RECENT`` are read."""
    recent = message.get("recent")
    if not isinstance(recent, list):
        return []
    pairs = []
    for entry in recent[:MAX_RECENT]:
        if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int) and _is_digest(entry[1]):
            pairs.append((entry[0], entry[1]))
    return pairs


@functools.lru_cache(maxsize=8)
def zeros_sha256(num_bytes: int) -> str:
    """sha256 (hex) of ``num_bytes`` zero bytes: the manifest hash of an all-zero chunk of that size, which a
    downloader writes itself instead of fetching (outer momentum at μ = 0 is all zeros)."""
    return hashlib.sha256(bytes(num_bytes)).hexdigest()


def chunk_is_finite(data: bytes | bytearray) -> bool:
    """True if ``data`` (fp32-aligned) holds no NaN or Inf. A valid state never does (``from_flat_dict`` refuses it),
    so a non-finite chunk that matches its manifest proves that manifest false."""
    return bool(np.isfinite(np.frombuffer(data, dtype="<f4")).all())
