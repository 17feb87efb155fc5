"""The averaging data plane's accepting side: ``DataPlaneServer`` takes connections on our data port, applies the
limits that keep strangers from jamming it (``admission``), runs the listener's half of the handshake
(``handshake``) and hands authenticated links to their rounds (``transport``); it also takes one-way pushes of signed
matchmaking records.

Jamming: on Linux the port is a TCP_DEFER_ACCEPT listener: the kernel hands a connection over only once its first
bytes arrive (every honest dialer speaks first), so connections that send nothing, the bulk of a flood, are never
accepted: they take no stranger slot and cost this process nothing, and evicting them cannot make an attacker
re-open them thousands of times a second (``scripts/bench/dataplane_flood.py``: 27,500 connections churned in a run
before, 10,800 after; round time under the flood 1.44x -> 1.15x quiet at 1M floats, dev/LOG.md). Connections that
do send are read by one selector thread, non-blocking, so a dripping one costs a file descriptor and a few hundred
bytes, not a thread; what it may cost beyond that is bounded by ``admission`` (per source, in total, in time, in
buffered bytes). A member proves itself in its first frame and is never counted among strangers.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hivetrain.averaging.admission import DataPlaneLimits, StrangerPool, Verdict, source_key
from hivetrain.averaging.handshake import (
    NONCE_NUM_BYTES,
    Pusher,
    RoundKeys,
    auth_is_genuine,
    challenge_meta,
    hello_is_genuine,
    parse_group,
    parse_hello,
    tune,
    where_answer,
)
from hivetrain.averaging.wire import (
    MAX_DECLARE_META_BYTES,
    MAX_HANDSHAKE_META_BYTES,
    AuthFailed,
    FrameAssembler,
    FrameType,
    Link,
    LinkClosed,
    frame_bytes,
    pair_key,
)

__all__ = ["DataPlaneLimits", "DataPlaneServer", "LinkClosed", "Pusher", "RoundKeys"]  # what the engine and relay use

logger = logging.getLogger(__name__)

ACCEPT_BATCH = 64  # connections accepted per wake-up before pending reads are served again
DONE_KEPT = 16  # round keys we committed that RETRY answers name (``note_committed``): far more than a round's span
_TICK_S = 0.2  # the selector wakes at least this often (shutdown, deadlines)


@dataclass(eq=False)
class _Conn:
    """A connection whose handshake is in progress on the selector thread."""

    sock: socket.socket
    source: str
    accepted_at: float
    frame: FrameAssembler
    stage: str = "first"  # "first": no complete frame yet (a stranger); "auth": HELLO verified, CHALLENGE sent
    keys: RoundKeys | None = None
    sender: str = ""
    key: bytes = b""
    their_nonce: bytes = b""
    my_nonce: bytes = b""
    challenge_at: float = 0.0


class DataPlaneServer:
    """Accepts links for the rounds registered with it, and pushed records.

    Lifecycle: ``start`` -> ``register``/``unregister`` -> ``shutdown``. Threads: one selector thread (accepts,
    reads and answers every handshake), one that hands pushed records to their handlers (they verify signatures).

    Args:
        listen_host: the address to bind (port chosen by the OS).
        connect_timeout_s: the handshake deadline unless ``limits.handshake_timeout_s`` sets one, seconds.
        part_timeout_s: the stall timeout of the links we hand to rounds, seconds.
        buffer_num_bytes: SO_SNDBUF/SO_RCVBUF of data-plane sockets, bytes (0 = OS default).
        join_wait_s: how long a dial-back request waits for its round to be registered here, seconds.
        on_declaration / on_ready: verify and keep a pushed declaration / ready entry (a plain dict); return whether
            it verified. None = refuse that kind.
        limits: the admission limits (``admission.DataPlaneLimits``).
        admits: whether a peer ID is a member of the run (``peers.membership.MemberRoster.admits``); a HELLO from a
            round member that is not is refused, with a logged reason. None = an open run.
    """

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
        limits: DataPlaneLimits | None = None,
        admits: Callable[[str], bool] | None = None,
    ):
        self.listen_host, self.join_wait_s = listen_host, join_wait_s
        self.connect_timeout_s, self.part_timeout_s = connect_timeout_s, part_timeout_s
        self.buffer_num_bytes = buffer_num_bytes
        self.limits = limits or DataPlaneLimits()
        self.admits = admits
        self.handshake_timeout_s = self.limits.handshake_timeout_s or connect_timeout_s
        self._handlers = {FrameType.DECLARE: (on_declaration, "decl"), FrameType.READY: (on_ready, "entry")}
        self._first_limits = {FrameType.HELLO: MAX_HANDSHAKE_META_BYTES, FrameType.WHERE: MAX_HANDSHAKE_META_BYTES}
        if on_ready is not None:
            self._first_limits[FrameType.READY] = MAX_HANDSHAKE_META_BYTES
        if on_declaration is not None:
            self._first_limits[FrameType.DECLARE] = MAX_DECLARE_META_BYTES
        self._rounds: dict[str, tuple[RoundKeys, dict[str, bytes]]] = {}  # round id -> keys, pair keys by sender
        self._done: dict[str, str] = {}  # round key -> declaration we committed it with (``note_committed``)
        self._cond = threading.Condition()  # guards _rounds; wakes dial-back requests waiting for a round
        self.pool = StrangerPool(self.limits, self.handshake_timeout_s)  # selector thread only
        self._conns: dict[int, _Conn] = {}  # fd -> connection in handshake (selector thread only)
        self._member_handshakes: collections.Counter = collections.Counter()  # (round id, sender) -> count
        self._records: queue.Queue = queue.Queue(self.limits.max_queued_records)
        self._incoming: collections.deque[socket.socket] = collections.deque()  # from accept_connection
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sock: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.port = 0
        self.refused: collections.Counter = collections.Counter()  # why connections were dropped (tests, logs)

    @property
    def rejected(self) -> int:
        """Connections and records refused so far, for any reason."""
        return sum(self.refused.values())

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> int:
        """Bind and listen; returns the port. Raises OSError if the address cannot be bound."""
        family = socket.AF_INET6 if ":" in self.listen_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.buffer_num_bytes:  # set before listen so accepted sockets inherit a large window
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.buffer_num_bytes)
        if hasattr(socket, "TCP_DEFER_ACCEPT"):  # Linux: a connection that sends nothing is never accepted (module doc)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, max(1, math.ceil(self.handshake_timeout_s)))
        sock.bind((self.listen_host, 0))
        sock.listen(1024)  # accepted eagerly: a full backlog would drop members' SYNs for a second
        sock.setblocking(False)
        self._sock, self.port = sock, sock.getsockname()[1]
        self._sel.register(sock, selectors.EVENT_READ, "listen")
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        for target, name in ((self._loop, "hivetrain-avg-accept"), (self._record_loop, "hivetrain-avg-records")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self.port

    def register(self, keys: RoundKeys) -> None:
        with self._cond:
            self._rounds[keys.round_id] = (keys, {})
            self._cond.notify_all()

    def unregister(self, round_id: str) -> None:
        with self._cond:
            self._rounds.pop(round_id, None)

    def note_committed(self, round_key: str, declaration: str, committed: bool = True) -> None:
        """Our averager committed ``round_key`` in the group of declaration ``declaration`` (two members or more):
        until it averages at that round key again (``committed=False``, at the start of each call: a caller may
        average twice at one epoch), we say so to whoever dials us for it (``handshake.where_answer``). The last
        ``DONE_KEPT`` round keys are kept."""
        with self._cond:
            self._done.pop(round_key, None)
            if committed:
                self._done[round_key] = declaration
            while len(self._done) > DONE_KEPT:
                del self._done[next(iter(self._done))]

    def _where(self, meta: dict) -> dict:
        """Our RETRY meta for the declaration a HELLO or WHERE names (``handshake.where_answer``)."""
        with self._cond:
            groups = [keys.group for keys, _ in self._rounds.values()]
            return where_answer(parse_group(meta), groups, dict(self._done))

    def dial_back(self, round_id: str, peer_id: str) -> bool:
        """Dial member ``peer_id`` of round ``round_id`` on its request (it could not dial us): waits up to
        ``join_wait_s`` for the round to be registered, then calls its ``RoundKeys.dial_back``. Returns False if the
        round or member is unknown or the dial failed; blocks for at most ``join_wait_s + connect_timeout_s`` (the
        round's own connect timeout) seconds."""
        with self._cond:
            self._cond.wait_for(lambda: round_id in self._rounds or self._stop.is_set(), self.join_wait_s)
            keys = self._rounds[round_id][0] if round_id in self._rounds else None
        if keys is None or keys.dial_back is None or peer_id not in keys.peers:
            return False
        return keys.dial_back(peer_id)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop accepting and drop handshakes in progress; idempotent. Links already handed to rounds are closed by
        their rounds."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._wake()
        for t in self._threads:
            t.join(timeout_s)

    def accept_connection(self, conn: socket.socket) -> None:
        """Serve a connection that arrived another way (a libp2p stream bridged to a socket by ``relay``; any
        thread): it is admitted and authenticated exactly like one accepted on our TCP port, as source "libp2p"."""
        if self._stop.is_set():
            self.refused["shut down"] += 1
            conn.close()
            return
        self._incoming.append(conn)
        self._wake()

    # ---- the selector thread ------------------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"w")
        except OSError:  # buffer full (it will wake anyway) or closed at shutdown
            pass

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                deadline = self.pool.next_deadline()
                timeout_s = _TICK_S if deadline is None else min(_TICK_S, max(0.0, deadline - time.monotonic()))
                accept = False
                for key, _ in self._sel.select(timeout_s):
                    if key.data == "listen":
                        accept = True
                    elif key.data == "wake":
                        self._on_wake()
                    elif self._conns.get(key.fd) is key.data:  # not dropped by an earlier event of this batch
                        self._read(key.data)
                if accept:  # after the reads: a member whose HELLO arrived is served before newcomers can evict it
                    self._accept_batch()
                self._expire(time.monotonic())
        finally:
            for c in list(self._conns.values()):
                self._drop(c, "shut down")
            for s in (self._sock, self._wake_r, self._wake_w):
                if s is not None:
                    s.close()
            self._sel.close()

    def _on_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while self._incoming:
            self._admit(self._incoming.popleft(), "libp2p")

    def _accept_batch(self) -> None:
        assert self._sock is not None
        for _ in range(ACCEPT_BATCH):
            try:
                conn, address = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # e.g. out of file descriptors: try again at the next tick
                logger.warning("data port accept failed: %s", exc)
                return
            self._admit(conn, source_key(address))

    def _admit(self, sock: socket.socket, source: str) -> None:
        now = time.monotonic()
        sock.setblocking(False)
        c = _Conn(sock, source, now, FrameAssembler(self._first_limits, f"a stranger from {source}"))
        self._conns[sock.fileno()] = c
        self._sel.register(sock, selectors.EVENT_READ, c)
        verdict = self.pool.admit(sock.fileno(), source, now)
        for fd in verdict.evict:  # a last read first: one whose first frame is already here is served, not evicted
            victim = self._conns.get(fd)
            if victim is not None and not self._read(victim):
                self._drop(victim, "evicted")
        if verdict.evict:
            logger.debug("data port: %s", verdict.reason)

    def _act(self, verdict: Verdict, why: str) -> None:
        for c in [self._conns[fd] for fd in verdict.evict if fd in self._conns]:
            self._drop(c, why)

    def _expire(self, now: float) -> None:
        self._act(self.pool.expired(now), "handshake deadline")
        for c in [c for c in self._conns.values() if c.stage == "auth"]:
            if now - c.accepted_at >= self.handshake_timeout_s:
                self._drop(c, "handshake deadline")

    def _read(self, c: _Conn) -> bool:
        """Read what has arrived (never past the current frame) and act on a complete frame. Returns whether the
        connection is settled (its frame was handled, or it was dropped); False: it would block, frame incomplete."""
        fd = c.sock.fileno()
        while True:
            try:
                data = c.sock.recv(c.frame.need())
            except BlockingIOError:
                return False
            except OSError as exc:
                self._drop(c, f"error: {type(exc).__name__}")
                return True
            if not data:
                self._drop(c, "closed early")
                return True
            if fd in self.pool:
                verdict = self.pool.grow(fd, len(data))
                self._act(verdict, "buffer budget")
                if fd in verdict.evict:
                    return True
            try:
                if c.frame.feed(data):
                    self._on_frame(c, *c.frame.frame())
                    return True
            except (LinkClosed, AuthFailed) as exc:
                self._drop(c, type(exc).__name__, str(exc))
                return True
            except Exception:  # noqa: BLE001 - a bug in one handshake must not stop the data port
                logger.exception("data-plane handshake with %s crashed", c.source)
                self._drop(c, "crashed")
                return True

    def _on_frame(self, c: _Conn, ftype: FrameType, _sub: int, meta: dict, payload_len: int) -> None:
        self.pool.remove(c.sock.fileno())
        if c.stage == "auth":
            self._on_auth(c, ftype, meta, payload_len)
            return
        handler, field = self._handlers.get(ftype, (None, ""))
        if handler is not None and not payload_len:
            try:
                self._records.put_nowait((handler, meta.get(field)))
            except queue.Full:
                self.refused["record queue full"] += 1
            self._close(c)
        elif ftype == FrameType.HELLO and not payload_len:
            self._on_hello(c, meta)
        elif ftype == FrameType.WHERE and not payload_len:
            self._send(c, FrameType.RETRY, self._where(meta))
            self._close(c)
        else:
            raise AuthFailed(f"{c.source} opened with a {ftype.name} frame")

    def _on_hello(self, c: _Conn, meta: dict) -> None:
        round_id, sender, receiver, nonce, proof = parse_hello(meta)
        with self._cond:
            keys, pair_keys = self._rounds.get(round_id, (None, {}))
        if keys is None:  # not learned of it yet, or a stranger: nothing is held for a round we cannot verify
            self._send(c, FrameType.RETRY, self._where(meta))  # {} unless we will never join it
            self._drop(c, "unknown round")
            return
        if receiver != keys.my_id or sender not in keys.peers:
            raise AuthFailed(f"{sender} is not a member of round {round_id[:12]}")
        key = pair_keys.get(sender)
        if key is None:  # an X25519 exchange: computed once per member and round, not per stranger's attempt
            key = pair_keys[sender] = pair_key(keys.secret, keys.peers[sender], round_id, keys.my_id, sender)
        if not hello_is_genuine(key, round_id, sender, receiver, nonce, proof):
            raise AuthFailed(f"a HELLO claiming to be {sender} without its round key")
        if self.admits is not None and not self.admits(sender):
            logger.warning("refusing a data-plane link from %s: not a member of this run (admission)", sender)
            self._drop(c, "not a member")
            return
        if self._member_handshakes[(round_id, sender)] >= self.limits.max_handshakes_per_member:
            raise AuthFailed(f"{sender} has {self.limits.max_handshakes_per_member} handshakes in progress")
        self._member_handshakes[(round_id, sender)] += 1
        c.stage, c.keys, c.sender, c.key, c.their_nonce = "auth", keys, sender, key, nonce
        c.frame = FrameAssembler({FrameType.AUTH: MAX_HANDSHAKE_META_BYTES}, sender)
        c.my_nonce = os.urandom(NONCE_NUM_BYTES)
        c.challenge_at = time.monotonic()
        self._send(c, FrameType.CHALLENGE, challenge_meta(key, nonce, c.my_nonce))

    def _on_auth(self, c: _Conn, ftype: FrameType, meta: dict, payload_len: int) -> None:
        if ftype != FrameType.AUTH or payload_len or not auth_is_genuine(c.key, meta, c.my_nonce, c.their_nonce):
            raise AuthFailed(f"{c.sender} failed to prove its round key")
        assert c.keys is not None
        self._forget(c)
        tune(c.sock, self.buffer_num_bytes)
        link = Link(c.sock, c.sender, c.key, self.part_timeout_s)  # blocking from here, with the stall timeout
        link.rtt_s = time.monotonic() - c.challenge_at
        c.keys.attach(link)

    def _send(self, c: _Conn, ftype: FrameType, meta: dict) -> None:
        """Send a small frame on a non-blocking socket (it fits in an empty send buffer). Raises LinkClosed."""
        data = frame_bytes(ftype, 0, meta)
        try:
            if c.sock.send(data) != len(data):
                raise LinkClosed(f"{c.source}: the send buffer of a new connection is full")
        except OSError as exc:
            raise LinkClosed(f"{c.source}: {type(exc).__name__}") from None

    def _forget(self, c: _Conn) -> None:
        fd = c.sock.fileno()
        if self._conns.pop(fd, None) is None:
            return
        self.pool.remove(fd)
        self._sel.unregister(c.sock)
        if c.stage == "auth" and c.keys is not None:
            key = (c.keys.round_id, c.sender)
            self._member_handshakes[key] -= 1
            if self._member_handshakes[key] <= 0:
                del self._member_handshakes[key]

    def _close(self, c: _Conn) -> None:
        self._forget(c)
        c.sock.close()

    def _drop(self, c: _Conn, why: str, detail: str = "") -> None:
        self.refused[why] += 1
        logger.debug("dropping a data-plane connection from %s: %s %s", c.source, why, detail)
        self._close(c)

    # ---- pushed records -----------------------------------------------------------------------------------------
    def _record_loop(self) -> None:
        """Hand pushed records to their handlers (signature checks take ~0.1 ms-1 ms: not on the selector thread)."""
        while not self._stop.is_set():
            try:
                handler, raw = self._records.get(timeout=_TICK_S)
            except queue.Empty:
                continue
            try:
                ok = handler(raw)
            except Exception:  # noqa: BLE001 - a handler bug must not stop the data port
                logger.exception("a pushed-record handler failed")
                ok = False
            if not ok:
                self.refused["record did not verify"] += 1
