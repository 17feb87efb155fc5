"""The data-plane wire: fixed-header binary frames over one socket (TCP, or a libp2p stream bridged to a socket pair),
per-pair keys and MACs, and ``Link``, which sends and receives frames with timeouts. ``dataplane`` dials, accepts and
authenticates links; ``links`` runs them in a round.

Frame (little-endian)::

    magic b"HVA1" | version u8 | type u8 | subround u16 | meta num_bytes u32 | payload num_bytes u64
    | meta (msgpack map, <= MAX_META_BYTES) | payload (raw bytes)

The receiver checks magic, version, type and both sizes before reading anything else; payload sizes must equal what
the round expects exactly. Metadata is msgpack (plain types only); nothing is unpickled.

Bounded reads: nothing is allocated for a size a peer claims before the bytes arrive. Metadata grows as it arrives
(``Link.recv_exact``, ``FrameAssembler``) up to a cap per frame type, so a stranger that claims an 8 MiB header and
sends nothing costs nothing; a payload is read into a buffer only once its size equals what the round expects.
"""

from __future__ import annotations

import enum
import fcntl
import hmac
import logging
import socket
import struct
import termios
from collections.abc import Callable, Mapping, Sequence

import msgpack
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

logger = logging.getLogger(__name__)

_MAGIC = b"HVA1"
VERSION = 3  # 2: HAVE and GONE frames and reassigned slices (members that die mid-round are dropped); 3: slices are
# kept across attempts (only a removed member's slices are reduced again)
HEADER = struct.Struct("<4sBBHIQ")
MAX_META_BYTES = 1 << 20
MAX_HANDSHAKE_META_BYTES = 4096
MAX_DECLARE_META_BYTES = 8 << 20
_CHUNK_BYTES = 8 << 20
_GROW_BYTES = 1 << 16  # a read of a claimed (not yet validated) size asks for at most this much at a time


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
    RETRY = 10  # listener -> dialer: the round is not registered here yet, dial again shortly (then closes)
    HAVE = 11  # reducer -> members: whose parts of its slice it holds, with their weights (no payload)
    GONE = 12  # member -> members: the members it now goes on without (no payload)
    WHERE = 13  # member -> a member's data port: will you never join my declaration? (answered by RETRY, then closed)


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
    raises LinkClosed after that long, whatever the frame size. A send counts a byte moving when the kernel's send
    queue shrank (the peer acknowledged data), not only when ``send()`` returned: on a slow uplink the kernel wakes a
    writer only once a large part of its (autotuned, up to 4 MiB) buffer has drained, which took 4-7 s at 2.5 Mbit/s
    with a second flow on the link, and over 10 s on a loaded machine (dev/LOG.md, 2026-12-03 session 39).
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
        views = [memoryview(p).cast("B") for p in payload]
        total = sum(v.nbytes for v in views)
        self._send(frame_bytes(ftype, subround, meta, total))
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
                queued = self._unsent_bytes()
                try:
                    n = self.sock.send(view)
                except TimeoutError:  # socket.timeout: no room for timeout_s; did the queue move meanwhile?
                    now_queued = self._unsent_bytes()
                    if queued is None or now_queued is None or now_queued >= queued:
                        raise
                    continue
                view = view[n:]
                self.bytes_sent += n
        except (OSError, ValueError) as exc:
            raise LinkClosed(f"sending to {self.peer_id}: {describe(exc)}") from None

    def _unsent_bytes(self) -> int | None:
        """Bytes in the socket's send queue not yet acknowledged by the peer (Linux ``SIOCOUTQ``), or None where the
        kernel does not say (then only ``send()`` returning counts as progress)."""
        try:
            return struct.unpack("i", fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        except (OSError, ValueError, AttributeError):
            return None

    def recv_header(
        self, max_meta_bytes: int = MAX_META_BYTES, per_type: Mapping[FrameType, int] | None = None
    ) -> tuple[FrameType, int, dict, int]:
        """Read a frame's header and metadata. Returns (type, subround, meta, payload num_bytes).

        ``per_type`` overrides ``max_meta_bytes`` for the frame types it names. Raises LinkClosed."""
        ftype, subround, meta_len, payload_len = parse_header(self.recv_exact(HEADER.size), self.peer_id)
        limit = per_type.get(ftype, max_meta_bytes) if per_type is not None else max_meta_bytes
        if meta_len > limit:
            raise LinkClosed(f"{self.peer_id} sent {meta_len} bytes of metadata (limit {limit})")
        return ftype, subround, parse_meta(self.recv_exact(meta_len), self.peer_id), payload_len

    def recv_exact(self, num_bytes: int) -> bytearray:
        """Read exactly ``num_bytes`` (a size the peer claimed): the buffer grows as bytes arrive, so a claim that is
        never sent allocates nothing. Raises LinkClosed on EOF, reset or a stall."""
        buf = bytearray()
        try:
            while len(buf) < num_bytes:
                chunk = self.sock.recv(min(num_bytes - len(buf), _GROW_BYTES))
                if not chunk:
                    raise LinkClosed(f"{self.peer_id} closed the connection")
                buf += chunk
                self.bytes_received += len(chunk)
        except (OSError, ValueError) as exc:
            raise LinkClosed(f"receiving from {self.peer_id}: {describe(exc)}") from None
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
            raise LinkClosed(f"receiving from {self.peer_id}: {describe(exc)}") from None

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


def frame_bytes(ftype: FrameType, subround: int, meta: dict, payload_num_bytes: int = 0) -> bytes:
    """A frame's header and metadata (its payload, ``payload_num_bytes`` long, follows)."""
    meta_bytes = msgpack.packb(meta, use_bin_type=True)
    return HEADER.pack(_MAGIC, VERSION, int(ftype), subround, len(meta_bytes), payload_num_bytes) + meta_bytes


def parse_header(raw: bytes | bytearray, who: str) -> tuple[FrameType, int, int, int]:
    """(type, subround, meta num_bytes, payload num_bytes) of a ``HEADER.size``-byte header. Raises LinkClosed."""
    magic, version, ftype, subround, meta_len, payload_len = HEADER.unpack(raw)
    if magic == _MAGIC and version != VERSION:
        raise LinkClosed(
            f"{who} speaks averaging protocol version {version}, we speak {VERSION}: every peer of a run needs the "
            "same hivetrain release (upgrade the older one)"
        )
    if magic != _MAGIC or ftype not in FrameType._value2member_map_:
        raise LinkClosed(f"{who} sent a bad frame header (magic {bytes(magic)!r}, version {version})")
    return FrameType(ftype), subround, meta_len, payload_len


def parse_meta(raw: bytes | bytearray, who: str) -> dict:
    """Decode frame metadata (a msgpack map of plain types; empty = {}). Raises LinkClosed."""
    if not raw:
        return {}
    try:
        meta = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise LinkClosed(f"{who} sent malformed metadata: {exc}") from None
    if not isinstance(meta, dict):
        raise LinkClosed(f"{who} sent metadata that is not a map")
    return meta


class FrameAssembler:
    """Assembles one frame's header and metadata from bytes as they arrive on a non-blocking socket (the data-plane
    server reads strangers this way, on one thread, without a thread per connection).

    ``need()`` says how many bytes to read next: never more than the current frame still lacks, so nothing after the
    frame is consumed, and at most 64 KiB at a time. The buffer holds only what arrived: a claimed size costs nothing
    until it is sent. Not thread-safe.

    Args:
        limits: frame type -> most metadata bytes accepted; types not named take ``default_limit``.
        who: names the peer in errors.
    """

    def __init__(self, limits: Mapping[FrameType, int], who: str, default_limit: int = 0):
        self.limits, self.who, self.default_limit = limits, who, default_limit
        self._buf = bytearray()
        self._header: tuple[FrameType, int, int, int] | None = None

    @property
    def buffered_num_bytes(self) -> int:
        return len(self._buf)

    def need(self) -> int:
        """Bytes to read next (0: the frame is complete)."""
        target = HEADER.size if self._header is None else self._header[2]
        return min(target - len(self._buf), _GROW_BYTES)

    def feed(self, data: bytes) -> bool:
        """Add bytes read from the socket (at most ``need()``); returns whether the frame is complete.

        Raises:
            LinkClosed: a bad header, or metadata larger than the limit of its frame type (refused from the header,
                before a byte of it is read).
        """
        self._buf += data
        if self._header is None and len(self._buf) == HEADER.size:
            ftype, sub, meta_len, payload_len = parse_header(self._buf, self.who)
            limit = self.limits.get(ftype, self.default_limit)
            if meta_len > limit:
                raise LinkClosed(f"{self.who} claimed {meta_len} bytes of {ftype.name} metadata (limit {limit})")
            self._header, self._buf = (ftype, sub, meta_len, payload_len), bytearray()
        return self._header is not None and len(self._buf) == self._header[2]

    def frame(self) -> tuple[FrameType, int, dict, int]:
        """The complete frame: (type, subround, meta, payload num_bytes); resets for the next one. Raises LinkClosed."""
        assert self._header is not None and len(self._buf) == self._header[2], "frame not complete"
        ftype, sub, _, payload_len = self._header
        meta = parse_meta(self._buf, self.who)
        self._header, self._buf = None, bytearray()
        return ftype, sub, meta, payload_len


def describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError | socket.timeout):
        return "no progress within the part timeout (stalled?)"
    return f"{type(exc).__name__}: {exc}"
