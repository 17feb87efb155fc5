"""State download: a late or lagging peer fetches θ, outer momentum and epoch from peers at the newest epoch.

Protocol (a libp2p stream handler ``"{run_id}.state"`` on hivemind's P2P, so it works through NAT relays):

* ``{"op": "meta"}`` -> ``{"epoch", "state_hash", "num_bytes", "chunk_bytes", "chunk_hashes"}``: the donor's current
  state, its sha256 and one sha256 per chunk of the flat fp32 buffer (params then momentum, ``to_flat_dict`` order).
* ``{"op": "chunk", "epoch": e, "index": i}`` -> ``{"ok": true, "num_bytes": n}`` then n raw bytes.

Control messages are 4-byte big-endian length + msgpack (at most 1 MiB); nothing is unpickled. A joiner asks every
candidate donor for its meta, keeps the donors whose (epoch, state hash, chunk hashes) agree with the hash that peers
published for that epoch, and downloads chunks from all of them in parallel (no single donor is the bottleneck),
checking each chunk's sha256; a donor that serves a bad chunk or times out is dropped and its chunks go to the others.
The assembled state must have the expected state hash or the download fails.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import numpy as np
import torch
from hivemind.p2p import P2P, PeerID

from hivetrain.diloco.state import TrainingState
from hivetrain.faults import NO_FAULTS, FaultInjector

logger = logging.getLogger(__name__)

MAX_CONTROL_BYTES = 2**20
DEFAULT_CHUNK_BYTES = 4 * 2**20


class StateDownloadFailed(RuntimeError):
    """No donor could provide a state with the expected hash."""


@dataclass
class _Snapshot:
    epoch: int
    state_hash: str
    buffer: bytes
    chunk_hashes: list[str]


def flatten(state: TrainingState) -> bytes:
    """The state's tensors as one little-endian fp32 byte string, ``to_flat_dict`` order."""
    parts = [t.contiguous().view(-1).numpy() for t in state.to_flat_dict().values()]
    return np.concatenate(parts).astype("<f4", copy=False).tobytes()


def unflatten(buffer: bytes, epoch: int, reference: TrainingState) -> TrainingState:
    """Inverse of ``flatten`` using ``reference`` for names and shapes. Raises ValueError on a size mismatch."""
    flat_ref = reference.to_flat_dict()
    expected = sum(t.numel() for t in flat_ref.values()) * 4
    if len(buffer) != expected:
        raise ValueError(f"state buffer has {len(buffer)} bytes, expected {expected}")
    values = torch.from_numpy(np.frombuffer(buffer, dtype="<f4").copy())
    flat, offset = {}, 0
    for name, ref in flat_ref.items():
        flat[name] = values[offset : offset + ref.numel()].view(ref.shape)
        offset += ref.numel()
    return TrainingState.from_flat_dict(flat, epoch=epoch, reference=reference)


async def _send(writer: asyncio.StreamWriter, message: dict) -> None:
    payload = msgpack.packb(message, use_bin_type=True)
    writer.write(struct.pack(">I", len(payload)) + payload)
    await writer.drain()


async def _recv(reader: asyncio.StreamReader) -> dict:
    (size,) = struct.unpack(">I", await reader.readexactly(4))
    if size > MAX_CONTROL_BYTES:
        raise ValueError(f"control message of {size} bytes exceeds {MAX_CONTROL_BYTES}")
    message = msgpack.unpackb(await reader.readexactly(size), raw=False, strict_map_key=True)
    if not isinstance(message, dict):
        raise ValueError("control message is not a map")
    return message


class StateServer:
    """Serves this peer's current TrainingState to joiners.

    Args:
        get_state: returns the current committed state (or None while the peer has none to share).
        chunk_bytes: chunk size of downloads, bytes.
    """

    def __init__(
        self,
        get_state: Callable[[], TrainingState | None],
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        faults: FaultInjector = NO_FAULTS,
    ):
        self.get_state = get_state
        self.chunk_bytes = chunk_bytes
        self.faults = faults
        # The current epoch's snapshot and the previous one: a download that started just before the donor's next
        # outer step can finish from the previous snapshot instead of failing with "epoch changed".
        self._recent: OrderedDict[int, _Snapshot] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes_served = 0

    def _current(self) -> _Snapshot | None:
        state = self.get_state()
        if state is None:
            return None
        with self._lock:
            if state.epoch not in self._recent:
                buffer = flatten(state)
                hashes = [
                    hashlib.sha256(buffer[i : i + self.chunk_bytes]).hexdigest()
                    for i in range(0, len(buffer), self.chunk_bytes)
                ]
                self._recent[state.epoch] = _Snapshot(state.epoch, state.state_hash(), buffer, hashes)
                while len(self._recent) > 2:
                    self._recent.popitem(last=False)
            return self._recent[state.epoch]

    def _snapshot_of(self, epoch: object) -> _Snapshot | None:
        with self._lock:
            return self._recent.get(epoch) if isinstance(epoch, int) else None

    async def register(self, p2p: P2P, run_id: str) -> None:
        await p2p.add_binary_stream_handler(f"{run_id}.state", self._handle)

    async def _handle(self, _info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    request = await asyncio.wait_for(_recv(reader), timeout=30.0)
                except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
                    return
                op = request.get("op")
                if op == "chunk":
                    snapshot = self._snapshot_of(request.get("epoch"))
                    if snapshot is None:
                        await _send(writer, {"error": "that epoch is no longer served"})
                        return
                else:
                    snapshot = await asyncio.get_running_loop().run_in_executor(None, self._current)
                if snapshot is None:
                    await _send(writer, {"error": "no state to share yet"})
                    return
                if op == "meta":
                    self.faults.check("state.before_serve", epoch=snapshot.epoch)
                    await _send(
                        writer,
                        {
                            "epoch": snapshot.epoch,
                            "state_hash": snapshot.state_hash,
                            "num_bytes": len(snapshot.buffer),
                            "chunk_bytes": self.chunk_bytes,
                            "chunk_hashes": snapshot.chunk_hashes,
                        },
                    )
                elif op == "chunk":
                    index = request.get("index")
                    if not isinstance(index, int) or not 0 <= index < len(snapshot.chunk_hashes):
                        await _send(writer, {"error": "bad chunk index"})
                        return
                    data = snapshot.buffer[index * self.chunk_bytes : (index + 1) * self.chunk_bytes]
                    await _send(writer, {"ok": True, "num_bytes": len(data)})
                    writer.write(data)
                    await writer.drain()
                    self.bytes_served += len(data)
                else:
                    await _send(writer, {"error": f"unknown op {op!r}"})
                    return
        except Exception as exc:  # noqa: BLE001 - one bad client must not take the server down
            logger.debug("state request failed: %r", exc)
        finally:
            writer.close()


async def _fetch_meta(p2p: P2P, run_id: str, donor: str, timeout_s: float) -> dict | None:
    try:
        _, reader, writer = await asyncio.wait_for(
            p2p.call_binary_stream_handler(PeerID.from_base58(donor), f"{run_id}.state"), timeout_s
        )
        try:
            await _send(writer, {"op": "meta"})
            meta = await asyncio.wait_for(_recv(reader), timeout_s)
        finally:
            writer.close()
        if "error" in meta:
            logger.info("donor %s: %s", donor[:12], meta["error"])
            return None
        return meta
    except Exception as exc:  # noqa: BLE001 - any failure just disqualifies this donor
        logger.info("donor %s unreachable for state: %r", donor[:12], exc)
        return None


async def _download(
    p2p: P2P, run_id: str, donors: list[str], meta: dict, timeout_s: float, faults: FaultInjector
) -> bytes:
    chunk_hashes: list[str] = meta["chunk_hashes"]
    chunks: list[bytes | None] = [None] * len(chunk_hashes)
    pending: asyncio.Queue[int] = asyncio.Queue()
    for index in range(len(chunk_hashes)):
        pending.put_nowait(index)
    alive = set(donors)

    async def worker(donor: str) -> None:
        try:
            _, reader, writer = await asyncio.wait_for(
                p2p.call_binary_stream_handler(PeerID.from_base58(donor), f"{run_id}.state"), timeout_s
            )
        except Exception:  # noqa: BLE001
            alive.discard(donor)
            return
        try:
            while not pending.empty():
                index = pending.get_nowait()
                try:
                    await _send(writer, {"op": "chunk", "epoch": meta["epoch"], "index": index})
                    header = await asyncio.wait_for(_recv(reader), timeout_s)
                    size = header.get("num_bytes")
                    if not header.get("ok") or not isinstance(size, int) or size > meta["chunk_bytes"]:
                        raise ValueError(header.get("error", "bad chunk header"))
                    data = await asyncio.wait_for(reader.readexactly(size), timeout_s)
                    if hashlib.sha256(data).hexdigest() != chunk_hashes[index]:
                        raise ValueError(f"chunk {index} does not match its hash")
                except Exception as exc:  # noqa: BLE001 - give the chunk to another donor
                    logger.warning("state download from %s failed at chunk %d: %r", donor[:12], index, exc)
                    pending.put_nowait(index)
                    alive.discard(donor)
                    return
                chunks[index] = data
                faults.check("state.mid_download", epoch=meta["epoch"], index=index)
        finally:
            writer.close()

    while not pending.empty():
        if not alive:
            raise StateDownloadFailed("every donor failed during the download")
        await asyncio.gather(*(worker(d) for d in list(alive)))
    return b"".join(chunks)  # type: ignore[arg-type]


async def download_state(
    p2p: P2P,
    run_id: str,
    donors: list[str],
    expected: dict[int, str] | Callable[[], dict[int, str]],
    reference: TrainingState,
    timeout_s: float,
    faults: FaultInjector = NO_FAULTS,
) -> TrainingState:
    """Download the newest state whose hash peers published, from every agreeing donor in parallel.

    Args:
        donors: base58 peer IDs to ask (e.g. peers at the newest epoch).
        expected: epoch -> state hash that peers published for it (the majority hash per epoch), or a function that
            reads it afresh: donors that committed another outer step since the caller read the records offer a newer
            epoch than ``expected`` knows, and one fresh read lets the download take that newer state.
        reference: a state with the model's names and shapes (e.g. the local one).
        timeout_s: per network call (one meta request or one chunk), seconds.

    Raises:
        StateDownloadFailed: no donor offered a state matching ``expected``, every donor failed mid-download, or the
            assembled state's hash differs. The local state is untouched in every case.
    """
    metas = await asyncio.gather(*(_fetch_meta(p2p, run_id, d, timeout_s) for d in donors))
    read_expected = expected if callable(expected) else (lambda: expected)
    known = read_expected()

    def offers_for(known: dict[int, str]) -> list[tuple[str, dict]]:
        return [
            (d, m)
            for d, m in zip(donors, metas, strict=True)
            if m is not None and known.get(m.get("epoch")) == m.get("state_hash")
        ]

    offers = offers_for(known)
    newest_offered = max((m["epoch"] for m in metas if m is not None and isinstance(m.get("epoch"), int)), default=-1)
    if callable(expected) and newest_offered > max((m["epoch"] for _, m in offers), default=-1):
        known = await asyncio.get_running_loop().run_in_executor(None, read_expected)
        offers = offers_for(known)
    if not offers:
        raise StateDownloadFailed(f"none of {len(donors)} donor(s) offered a state whose hash peers published")
    best_epoch = max(m["epoch"] for _, m in offers)
    offers = [(d, m) for d, m in offers if m["epoch"] == best_epoch]
    meta = offers[0][1]
    agreeing = [d for d, m in offers if m["chunk_hashes"] == meta["chunk_hashes"]]
    logger.info(
        "downloading epoch %d state (%.1f MB) from %d donor(s)", best_epoch, meta["num_bytes"] / 1e6, len(agreeing)
    )
    buffer = await _download(p2p, run_id, agreeing, meta, timeout_s, faults)
    state = unflatten(buffer, best_epoch, reference)
    if state.state_hash() != meta["state_hash"]:
        raise StateDownloadFailed(
            f"downloaded state hash {state.state_hash()[:12]} != published {meta['state_hash'][:12]}"
        )
    return state
