"""The averaging data plane: dialing, accepting and authenticating links that carry ``wire`` frames.

Why not libp2p streams first: hivemind's all-reduce moves tensors through p2pd, protobuf messages and asyncio queues;
on loopback it is 9-11x slower than gloo. Here each pair of group members holds one TCP connection, tensors go from
their memory to the socket and from the socket into the destination tensor (``recv_into``), with no copy in between
and no serialisation. Members that cannot be dialed over TCP are reached over a libp2p stream (``relay``), with the
same frames and handshake.

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

import hmac
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from hivetrain.averaging.wire import (
    HEADER,
    MAX_DECLARE_META_BYTES,
    MAX_HANDSHAKE_META_BYTES,
    MAX_META_BYTES,
    MAX_PENDING_CONNECTIONS,
    AuthFailed,
    FrameType,
    Link,
    LinkClosed,
    Unreachable,
    describe,
    mac,
    pair_key,
)

__all__ = [
    "HEADER",
    "MAX_META_BYTES",
    "AuthFailed",
    "DataPlaneServer",
    "FrameType",
    "Link",
    "LinkClosed",
    "Pusher",
    "RoundKeys",
    "Unreachable",
    "dial",
    "mac",
    "pair_key",
    "push_record",
    "send_declaration",
    "send_ready",
]

logger = logging.getLogger(__name__)


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
        dial_back: called with a member's peer id when it asks us (over libp2p, ``relay``) to dial it because it
            could not dial us; dials its signed address directly, attaches the link, returns whether that worked.
    """

    round_id: str
    my_id: str
    secret: X25519PrivateKey
    peers: dict[str, bytes]
    attach: Callable[[Link], None]
    dial_back: Callable[[str], bool] | None = None


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
            raise Unreachable(f"cannot connect to {peer_id} at {host}:{port}: {describe(exc)}") from None
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
        raise LinkClosed(f"cannot connect to {host}:{port}: {describe(exc)}") from None
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

    def dial_back(self, round_id: str, peer_id: str) -> bool:
        """Dial member ``peer_id`` of round ``round_id`` on its request (it could not dial us): waits up to
        ``join_wait_s`` for the round to be registered, then calls its ``RoundKeys.dial_back``. Returns False if the
        round or member is unknown or the dial failed; blocks for at most ``join_wait_s + connect_timeout_s`` (the
        round's own connect timeout) seconds."""
        with self._cond:
            self._cond.wait_for(lambda: round_id in self._rounds or self._stop.is_set(), self.join_wait_s)
            keys = self._rounds.get(round_id)
        if keys is None or keys.dial_back is None or peer_id not in keys.peers:
            return False
        return keys.dial_back(peer_id)

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
