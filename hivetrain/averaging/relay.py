"""The libp2p fallback of the data plane: links to members that direct TCP cannot reach.

A volunteer behind NAT announces a data-plane address nobody can dial. hivemind's p2pd still reaches it (a direct
libp2p connection, hole punching, or a circuit relay with ``use_relay``). When a direct TCP dial fails:

1. **Dial-back** (connection reversal): the dialing member asks the member, over a short libp2p stream (handler
   ``"{prefix}.dial_back"``; request: a 2-byte length and msgpack ``{"round_id": str}``; the requester is the
   stream's authenticated libp2p peer id), to dial *it*. The member dials the requester's signed data-plane address
   directly (``DataPlaneServer.dial_back``) and answers whether that worked. A volunteer behind NAT can usually
   connect out, so its links to every reachable member stay direct TCP, at full speed and without loading a relay.
   Nothing is dialed that the requester did not sign in its ready entry, so the request cannot aim our connections
   elsewhere.
2. **Stream**: if that fails too (both behind NAT), the dialing member opens a libp2p stream to the member's peer id
   (handler ``"{prefix}.data"``) and runs the same data-plane protocol over it: each stream is bridged to one end of
   a local socket pair, and the other end is used exactly like a TCP socket (``dataplane.dial(sock=...)`` on the
   dialing side, ``DataPlaneServer.accept_connection`` on the accepting side). Throughput is lower than direct TCP
   (every byte crosses the p2pd daemons, possibly a relay, and this process's event loop).

Either way the X25519 handshake bound to the signed ready entries authenticates the link as for any TCP link (libp2p
adds its own transport encryption, Noise/TLS). A member whose direct dial failed skips the direct attempt for
``remember_unreachable_s`` seconds.

If a member dies mid-stream, its daemon closes the stream, the bridge closes our socket end, and the round sees a
closed link (``LinkClosed``) as for TCP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time

import msgpack
from hivemind.p2p import P2P, PeerID

from hivetrain.averaging.dataplane import DataPlaneServer, LinkClosed
from hivetrain.peers.loop import LoopThread

logger = logging.getLogger(__name__)

CHUNK_NUM_BYTES = 1 << 16  # bytes moved per read between a stream and its socket
# after our side ends, how long a bridge keeps the stream open for the peer to read our last frames and end too; a round
# that failed (our links closed at once) reaches a relayed peer this much later, a failure it would see anyway
FIN_GRACE_S = 2.0
MAX_DIAL_BACK_REQUEST_BYTES = 256
DIAL_BACK_OK, DIAL_BACK_FAILED = b"ok", b"no"


async def _daemon_listen_maddr(_dht, node):
    """Runs inside the DHT process (``DHT.run_coroutine``): the control address of its p2pd."""
    return node.p2p.daemon_listen_maddr


class UnreachableCache:
    """Members whose direct dial failed recently (pure: time injected). Thread-safe."""

    def __init__(self, remember_s: float):
        self.remember_s = remember_s
        self._failed_at: dict[str, float] = {}
        self._lock = threading.Lock()

    def mark(self, peer_id: str, now: float) -> None:
        with self._lock:
            self._failed_at[peer_id] = now
            for p in [p for p, t in self._failed_at.items() if now - t > self.remember_s]:
                del self._failed_at[p]

    def is_unreachable(self, peer_id: str, now: float) -> bool:
        with self._lock:
            failed_at = self._failed_at.get(peer_id)
        return failed_at is not None and now - failed_at <= self.remember_s


class P2PFallback:
    """Sends and serves dial-back requests, and opens and serves data-plane links over libp2p streams of our DHT
    node's p2pd.

    Args:
        node: our running DHT node (``peers.node.PeerNode``).
        prefix: the averager's DHT prefix; the stream handlers are ``f"{prefix}.data"`` and ``f"{prefix}.dial_back"``.
        server: the averager's data-plane server, which authenticates incoming links and dials members back.
        remember_unreachable_s: how long a member whose direct dial failed skips the direct attempt, seconds.
    """

    def __init__(self, node, prefix: str, server: DataPlaneServer, remember_unreachable_s: float = 600.0):
        self.node, self.server = node, server
        self.handler_name = f"{prefix}.data"
        self.dial_back_handler_name = f"{prefix}.dial_back"
        self.streams_opened = self.dial_backs_requested = self.dial_backs_served = 0  # counters (tests, logs)
        self.unreachable = UnreachableCache(remember_unreachable_s)
        self._loop: LoopThread | None = None
        self._p2p: P2P | None = None
        self._tasks: set[asyncio.Task] = set()

    def start(self, timeout_s: float) -> None:
        """Connect to our p2pd and register both stream handlers. Raises TimeoutError or the daemon's error.

        The connection is our own P2P client, not ``DHT.replicate_p2p()``: that one is cached per process and bound
        to the event loop that first asked for it (the trainer's, or an averager's that has since shut down), and a
        stream handler served by a stopped loop stalls every stream sent to it."""
        self._loop = LoopThread(name="hivetrain-avg-p2p")
        daemon_maddr = self.node.dht.run_coroutine(_daemon_listen_maddr, return_future=True).result(timeout=timeout_s)
        self._p2p = self._loop.run(P2P.replicate(daemon_maddr), timeout_s)
        self._loop.run(self._p2p.add_binary_stream_handler(self.handler_name, self._on_stream), timeout_s)
        self._loop.run(self._p2p.add_binary_stream_handler(self.dial_back_handler_name, self._on_dial_back), timeout_s)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Unregister the handlers and close open bridges; idempotent."""
        loop, p2p, self._loop = self._loop, self._p2p, None
        if loop is None:
            return
        if p2p is None:  # start() failed before the client existed
            loop.stop(timeout_s)
            return

        async def stop() -> None:
            for name in (self.handler_name, self.dial_back_handler_name):
                with contextlib.suppress(Exception):
                    await p2p.remove_binary_stream_handler(name)
            for task in list(self._tasks):
                task.cancel()
            await p2p.shutdown()  # our client only: the daemon belongs to the DHT

        with contextlib.suppress(Exception):
            loop.run(stop(), timeout_s)
        loop.stop(timeout_s)

    def open_socket(self, peer_id: str, timeout_s: float) -> socket.socket:
        """A socket whose bytes travel over a new libp2p stream to ``peer_id``'s data plane.

        Raises:
            LinkClosed: the stream could not be opened within ``timeout_s`` seconds (or we are shut down).
        """
        loop, p2p = self._loop, self._p2p
        if loop is None or p2p is None:
            raise LinkClosed("the libp2p fallback is not running")

        async def open_stream() -> socket.socket:
            _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), self.handler_name)
            ours, theirs = socket.socketpair()
            self._spawn(self._bridge(reader, writer, theirs))
            return ours

        try:
            sock = loop.run(open_stream(), timeout_s)
        except Exception as exc:  # noqa: BLE001 - any daemon error means "cannot reach it over libp2p either"
            raise LinkClosed(f"no libp2p stream to {peer_id}: {type(exc).__name__}: {exc}") from None
        self.streams_opened += 1
        return sock

    def request_dial_back(self, peer_id: str, round_id: str, timeout_s: float) -> bool:
        """Ask ``peer_id`` over libp2p to dial our data plane for round ``round_id``; True once it reports that its
        direct dial succeeded (the link then reaches our server), False if it could not, did not answer within
        ``timeout_s`` seconds, or libp2p cannot reach it. Never raises."""
        loop, p2p = self._loop, self._p2p
        if loop is None or p2p is None:
            return False
        self.dial_backs_requested += 1

        async def ask() -> bytes:
            _, reader, writer = await p2p.call_binary_stream_handler(
                PeerID.from_base58(peer_id), self.dial_back_handler_name
            )
            try:  # no half-close: p2pd ends the whole stream on EOF, so the request is length-prefixed
                request = msgpack.packb({"round_id": round_id})
                writer.write(len(request).to_bytes(2, "big") + request)
                await writer.drain()
                return await reader.readexactly(len(DIAL_BACK_OK))
            finally:
                writer.close()

        try:
            return loop.run(ask(), timeout_s) == DIAL_BACK_OK
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, the caller falls back to a libp2p stream
            logger.debug("dial-back request to %s failed: %r", peer_id, exc)
            return False

    def note_unreachable(self, peer_id: str) -> None:
        self.unreachable.mark(peer_id, time.monotonic())

    def prefers_libp2p(self, peer_id: str) -> bool:
        """Whether ``peer_id``'s direct dial failed recently (skip it: ask for a dial-back, then a libp2p stream)."""
        return self.unreachable.is_unreachable(peer_id, time.monotonic())

    async def _on_dial_back(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve a dial-back request: ``{"round_id": str}`` (msgpack, at most 256 bytes) from the stream's peer."""
        answer = DIAL_BACK_FAILED
        try:
            size = int.from_bytes(await asyncio.wait_for(reader.readexactly(2), self.server.connect_timeout_s), "big")
            if size > MAX_DIAL_BACK_REQUEST_BYTES:
                raise ValueError(f"a {size}-byte dial-back request")
            data = await asyncio.wait_for(reader.readexactly(size), self.server.connect_timeout_s)
            request = msgpack.unpackb(data, raw=False)
            round_id = request.get("round_id") if isinstance(request, dict) else None
            if isinstance(round_id, str):
                requester = info.peer_id.to_base58()
                if await asyncio.to_thread(self.server.dial_back, round_id, requester):
                    answer = DIAL_BACK_OK
                    self.dial_backs_served += 1
            else:
                logger.debug("malformed dial-back request from %s", info.peer_id)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            logger.debug("dial-back request from %s dropped: %r", info.peer_id, exc)
        with contextlib.suppress(Exception):
            writer.write(answer)
            await writer.drain()
        writer.close()

    # ---- bridging -----------------------------------------------------------------------------------------------
    async def _on_stream(self, _info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ours, theirs = socket.socketpair()
        self.server.accept_connection(ours)  # authenticated by the server's handshake thread, like a TCP link
        await self._bridge(reader, writer, theirs)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _bridge(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sock: socket.socket) -> None:
        """Copy bytes both ways between a libp2p stream and ``sock`` until both directions end; then close both."""
        loop = asyncio.get_running_loop()
        sock.setblocking(False)

        remote_ended = asyncio.Event()

        async def to_stream() -> None:
            while data := await loop.sock_recv(sock, CHUNK_NUM_BYTES):
                writer.write(data)
                await writer.drain()
            # Our side is done (a graceful FIN after a commit). p2pd ends the whole stream on EOF, both directions: the
            # peer's next write (a heartbeat while it waits for our vote) then fails, its daemon resets the stream and
            # drops what it had not read yet, our vote included. So the EOF waits until the peer ends too (it does once
            # it has read our last frames and committed), at most FIN_GRACE_S; the TCP counterpart is ``Link.drain``.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(remote_ended.wait(), FIN_GRACE_S)
            if writer.can_write_eof():
                writer.write_eof()

        async def to_socket() -> None:
            try:
                while data := await reader.read(CHUNK_NUM_BYTES):
                    await loop.sock_sendall(sock, data)
                sock.shutdown(socket.SHUT_WR)
            finally:
                remote_ended.set()

        try:
            results = await asyncio.gather(to_stream(), to_socket(), return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException) and not isinstance(r, ConnectionError | asyncio.CancelledError):
                    logger.debug("libp2p data-plane bridge ended: %s", r)
        finally:
            sock.close()
            writer.close()
