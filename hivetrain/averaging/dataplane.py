"""The averaging data plane: authenticated direct TCP links carrying fixed-header binary frames.

Why not libp2p streams: hivemind's all-reduce moves tensors through p2pd, protobuf messages and asyncio queues; on
loopback it is 9-11x slower than gloo. Here each pair of group members holds one TCP connection, tensors go from
their memory to the socket and from the socket into the destination tensor (``recv_into``), with no copy in between
and no serialisation.

Frame (little-endian)::

    magic b"HVA1" | version u8 | type u8 | subround u16 | meta num_bytes u32 | payload num_bytes u64
    | meta (msgpack map, <= MAX_META_BYTES) | payload (raw bytes)

The receiver checks magic, version, type and both sizes before reading anything else; payload sizes must equal what
the round expects exactly. Metadata is msgpack (plain types only); nothing is unpickled.

Authentication (per round, per pair of members):
    Every member's RSA-signed ready entry (see ``matchmaking``) carries a fresh X25519 public key. The pair key is
    ``HKDF-SHA256(X25519(own secret, peer public), salt=round id, info=both peer ids)``. The dialer sends HELLO
    (round id, both ids, a nonce), the listener answers CHALLENGE (its nonce, HMAC of both nonces), the dialer
    answers AUTH (HMAC). Each side has then proved it holds the secret of the signed entry of this round.

    Protected: a stranger, or a peer of another round, cannot open a link into a round, and cannot replay an old
    handshake (fresh nonces, fresh keys per call). Commit votes are MACed with the pair key, so a vote cannot be
    forged. Not protected: frames after the handshake are neither encrypted nor MACed, so an attacker on the path
    who can hijack TCP could alter parts (tampering with results is caught by the commit hash: members would hold
    different bytes and abort). Any TCP client can open connections: unauthenticated ones are limited in number
    and dropped after ``connect_timeout_s``. Use a VPN (e.g. WireGuard) where confidentiality matters.
"""

from __future__ import annotations

import enum
import hmac
import logging
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import msgpack
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

logger = logging.getLogger(__name__)

_MAGIC = b"HVA1"
_VERSION = 1
HEADER = struct.Struct("<4sBBHIQ")
MAX_META_BYTES = 1 << 20
MAX_HANDSHAKE_META_BYTES = 4096
MAX_DECLARE_META_BYTES = 8 << 20
MAX_PENDING_CONNECTIONS = 256
_CHUNK_BYTES = 8 << 20


class FrameType(enum.IntEnum):
    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    PART = 4
    RESULT = 5
    VOTE = 6
    HEARTBEAT = 7
    DECLARE = 8
    READY = 9


class LinkClosed(ConnectionError):
    """The link failed: the peer closed it, reset it, stalled past the timeout, or broke the protocol."""


class Unreachable(LinkClosed):
    """No direct TCP connection could be opened to a member's announced data-plane address."""


class AuthFailed(ConnectionError):
    """The handshake did not prove the peer's identity for this round."""


def pair_key(own_secret: X25519PrivateKey, peer_public: bytes, round_id: str, id_a: str, id_b: str) -> bytes:
    """The 32-byte key shared by two members of a round (order of ``id_a``/``id_b`` does not matter)."""
    shared = own_secret.exchange(X25519PublicKey.from_public_bytes(peer_public))
    lo, hi = sorted((id_a, id_b))
    info = f"hivetrain.averaging.link.v1|{lo}|{hi}".encode()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=round_id.encode(), info=info).derive(shared)


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over the length-prefixed ``parts``."""
    h = hmac.new(key, digestmod="sha256")
    for p in parts:
        h.update(len(p).to_bytes(8, "little") + p)
    return h.digest()


class Link:
    """One authenticated TCP connection to a group member. Sends and receives may run on two threads at once.

    Every blocking call waits at most ``timeout_s`` for *progress* (a byte moving), so a stalled or vanished peer
    raises LinkClosed after that long, whatever the frame size.
    """

    def __init__(self, sock: socket.socket, peer_id: str, key: bytes, timeout_s: float):
        self.sock, self.peer_id, self.key = sock, peer_id, key
        sock.settimeout(timeout_s)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.rtt_s = 0.0  # round-trip time measured during the handshake, seconds
        self._closed = False

    def set_timeout(self, timeout_s: float) -> None:
        self.sock.settimeout(timeout_s)

    def send_frame(
        self,
        ftype: FrameType,
        subround: int,
        meta: dict,
        payload: Sequence[memoryview | bytes] = (),
        on_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        """Send one frame; ``on_progress(sent, total)`` is called after each chunk of payload. Raises LinkClosed."""
        meta_bytes = msgpack.packb(meta, use_bin_type=True)
        views = [memoryview(p).cast("B") for p in payload]
        total = sum(v.nbytes for v in views)
        self._send(HEADER.pack(_MAGIC, _VERSION, int(ftype), subround, len(meta_bytes), total) + meta_bytes)
        sent = 0
        for v in views:
            for start in range(0, v.nbytes, _CHUNK_BYTES):
                self._send(v[start : start + _CHUNK_BYTES])
                sent += min(_CHUNK_BYTES, v.nbytes - start)
                if on_progress is not None:
                    on_progress(sent, total)

    def _send(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        try:
            while view.nbytes:
                n = self.sock.send(view)
                view = view[n:]
                self.bytes_sent += n
        except (OSError, ValueError) as exc:
            raise LinkClosed(f"sending to {self.peer_id}: {_describe(exc)}") from None

    def recv_header(
        self, max_meta_bytes: int = MAX_META_BYTES, per_type: Mapping[FrameType, int] | None = None
    ) -> tuple[FrameType, int, dict, int]:
        """Read a frame's header and metadata. Returns (type, subround, meta, payload num_bytes).

        ``per_type`` overrides ``max_meta_bytes`` for the frame types it names. Raises LinkClosed."""
        raw = self.recv_exact(HEADER.size)
        magic, version, ftype, subround, meta_len, payload_len = HEADER.unpack(raw)
        if magic != _MAGIC or version != _VERSION or ftype not in FrameType._value2member_map_:
            raise LinkClosed(f"{self.peer_id} sent a bad frame header (magic {magic!r}, version {version})")
        if per_type is not None:
            max_meta_bytes = per_type.get(FrameType(ftype), max_meta_bytes)
        if meta_len > max_meta_bytes:
            raise LinkClosed(f"{self.peer_id} sent {meta_len} bytes of metadata (limit {max_meta_bytes})")
        try:
            meta = msgpack.unpackb(self.recv_exact(meta_len), raw=False, strict_map_key=True) if meta_len else {}
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise LinkClosed(f"{self.peer_id} sent malformed metadata: {exc}") from None
        if not isinstance(meta, dict):
            raise LinkClosed(f"{self.peer_id} sent metadata that is not a map")
        return FrameType(ftype), subround, meta, payload_len

    def recv_exact(self, num_bytes: int) -> bytearray:
        buf = bytearray(num_bytes)
        self.recv_into(memoryview(buf))
        return buf

    def recv_into(self, view: memoryview, on_chunk: Callable[[memoryview], None] | None = None) -> None:
        """Fill ``view`` completely from the socket. Raises LinkClosed on EOF, reset or a stall."""
        view = view.cast("B")
        offset, total = 0, view.nbytes
        try:
            while offset < total:
                n = self.sock.recv_into(view[offset:], min(total - offset, _CHUNK_BYTES))
                if n == 0:
                    raise LinkClosed(f"{self.peer_id} closed the connection")
                if on_chunk is not None:
                    on_chunk(view[offset : offset + n])
                offset += n
                self.bytes_received += n
        except (OSError, ValueError) as exc:
            raise LinkClosed(f"receiving from {self.peer_id}: {_describe(exc)}") from None

    def finish(self) -> None:
        """Graceful end: send FIN after everything queued, keep the read side open so that whatever the peer still
        sends (e.g. a heartbeat) is read and dropped by ``drain`` instead of answered with a reset (a reset would make
        the peer's kernel discard data it has not read yet, such as our vote)."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def drain(self, timeout_s: float) -> None:
        """Read and drop bytes until the peer closes, an error, or ``timeout_s`` without a byte; then close."""
        scratch = bytearray(1 << 16)
        try:
            self.sock.settimeout(timeout_s)
            while self.sock.recv_into(scratch):
                pass
        except (OSError, ValueError):
            pass
        finally:
            self.close()

    def close(self) -> None:
        """Shut the connection down (wakes any thread blocked on it); idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError | socket.timeout):
        return "no progress within the part timeout (stalled?)"
    return f"{type(exc).__name__}: {exc}"


def _tune(sock: socket.socket, buffer_num_bytes: int) -> None:
    if sock.family == socket.AF_UNIX:  # a libp2p stream bridged to a socket pair (``relay``): nothing to tune
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_num_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_num_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_num_bytes)


@dataclass(frozen=True)
class RoundKeys:
    """What a registered round tells the server to authenticate incoming links.

    Attributes:
        round_id: the round's id.
        my_id: our peer id.
        secret: our X25519 secret for this call.
        peers: peer id -> X25519 public key (from their signed entries) of the members allowed to dial us.
        attach: called with each authenticated incoming Link.
    """

    round_id: str
    my_id: str
    secret: X25519PrivateKey
    peers: dict[str, bytes]
    attach: Callable[[Link], None]


def dial(
    host: str,
    port: int,
    keys: RoundKeys,
    peer_id: str,
    *,
    connect_timeout_s: float,
    part_timeout_s: float,
    buffer_num_bytes: int,
    join_wait_s: float = 0.0,
    sock: socket.socket | None = None,
) -> Link:
    """Connect to member ``peer_id`` and authenticate both ways within ``connect_timeout_s`` (+ ``join_wait_s``,
    how long the member may hold our HELLO until it has learned of the round itself).

    ``sock``: an already connected socket to use instead of dialing ``host:port`` (a libp2p stream bridged to a
    socket by ``relay.P2PFallback``); it is authenticated the same way and closed on failure.

    Raises:
        Unreachable: no TCP connection to ``host:port`` (the caller may try the libp2p fallback).
        LinkClosed: it closed the connection (e.g. it is not in this round).
        AuthFailed: it did not prove it holds the secret of its signed entry.
    """
    if sock is None:
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        except OSError as exc:
            raise Unreachable(f"cannot connect to {peer_id} at {host}:{port}: {_describe(exc)}") from None
    _tune(sock, buffer_num_bytes)
    key = pair_key(keys.secret, keys.peers[peer_id], keys.round_id, keys.my_id, peer_id)
    link = Link(sock, peer_id, key, connect_timeout_s)
    try:
        nonce = os.urandom(16)
        hello = {"round_id": keys.round_id, "sender": keys.my_id, "receiver": peer_id, "nonce": nonce}
        sent_at = time.monotonic()
        link.send_frame(FrameType.HELLO, 0, hello)
        link.set_timeout(connect_timeout_s + join_wait_s)
        ftype, _, meta, payload_len = link.recv_header(MAX_HANDSHAKE_META_BYTES)
        held_s = meta.get("held_s")
        held_s = float(held_s) if isinstance(held_s, float | int) and math.isfinite(held_s) else 0.0
        link.rtt_s = max(0.0, time.monotonic() - sent_at - held_s)
        their_nonce, their_mac = meta.get("nonce"), meta.get("mac")
        if ftype != FrameType.CHALLENGE or payload_len or not isinstance(their_nonce, bytes) or len(their_nonce) != 16:
            raise AuthFailed(f"{peer_id} answered the handshake with a malformed {ftype.name}")
        if not isinstance(their_mac, bytes) or not hmac.compare_digest(
            their_mac, mac(key, b"resp", nonce, their_nonce)
        ):
            raise AuthFailed(f"{peer_id} failed to prove its round key")
        link.set_timeout(connect_timeout_s)
        link.send_frame(FrameType.AUTH, 0, {"mac": mac(key, b"init", their_nonce, nonce)})
    except BaseException:
        link.close()
        raise
    link.set_timeout(part_timeout_s)
    link.bytes_sent = link.bytes_received = 0
    return link


def push_record(host: str, port: int, ftype: FrameType, meta: dict, *, timeout_s: float) -> None:
    """Send one unauthenticated one-way frame (a signed matchmaking record) to a data port and close.

    The receiver trusts the record only if its signature verifies (see ``matchmaking``). Raises LinkClosed if the
    port is unreachable or the send does not finish within ``timeout_s`` seconds."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise LinkClosed(f"cannot connect to {host}:{port}: {_describe(exc)}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    link = Link(sock, f"{host}:{port}", b"", timeout_s)
    try:
        link.send_frame(ftype, 0, meta)
    finally:
        link.finish()
        link.close()


def send_declaration(host: str, port: int, declaration: dict, *, timeout_s: float) -> None:
    """Push a signed group declaration (a plain dict) to a member's data port. Raises LinkClosed on failure."""
    push_record(host, port, FrameType.DECLARE, {"decl": declaration}, timeout_s=timeout_s)


def send_ready(host: str, port: int, entry: dict, *, timeout_s: float) -> None:
    """Push our signed ready entry (a plain dict) to the expected leader's data port. Raises LinkClosed on failure."""
    push_record(host, port, FrameType.READY, {"entry": entry}, timeout_s=timeout_s)


class Pusher:
    """Best-effort pushes of signed matchmaking records to peers' data ports, one short-lived thread per target.

    A push that fails (peer gone, port closed, no progress within ``timeout_s``) is logged and dropped: the receiver
    reads the same record from the DHT at its next poll. Call as ``pusher(kind, raw, targets)``: ``kind`` "group"
    (a declaration) or "ready" (an entry), ``raw`` the record as a plain dict, ``targets`` objects with ``peer_id``,
    ``host`` and ``port`` (ready entries)."""

    def __init__(self, timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s

    def __call__(self, kind: str, raw: dict, targets: Sequence) -> None:
        send = {"group": send_declaration, "ready": send_ready}[kind]

        def push(target) -> None:
            try:
                send(target.host, target.port, raw, timeout_s=self.timeout_s)
            except ConnectionError as exc:
                logger.debug("could not push a %s record to %s: %s", kind, target.peer_id, exc)

        for target in targets:
            threading.Thread(target=push, args=(target,), name=f"hivetrain-avg-push-{kind}", daemon=True).start()


class DataPlaneServer:
    """Accepts links for the rounds registered with it; a HELLO for a round not registered yet is held up to
    ``join_wait_s`` (members learn of a group at slightly different times).

    Lifecycle: ``start`` -> ``register``/``unregister`` -> ``shutdown``. Threads: one acceptor, plus one
    short-lived handshake thread per incoming connection (at most
    ``MAX_PENDING_CONNECTIONS`` at once; more are refused)."""

    def __init__(
        self,
        listen_host: str,
        *,
        connect_timeout_s: float,
        part_timeout_s: float,
        buffer_num_bytes: int,
        join_wait_s: float = 0.0,
        on_declaration: Callable[[object], bool] | None = None,
        on_ready: Callable[[object], bool] | None = None,
    ):
        self.listen_host, self.join_wait_s, self.on_declaration = listen_host, join_wait_s, on_declaration
        self.on_ready = on_ready
        self._meta_limits = {FrameType.HELLO: MAX_HANDSHAKE_META_BYTES, FrameType.READY: MAX_HANDSHAKE_META_BYTES}
        if on_declaration is not None:
            self._meta_limits[FrameType.DECLARE] = MAX_DECLARE_META_BYTES
        self.connect_timeout_s, self.part_timeout_s = connect_timeout_s, part_timeout_s
        self.buffer_num_bytes = buffer_num_bytes
        self._rounds: dict[str, RoundKeys] = {}
        self._cond = threading.Condition()
        self._pending = threading.BoundedSemaphore(MAX_PENDING_CONNECTIONS)
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.port = 0
        self.rejected = 0

    def start(self) -> int:
        """Bind and listen; returns the port. Raises OSError if the address cannot be bound."""
        family = socket.AF_INET6 if ":" in self.listen_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.buffer_num_bytes:  # set before listen so accepted sockets inherit a large window
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.buffer_num_bytes)
        sock.bind((self.listen_host, 0))
        sock.listen(128)
        sock.settimeout(0.2)
        self._sock, self.port = sock, sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name="hivetrain-avg-accept", daemon=True)
        self._thread.start()
        return self.port

    def register(self, keys: RoundKeys) -> None:
        with self._cond:
            self._rounds[keys.round_id] = keys
            self._cond.notify_all()

    def unregister(self, round_id: str) -> None:
        with self._cond:
            self._rounds.pop(round_id, None)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop accepting; idempotent. Links already handed to rounds are closed by their rounds."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._sock is not None:
            self._sock.close()

    def accept_connection(self, conn: socket.socket) -> None:
        """Serve a connection that arrived another way (a libp2p stream bridged to a socket by ``relay``): it is
        authenticated exactly like one accepted on our TCP port. Closed at once if we are shut down or too many
        handshakes are pending."""
        if self._stop.is_set() or not self._pending.acquire(blocking=False):
            self.rejected += 1
            conn.close()
            return
        threading.Thread(target=self._handshake, args=(conn,), name="hivetrain-avg-hs", daemon=True).start()

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            if not self._pending.acquire(blocking=False):
                self.rejected += 1
                conn.close()
                continue
            threading.Thread(target=self._handshake, args=(conn,), name="hivetrain-avg-hs", daemon=True).start()

    def _handshake(self, conn: socket.socket) -> None:
        try:
            _tune(conn, self.buffer_num_bytes)
            conn.settimeout(self.connect_timeout_s)
            probe = Link(conn, "?", b"", self.connect_timeout_s)
            ftype, _, meta, payload_len = probe.recv_header(0, self._meta_limits)  # other types: no metadata
            pushed = {FrameType.DECLARE: (self.on_declaration, "decl"), FrameType.READY: (self.on_ready, "entry")}
            handler, field = pushed.get(ftype, (None, ""))
            if handler is not None and not payload_len:
                if not handler(meta.get(field)):  # verifies the signatures before using anything
                    self.rejected += 1
                conn.close()
                return
            round_id, sender, receiver, nonce = (meta.get(k) for k in ("round_id", "sender", "receiver", "nonce"))
            if ftype != FrameType.HELLO or payload_len or not isinstance(nonce, bytes) or len(nonce) != 16:
                raise AuthFailed("malformed HELLO")
            if not isinstance(round_id, str) or not isinstance(sender, str):
                raise AuthFailed("malformed HELLO")
            arrived_at = time.monotonic()
            with self._cond:
                self._cond.wait_for(lambda: round_id in self._rounds or self._stop.is_set(), self.join_wait_s)
                keys = self._rounds.get(round_id)
            if keys is None or receiver != keys.my_id or sender not in keys.peers:
                raise AuthFailed(f"unknown round {str(round_id)[:12]} or peer {sender}")
            key = pair_key(keys.secret, keys.peers[sender], round_id, keys.my_id, sender)
            link = Link(conn, sender, key, self.connect_timeout_s)
            my_nonce = os.urandom(16)
            challenge = {"nonce": my_nonce, "mac": mac(key, b"resp", nonce, my_nonce)}
            challenge_at = time.monotonic()
            link.send_frame(FrameType.CHALLENGE, 0, {**challenge, "held_s": challenge_at - arrived_at})
            ftype, _, meta, payload_len = link.recv_header(MAX_HANDSHAKE_META_BYTES)
            link.rtt_s = time.monotonic() - challenge_at
            their_mac = meta.get("mac")
            if ftype != FrameType.AUTH or payload_len or not isinstance(their_mac, bytes):
                raise AuthFailed(f"{sender} sent a malformed AUTH")
            if not hmac.compare_digest(their_mac, mac(key, b"init", my_nonce, nonce)):
                raise AuthFailed(f"{sender} failed to prove its round key")
            link.set_timeout(self.part_timeout_s)
            link.bytes_sent = link.bytes_received = 0
            keys.attach(link)
        except (ConnectionError, OSError, ValueError) as exc:
            self.rejected += 1
            logger.debug("dropping an incoming data-plane connection: %s", exc)
            try:
                conn.close()
            except OSError:
                pass
        finally:
            self._pending.release()
