"""State serving: a peer at the newest epoch serves θ, outer momentum and epoch to late or lagging peers.

Protocol (a libp2p stream handler ``"{run_id}.state"`` on hivemind's P2P, so it works through NAT relays; framing and
bounds in ``state_wire``), several requests per stream:

* ``{"op": "meta"}`` -> the manifest of the current state (``{"epoch", "state_hash", "num_bytes", "chunk_bytes",
  "chunk_hashes"}``) plus ``"recent": [[epoch, state_hash], ...]``, every snapshot this donor serves (the current
  one included).
* ``{"op": "meta", "epoch": e, "state_hash": h}`` -> the manifest of that retained snapshot.
* ``{"op": "chunk", "epoch": e, "state_hash": h, "index": i}`` -> ``{"ok": true, "num_bytes": n}`` then n raw bytes
  (``state_hash`` may be left out: then the newest snapshot of epoch e).

An error is ``{"error": reason}`` and the stream is closed. The joiner's side (routing around bad donors) is
``state_fetch.download_state``, re-exported here.

Snapshots are references, not copies: the trainer never modifies a committed state in place (``outer_step`` builds
new tensors, a download builds new tensors), so the donor keeps the state objects of its last ``keep_epochs`` epochs
and reads chunks straight from their tensors. As a guard against an owner that does modify its state in place, every
chunk is hashed again before it is sent and a snapshot whose bytes changed is dropped instead of served.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from hivemind.p2p import P2P

from hivetrain.diloco.state import SERVED_EPOCHS, TrainingState
from hivetrain.diloco.state_fetch import FetchConfig, FetchResult, StateDownloadFailed, download_state, fetch_state
from hivetrain.diloco.state_file import StateFile
from hivetrain.diloco.state_wire import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    MAX_CONTROL_BYTES,
    MAX_RECENT,
    MIN_CHUNK_BYTES,
    Manifest,
    ProtocolError,
    build_manifest,
    flatten,
    read_range,
    recv_control,
    send_control,
    state_segments,
    unflatten,
)
from hivetrain.faults import NO_FAULTS, FaultInjector, HookPoint

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_CONTROL_BYTES",
    "FetchConfig",
    "FetchResult",
    "StateDownloadFailed",
    "StateServer",
    "download_state",
    "fetch_state",
    "flatten",
    "unflatten",
]

logger = logging.getLogger(__name__)


@dataclass
class _Snapshot:
    state: TrainingState | StateFile
    read: Callable[[int, int], bytes] | None = None  # bytes [start, end) of the flat state
    manifest: Manifest | None = None


def _reader(state: TrainingState | StateFile) -> Callable[[int, int], bytes]:
    """Reads bytes ``[start, end)`` of ``state``'s flat layout: views of the tensors in memory, ``pread`` on disk."""
    if isinstance(state, StateFile):
        return state.read_range
    segments = state_segments(state)
    return lambda start, end: read_range(segments, start, end)


class StateServer:
    """Serves this peer's current TrainingState, and those of its last few epochs, to joiners.

    Memory: the current snapshot is the state its owner holds anyway; each older one keeps alive a state the owner
    has moved past, so at most ``(keep_epochs - 1) * state.num_bytes()`` bytes (θ plus momentum, fp32: 8 bytes per
    parameter; 2 GB for a 124M-parameter model with the default 3) plus 64 bytes of hashes per chunk, and one chunk
    copy per request in flight. The previous design kept 2 full copies, the same bytes for one epoch less.

    A state on disk (``state_file.StateFile``, the coordinator's follower of a big model) is served the same way, each
    chunk read from the file when it is requested; its manifest costs one pass over the file.

    Args:
        get_state: returns the current committed state (or None while the peer has none to share), in memory or on
            disk. Called on every meta request and by ``observe``; must be cheap (return a reference).
        chunk_bytes: chunk size of downloads, bytes, in ``[MIN_CHUNK_BYTES, MAX_CHUNK_BYTES]``, a multiple of 4.
        faults: hook ``state.before_serve`` fires before each meta reply with ``epoch`` and ``meta`` (the reply
            map, which a ``call`` fault may rewrite, as a hostile donor would).
        keep_epochs: snapshots served, the current one included (>= 1). A joiner that read a manifest up to
            ``keep_epochs - 1`` of this donor's outer steps ago can still download it.
        idle_timeout_s: a stream with no complete request for this long is closed, seconds.
        max_downloaders: serve chunks to at most this many peers at once (0 = no cap). A chunk request from one more
            gets ``{"error": "busy: ..."}`` and its stream is closed: the joiner drops this donor for that download
            (``state_fetch``: a donor error, not a ban) and takes the chunks from the others, so a flash crowd spreads
            over every holder instead of queueing at the fastest. Manifests are always served (cheap).
        known_hash: returns the owner's ``state_hash()`` of a state it already hashed, or None: a snapshot's manifest
            then hashes its chunks only, not the whole state a second time (one sha256 pass per served epoch saved,
            ~4 ms per million parameters on one core). None = hash every snapshot here.

    Attributes:
        admits: set for an invite-only run (``peers.membership.MemberRoster.admits``): a stream from a peer that is
            not a member gets ``{"error": "not a member of this run ..."}`` and is closed (``requests_refused``).

    Raises:
        ValueError: chunk_bytes or keep_epochs out of range.
    """

    def __init__(
        self,
        get_state: Callable[[], TrainingState | StateFile | None],
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        faults: FaultInjector = NO_FAULTS,
        keep_epochs: int = SERVED_EPOCHS,
        idle_timeout_s: float = 30.0,
        max_downloaders: int = 0,
        known_hash: Callable[[TrainingState], str | None] | None = None,
    ):
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES or chunk_bytes % 4:
            raise ValueError(f"chunk_bytes must be a multiple of 4 in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]")
        if keep_epochs < 1 or idle_timeout_s <= 0 or max_downloaders < 0:
            raise ValueError("keep_epochs must be >= 1, idle_timeout_s > 0 and max_downloaders >= 0")
        self.get_state = get_state
        self.known_hash = known_hash
        self.chunk_bytes = chunk_bytes
        self.faults = faults
        self.keep_epochs = min(keep_epochs, MAX_RECENT)
        self.idle_timeout_s = idle_timeout_s
        self._recent: list[_Snapshot] = []  # oldest first; one per epoch; at most keep_epochs
        self._lock = threading.Lock()  # guards _recent; held only briefly (the event loop takes it)
        self._hash_lock = threading.Lock()  # one thread hashes snapshots at a time
        self.admits: Callable[[str], bool] | None = None  # set for an invite-only run: serve members only
        self.requests_refused = 0  # streams from peers that are not members of the run
        self.bytes_served = 0
        self.chunks_refused = 0  # chunks whose bytes changed since they were hashed (state modified in place)
        self.max_downloaders = max_downloaders
        self._downloaders: dict[str, int] = {}  # peer -> its streams fetching chunks now (the event loop's only)
        self.requests_busy = 0  # chunk requests refused because max_downloaders others were being served

    # ---- snapshots (any thread) ----------------------------------------------------------------------------------

    def observe(self) -> None:
        """Record the owner's current state as a snapshot (a reference; hashing waits for the first request).

        Called on every meta request; an owner may also call it after each commit so that an epoch no joiner asked
        about while it was current can still be served afterwards."""
        state = self.get_state()
        if state is None:
            return
        with self._lock:
            newest = self._recent[-1] if self._recent else None
            if newest is not None and newest.state is state:
                return
            if newest is not None and newest.state.epoch == state.epoch:
                self._recent[-1] = _Snapshot(state)  # same epoch, other state (fork resolved): the old one is void
            else:
                self._recent.append(_Snapshot(state))
                del self._recent[: -self.keep_epochs]

    def _manifests(self) -> list[_Snapshot]:
        """Every retained snapshot with its manifest computed (newest last). CPU-bound: run off the event loop; the
        hashing holds only ``_hash_lock``, which the event loop never takes."""
        self.observe()
        with self._hash_lock:
            with self._lock:
                todo = [s for s in self._recent if s.manifest is None]
            for snapshot in todo:
                state = snapshot.state
                read = _reader(state)
                state_hash = (self.known_hash(state) if self.known_hash is not None else None) or state.state_hash()
                manifest = build_manifest(state.epoch, state_hash, read, state.num_bytes(), self.chunk_bytes)
                with self._lock:
                    snapshot.read, snapshot.manifest = read, manifest
        with self._lock:
            return [s for s in self._recent if s.manifest is not None]

    def _find(self, epoch: object, state_hash: object) -> _Snapshot | None:
        with self._lock:
            for snapshot in reversed(self._recent):
                manifest = snapshot.manifest
                if manifest is not None and manifest.epoch == epoch and state_hash in (None, manifest.state_hash):
                    return snapshot
        return None

    def _payload(self, snapshot: _Snapshot, index: int) -> bytes | None:
        """Chunk ``index`` read from the snapshot's tensors and hashed again; None if its bytes changed."""
        assert snapshot.manifest is not None and snapshot.read is not None
        start, end = snapshot.manifest.chunk_range(index)
        data = snapshot.read(start, end)
        if hashlib.sha256(data).hexdigest() != snapshot.manifest.chunk_hashes[index]:
            with self._lock:
                if snapshot in self._recent:
                    self._recent.remove(snapshot)
            self.chunks_refused += 1
            logger.warning("state of epoch %d changed after it was hashed: no longer served", snapshot.state.epoch)
            return None
        return data

    # ---- protocol (event loop) -----------------------------------------------------------------------------------

    async def register(self, p2p: P2P, run_id: str) -> None:
        await p2p.add_binary_stream_handler(f"{run_id}.state", self._handle)

    async def _write_chunk(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        await writer.drain()

    async def _reply_meta(self, writer: asyncio.StreamWriter, request: dict) -> bool:
        snapshots = await asyncio.get_running_loop().run_in_executor(None, self._manifests)
        if not snapshots:
            await send_control(writer, {"error": "no state to share yet"})
            return False
        if "epoch" in request:
            chosen = self._find(request.get("epoch"), request.get("state_hash"))
            if chosen is None:
                await send_control(writer, {"error": "that epoch is no longer served"})
                return False
        else:
            chosen = snapshots[-1]
        assert chosen.manifest is not None
        message = chosen.manifest.to_message()
        message["recent"] = [[s.manifest.epoch, s.manifest.state_hash] for s in snapshots if s.manifest is not None]
        self.faults.check(HookPoint.STATE_BEFORE_SERVE, epoch=chosen.manifest.epoch, meta=message)
        await send_control(writer, message)
        return True

    async def _reply_chunk(self, writer: asyncio.StreamWriter, request: dict) -> bool:
        snapshot = self._find(request.get("epoch"), request.get("state_hash"))
        if snapshot is None:
            await send_control(writer, {"error": "that epoch is no longer served"})
            return False
        assert snapshot.manifest is not None
        index = request.get("index")
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < snapshot.manifest.num_chunks:
            await send_control(writer, {"error": "bad chunk index"})
            return False
        data = await asyncio.get_running_loop().run_in_executor(None, self._payload, snapshot, index)
        if data is None:
            await send_control(writer, {"error": "that state changed while served"})
            return False
        await send_control(writer, {"ok": True, "num_bytes": len(data)})
        await self._write_chunk(writer, data)
        self.bytes_served += len(data)
        return True

    def _admit_downloader(self, requester: str) -> bool:
        """Count a stream of ``requester`` as fetching chunks; False (and nothing counted) past ``max_downloaders``
        other peers."""
        if self.max_downloaders and requester not in self._downloaders:
            if len(self._downloaders) >= self.max_downloaders:
                self.requests_busy += 1
                return False
        self._downloaders[requester] = self._downloaders.get(requester, 0) + 1
        return True

    def _release_downloader(self, requester: str) -> None:
        left = self._downloaders.get(requester, 0) - 1
        if left > 0:
            self._downloaders[requester] = left
        else:
            self._downloaders.pop(requester, None)

    async def _handle(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        downloading = False  # this stream counts as one of its requester's chunk streams
        requester = str(getattr(info, "peer_id", ""))  # StreamInfo: the peer the libp2p daemon authenticated
        try:
            if self.admits is not None and not self.admits(requester):
                self.requests_refused += 1
                logger.info("refusing a state request from %s: not a member of this run", requester)
                await send_control(writer, {"error": "not a member of this run (it admits only invited peers)"})
                return
            while True:
                try:
                    request = await recv_control(reader, self.idle_timeout_s)
                except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
                    return
                except ProtocolError as exc:
                    await send_control(writer, {"error": str(exc)})
                    return
                op = request.get("op")
                if op == "meta":
                    keep_going = await self._reply_meta(writer, request)
                elif op == "chunk":
                    if not downloading and not self._admit_downloader(requester):
                        busy = f"busy: serving {len(self._downloaders)} downloads (the most); fetch from other donors"
                        await send_control(writer, {"error": busy})
                        return
                    downloading = True
                    keep_going = await self._reply_chunk(writer, request)
                else:
                    await send_control(writer, {"error": f"unknown op {str(op)[:40]!r}"})
                    keep_going = False
                if not keep_going:
                    return
        except asyncio.CancelledError:  # shutdown: this handler task is awaited by nobody
            return
        except Exception as exc:  # noqa: BLE001 - one bad client must not take the server down
            logger.debug("state request failed: %r", exc)
        finally:
            if downloading:
                self._release_downloader(requester)
            writer.close()
