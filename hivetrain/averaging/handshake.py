"""The data-plane handshake that authenticates a link between two members of a round, the dialing side of it, and
one-way pushes of signed matchmaking records. ``dataplane.DataPlaneServer`` is the accepting side.

Authentication (per round, per pair of members):
    Every member's RSA-signed ready entry (see ``matchmaking``) carries a fresh X25519 public key. The pair key is
    ``HKDF-SHA256(X25519(own secret, peer public), salt=round id, info=both peer ids)``. The dialer sends HELLO
    (round id, both ids, a nonce, and a MAC of those with the pair key), the listener answers CHALLENGE (its nonce,
    HMAC of both nonces), the dialer answers AUTH (HMAC). The HELLO's MAC lets the listener tell a member from a
    stranger from the first frame, before it answers anything, so strangers never hold the capacity members need
    (``admission``); the nonces then prove each side holds the secret of its signed entry *now* (a recorded HELLO
    replayed by an eavesdropper gets a CHALLENGE it cannot answer).

    A listener that has not learned of the round yet (members learn of a group at slightly different times) answers
    RETRY and closes; the dialer dials again with a growing pause, for up to ``join_wait_s``. Nothing is held open
    for a round the listener cannot verify. A connection closed before its CHALLENGE (e.g. evicted by a flood of
    strangers) is retried the same way.

    Two declarations of one round key (two leaders that did not see each other's in time) list some members twice;
    each member joins one. The HELLO names the dialer's declaration (``RoundKeys.group``: round key, declaration
    id), and a RETRY says when the listener will never join it (``where_answer``): it is in another declaration of
    that round key now, or it committed that round key already and went on. The dialer then stops at once
    (``Elsewhere``) instead of dialing for ``join_wait_s``: chaos ``pause-twice`` lost 11 s that way, while the
    listener's group had committed in 0.1 s, and fell 4 epochs behind (dev/LOG.md, 2026-12-01). A member waiting to
    be dialed asks the same question with a WHERE frame (``ask_where``). Neither answer is authenticated (the
    listener cannot verify a round it does not hold): a forged one only fails a link, which dropping the connection
    could do as well.

    Protected: a stranger, or a peer of another round, cannot open a link into a round, and cannot replay an old
    handshake (fresh nonces, fresh keys per call). Commit votes are MACed with the pair key, so a vote cannot be
    forged. Not protected: frames after the handshake are neither encrypted nor MACed, so an attacker on the path
    who can hijack TCP could alter parts (tampering with results is caught by the commit hash: members would hold
    different bytes and abort). Use a VPN (e.g. WireGuard) where confidentiality matters.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from hivetrain.averaging.wire import (
    MAX_HANDSHAKE_META_BYTES,
    AuthFailed,
    FrameType,
    Link,
    LinkClosed,
    Unreachable,
    describe,
    mac,
    pair_key,
)

logger = logging.getLogger(__name__)

NONCE_NUM_BYTES = 16
RETRY_FIRST_PAUSE_S = 0.02  # first pause before dialing again after RETRY or an early close, doubled each time
RETRY_MAX_PAUSE_S = 0.25


def tune(sock: socket.socket, buffer_num_bytes: int) -> None:
    """TCP_NODELAY and the socket buffers (``buffer_num_bytes``; 0 = OS default) of a data-plane socket."""
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
        group: (round key, declaration id) of the declaration this round belongs to (a two-stage round's row,
            column, confirm and fetch rounds share their declaration's); ("", "") = none (moshpit and gossip
            rounds): a RETRY then never says ``Elsewhere``.
    """

    round_id: str
    my_id: str
    secret: X25519PrivateKey
    peers: dict[str, bytes]
    attach: Callable[[Link], None]
    dial_back: Callable[[str], bool] | None = None
    group: tuple[str, str] = ("", "")


# ---- the three messages (both sides) --------------------------------------------------------------------------------
def hello_meta(
    key: bytes, round_id: str, sender: str, receiver: str, nonce: bytes, group: tuple[str, str] = ("", "")
) -> dict:
    proof = mac(key, b"hello", round_id.encode(), sender.encode(), receiver.encode(), nonce)
    meta = {"round_id": round_id, "sender": sender, "receiver": receiver, "nonce": nonce, "mac": proof}
    if group[0]:
        meta["group"] = list(group)
    return meta


def parse_group(meta: dict) -> tuple[str, str] | None:
    """The (round key, declaration id) a HELLO or WHERE frame names, or None if it names none or a malformed one."""
    group = meta.get("group")
    if isinstance(group, list) and len(group) == 2 and all(isinstance(g, str) and 0 < len(g) <= 64 for g in group):
        return group[0], group[1]
    return None


def where_answer(asked: tuple[str, str] | None, registered: Sequence[tuple[str, str]], done: dict[str, str]) -> dict:
    """The listener's RETRY meta for a dialer of declaration ``asked`` (pure): {"done": id} if we committed its round
    key already (``done``: round key -> the declaration we committed it with), {"elsewhere": id} if a round we are
    registered in now (``registered``: their groups) belongs to another declaration of that round key, else {}."""
    if asked is None:
        return {}
    round_key, declaration = asked
    if round_key in done:
        return {"done": done[round_key][:12]}
    other = next((d for k, d in registered if k == round_key and d != declaration), None)
    return {"elsewhere": other[:12]} if other is not None else {}


def parse_hello(meta: dict) -> tuple[str, str, str, bytes, bytes]:
    """(round id, sender, receiver, nonce, mac) of a HELLO. Raises AuthFailed if a field is missing or mistyped."""
    round_id, sender, receiver, nonce, proof = (meta.get(k) for k in ("round_id", "sender", "receiver", "nonce", "mac"))
    if not (isinstance(round_id, str) and isinstance(sender, str) and isinstance(receiver, str)):
        raise AuthFailed("malformed HELLO")
    if not (isinstance(nonce, bytes) and len(nonce) == NONCE_NUM_BYTES and isinstance(proof, bytes)):
        raise AuthFailed("malformed HELLO")
    return round_id, sender, receiver, nonce, proof


def hello_is_genuine(key: bytes, round_id: str, sender: str, receiver: str, nonce: bytes, proof: bytes) -> bool:
    return hmac.compare_digest(proof, mac(key, b"hello", round_id.encode(), sender.encode(), receiver.encode(), nonce))


def challenge_meta(key: bytes, their_nonce: bytes, my_nonce: bytes) -> dict:
    return {"nonce": my_nonce, "mac": mac(key, b"resp", their_nonce, my_nonce)}


def auth_is_genuine(key: bytes, meta: dict, my_nonce: bytes, their_nonce: bytes) -> bool:
    proof = meta.get("mac")
    return isinstance(proof, bytes) and hmac.compare_digest(proof, mac(key, b"init", my_nonce, their_nonce))


class _Retry(Exception):
    """The listener answered RETRY, or closed before its CHALLENGE: dial again after a pause."""


class Elsewhere(LinkClosed):
    """The member will never join this round: it is in another declaration of the round key, or it committed the
    round key already (``went_on``: its group's result is the epoch's, ``RoundFailed.closed_without_us``)."""

    def __init__(self, message: str, went_on: bool):
        super().__init__(message)
        self.went_on = went_on


def _elsewhere(peer_id: str, round_key: str, meta: dict) -> Elsewhere | None:
    """The ``Elsewhere`` a RETRY's meta (``where_answer``) says, or None."""
    done, other = meta.get("done"), meta.get("elsewhere")
    if isinstance(done, str):
        return Elsewhere(f"{peer_id} committed round key {round_key} without us (group {done[:12]})", went_on=True)
    if isinstance(other, str):
        return Elsewhere(f"{peer_id} is in another group of round key {round_key} ({other[:12]})", went_on=False)
    return None


# ---- dialing --------------------------------------------------------------------------------------------------------
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
    open_socket: Callable[[], socket.socket] | None = None,
) -> Link:
    """Connect to member ``peer_id`` and authenticate both ways. Each attempt takes at most ``connect_timeout_s``;
    while the member answers RETRY (it has not learned of the round) or closes before its CHALLENGE (it is flooded,
    or not in this round), we dial again with a growing pause, for up to ``connect_timeout_s + join_wait_s`` in all.

    ``open_socket``: opens an already connected socket to use instead of dialing ``host:port`` (a libp2p stream
    bridged to a socket by ``relay.P2PFallback``); called once per attempt, its sockets are closed on failure.

    Raises:
        Unreachable: no TCP connection to ``host:port`` (the caller may try the libp2p fallback).
        Elsewhere: its RETRY said it will never join this round (module docstring); raised at once.
        LinkClosed: it kept closing the connection or answering RETRY (e.g. it is not in this round).
        AuthFailed: it did not prove it holds the secret of its signed entry.
    """
    give_up_at = time.monotonic() + connect_timeout_s + join_wait_s
    pause_s = RETRY_FIRST_PAUSE_S
    key = pair_key(keys.secret, keys.peers[peer_id], keys.round_id, keys.my_id, peer_id)
    while True:
        timeout_s = max(0.05, min(connect_timeout_s, give_up_at - time.monotonic()))
        if open_socket is not None:
            sock = open_socket()
        else:
            try:
                sock = socket.create_connection((host, port), timeout=timeout_s)
            except OSError as exc:
                raise Unreachable(f"cannot connect to {peer_id} at {host}:{port}: {describe(exc)}") from None
        try:
            return _authenticate(sock, keys, peer_id, key, timeout_s, part_timeout_s, buffer_num_bytes)
        except _Retry as exc:
            if time.monotonic() + pause_s >= give_up_at:
                raise LinkClosed(f"{peer_id} did not take our link for round {keys.round_id[:12]}: {exc}") from None
            logger.debug("dialing %s again in %.2f s: %s", peer_id, pause_s, exc)
            time.sleep(pause_s)
            pause_s = min(2 * pause_s, RETRY_MAX_PAUSE_S)


def _authenticate(
    sock: socket.socket, keys: RoundKeys, peer_id: str, key: bytes, timeout_s: float, part_timeout_s: float,
    buffer_num_bytes: int,
) -> Link:  # fmt: skip
    tune(sock, buffer_num_bytes)
    link = Link(sock, peer_id, key, timeout_s)
    try:
        nonce = os.urandom(NONCE_NUM_BYTES)
        sent_at = time.monotonic()
        link.send_frame(FrameType.HELLO, 0, hello_meta(key, keys.round_id, keys.my_id, peer_id, nonce, keys.group))
        try:
            ftype, _, meta, payload_len = link.recv_header(MAX_HANDSHAKE_META_BYTES)
        except LinkClosed as exc:
            raise _Retry(str(exc)) from None
        if ftype == FrameType.RETRY:
            elsewhere = _elsewhere(peer_id, keys.group[0], meta) if keys.group[0] else None
            if elsewhere is not None:
                raise elsewhere
            raise _Retry("it has not learned of the round yet")
        link.rtt_s = time.monotonic() - sent_at
        their_nonce = meta.get("nonce")
        if ftype != FrameType.CHALLENGE or payload_len or not isinstance(their_nonce, bytes):
            raise AuthFailed(f"{peer_id} answered the handshake with a malformed {ftype.name}")
        proof = meta.get("mac")
        genuine = isinstance(proof, bytes) and hmac.compare_digest(proof, mac(key, b"resp", nonce, their_nonce))
        if len(their_nonce) != NONCE_NUM_BYTES or not genuine:
            raise AuthFailed(f"{peer_id} failed to prove its round key")
        link.send_frame(FrameType.AUTH, 0, {"mac": mac(key, b"init", their_nonce, nonce)})
    except BaseException:
        link.close()
        raise
    link.set_timeout(part_timeout_s)
    link.bytes_sent = link.bytes_received = 0
    return link


def ask_where(host: str, port: int, peer_id: str, group: tuple[str, str], timeout_s: float) -> Elsewhere | None:
    """Ask member ``peer_id``'s data port whether it will never join our declaration ``group`` (round key,
    declaration id): the WHERE frame, answered like a HELLO's RETRY (module docstring). Used by a member waiting for
    a link that ``peer_id`` is to dial. Returns the ``Elsewhere`` it says, or None: it may still come, or it could
    not be asked (no connection, no answer within ``timeout_s`` seconds; nothing is retried)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            link = Link(sock, peer_id, b"", timeout_s)
            link.send_frame(FrameType.WHERE, 0, {"group": list(group)})
            ftype, _, meta, payload_len = link.recv_header(MAX_HANDSHAKE_META_BYTES)
    except (OSError, ConnectionError):
        return None
    return _elsewhere(peer_id, group[0], meta) if ftype == FrameType.RETRY and not payload_len else None


# ---- one-way pushes -------------------------------------------------------------------------------------------------
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
