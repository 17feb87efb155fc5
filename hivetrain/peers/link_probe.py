"""Link checks a volunteer runs against the run's coordinator before it joins (``join-swarm --check``): can the
coordinator dial our data port from outside, and how fast do bytes flow each way.

The coordinator serves ``{run_id}.probe`` on its libp2p host (``LinkProbeServer``); each check is one libp2p stream
that starts with a 2-byte length and a msgpack map (at most ``MAX_REQUEST_BYTES``; p2pd ends a whole stream on EOF,
so requests are length-prefixed and replies are read to a known length):

- ``{"op": "dial", "port": P}``: the coordinator opens a TCP connection to port P **at the IP address the stream came
  from** (never another host, so the probe cannot be aimed at a third party), sends nothing and closes it; it answers
  ``{"ok": bool, "detail": str}``. A stream that came through a relay has no address to dial: ``ok`` False, saying so.
- ``{"op": "down", "bytes": N}``: the coordinator answers ``{"ok": true}`` (or ``ok`` False and why) and sends N
  bytes; the caller times them (download rate).
- ``{"op": "up", "bytes": N}``: the coordinator answers ``{"ok": true}`` (or why not), the caller sends N bytes, and the
  coordinator answers ``{"ok": true, "elapsed_s": t}`` after the last one; the caller times the whole exchange on its
  own clock (upload rate).
- ``{"op": "credit"}``: the coordinator answers ``{"ok": true, "credit": [[peer id, name, witnessed, claimed], ...]}``,
  its top contributors by samples witnessed by their groups' members (``diloco/credit.py``), as many as fit one reply
  (``hivetrain status`` shows them).

Bounds: N <= ``MAX_PROBE_BYTES``; at most ``MAX_CONCURRENT`` probes at once (others are answered ``ok`` False at
once); per caller address (its IP, or its peer id when relayed) at most ``BUDGET_BYTES`` of rate checks and
``BUDGET_DIALS`` dials per ``BUDGET_WINDOW_S`` (a 256-byte request must not buy 16 MiB of the coordinator's uplink
over and over); every read within ``READ_TIMEOUT_S``; a dial within ``DIAL_TIMEOUT_S``. Nothing received is
unpickled.

The rates are those of the path to the coordinator over libp2p (through both p2p daemons): a lower bound on what the
volunteer's direct TCP links to other peers carry, and a fair figure for a home uplink, which is usually the
bottleneck.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import msgpack
from hivemind.p2p import P2P, PeerID

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 256
MAX_PROBE_BYTES = 16 * 2**20
MAX_CONCURRENT = 4
BUDGET_WINDOW_S = 600.0
BUDGET_BYTES = 64 * 2**20  # per caller address (IP, or peer id when relayed) per window: a check takes 8 MiB
BUDGET_DIALS = 16
READ_TIMEOUT_S = 30.0
DIAL_TIMEOUT_S = 3.0
CHUNK_BYTES = 64 * 1024
MAX_REPLY_BYTES = 65_535  # a reply's 2-byte length
MAX_CREDIT_ROWS = 500  # contributors in one "credit" reply (fewer if they do not fit MAX_REPLY_BYTES)
CREDIT_COST_BYTES = 64 * 1024  # a credit request counts this much against the caller's byte budget


def handler_name(run_id: str) -> str:
    return f"{run_id}.probe"


def stream_ip(addr: object) -> str | None:
    """The IP address of a stream's remote multiaddr (``/ip4/1.2.3.4/tcp/...``, ``/ip6/...``), or None (a relayed
    ``/p2p-circuit`` stream, DNS names and anything else: nothing we may dial)."""
    parts = str(addr).split("/")
    if "p2p-circuit" in parts or len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return None
    try:
        return str(ipaddress.ip_address(parts[2]))
    except ValueError:
        return None


async def _read_message(reader: asyncio.StreamReader, max_bytes: int = MAX_REQUEST_BYTES) -> dict[str, Any]:
    """One length-prefixed msgpack map (a request or a reply) of at most ``max_bytes``. Raises ValueError if it is
    not one."""
    size = int.from_bytes(await asyncio.wait_for(reader.readexactly(2), READ_TIMEOUT_S), "big")
    if not 0 < size <= max_bytes:
        raise ValueError(f"a {size}-byte probe request")
    request = msgpack.unpackb(await asyncio.wait_for(reader.readexactly(size), READ_TIMEOUT_S), raw=False)
    if not isinstance(request, dict):
        raise ValueError("a probe request must be a map")
    return request


async def _write_message(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    data = msgpack.packb(message)
    writer.write(len(data).to_bytes(2, "big") + data)
    await writer.drain()


def _probe_bytes(request: dict[str, Any]) -> int:
    n = request.get("bytes")
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= MAX_PROBE_BYTES:
        raise ValueError(f"bytes must be an int in (0, {MAX_PROBE_BYTES}], got {n!r}")
    return n


def _dial(ip: str, port: int) -> tuple[bool, str]:
    try:
        with socket.create_connection((ip, port), timeout=DIAL_TIMEOUT_S):
            return True, f"dialed {ip}:{port}"
    except OSError as exc:
        return False, f"could not dial {ip}:{port}: {exc.strerror or type(exc).__name__}"


class LinkProbeServer:
    """The coordinator's side of the link checks (module docstring). Counters for tests and logs.

    Args:
        credit_table: ``SwarmObserver.credit_table`` (top N contributors as (peer id, name, witnessed, claimed)), for
            the "credit" op; None = refused.
    """

    def __init__(self, credit_table: Callable[[int], list[tuple[str, str, int, int]]] | None = None) -> None:
        self.credit_table = credit_table
        self.served = self.refused = 0
        self._active = 0
        self._spent: dict[str, list[tuple[float, int]]] = {}  # caller -> (monotonic time, bytes; 0 = a dial)

    def _allow(self, caller: str, num_bytes: int) -> str:
        """Why ``caller`` may not run a probe of ``num_bytes`` now ("" = it may; then it is counted)."""
        now = time.monotonic()
        spent = [(t, n) for t, n in self._spent.get(caller, []) if now - t < BUDGET_WINDOW_S]
        if num_bytes == 0 and sum(1 for _, n in spent if n == 0) >= BUDGET_DIALS:
            return f"more than {BUDGET_DIALS} dial checks from {caller} in {BUDGET_WINDOW_S:g} s: try later"
        if sum(n for _, n in spent) + num_bytes > BUDGET_BYTES:
            return (
                f"more than {BUDGET_BYTES >> 20} MiB of rate checks from {caller} in {BUDGET_WINDOW_S:g} s: try later"
            )
        spent.append((now, num_bytes))
        self._spent[caller] = spent
        if len(self._spent) > 10_000:  # forget the oldest callers rather than grow without bound
            for key in list(self._spent)[: len(self._spent) // 2]:
                del self._spent[key]
        return ""

    async def register(self, p2p: P2P, run_id: str) -> None:
        await p2p.add_binary_stream_handler(handler_name(run_id), self._handle)

    async def _handle(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._active >= MAX_CONCURRENT:
            self.refused += 1
            with contextlib.suppress(Exception):
                await _write_message(writer, {"ok": False, "detail": "the coordinator is busy with other checks"})
            writer.close()
            return
        self._active += 1
        try:
            await self._serve(info, reader, writer)
            self.served += 1
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            logger.debug("link probe from %s dropped: %r", info.peer_id, exc)
            with contextlib.suppress(Exception):
                await _write_message(writer, {"ok": False, "detail": f"bad probe request: {exc}"})
        finally:
            self._active -= 1
            writer.close()

    async def _serve(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await _read_message(reader)
        op = request.get("op")
        caller = stream_ip(info.addr) or info.peer_id.to_base58()
        cost = _probe_bytes(request) if op in ("up", "down") else CREDIT_COST_BYTES if op == "credit" else 0
        why = self._allow(caller, cost)
        if why:
            self.refused += 1
            await _write_message(writer, {"ok": False, "detail": why})
            return
        if op == "dial":
            port = request.get("port")
            if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(f"port must be an int in (0, 65536), got {port!r}")
            ip = stream_ip(info.addr)
            if ip is None:
                ok, detail = False, f"your stream came through {info.addr}: there is no address of yours to dial"
            else:
                ok, detail = await asyncio.to_thread(_dial, ip, port)
            await _write_message(writer, {"ok": ok, "detail": detail})
        elif op == "down":
            n, chunk = _probe_bytes(request), bytes(CHUNK_BYTES)
            await _write_message(writer, {"ok": True, "detail": "sending"})
            while n > 0:
                writer.write(chunk[: min(n, CHUNK_BYTES)])
                await writer.drain()
                n -= CHUNK_BYTES
            await asyncio.wait_for(reader.read(1), READ_TIMEOUT_S)  # the caller ends the stream once it has them all
        elif op == "up":
            n = _probe_bytes(request)
            await _write_message(writer, {"ok": True, "detail": "send"})
            started = time.monotonic()
            await asyncio.wait_for(reader.readexactly(n), READ_TIMEOUT_S)
            await _write_message(writer, {"ok": True, "elapsed_s": time.monotonic() - started})
        elif op == "credit":
            if self.credit_table is None:
                await _write_message(writer, {"ok": False, "detail": "this coordinator keeps no credit"})
                return
            await _write_message(writer, credit_reply(self.credit_table(MAX_CREDIT_ROWS)))
        else:
            raise ValueError(f"unknown probe op {op!r}")


async def probe_dial(p2p: P2P, peer_id: str, run_id: str, port: int) -> tuple[bool, str]:
    """Ask ``peer_id`` (the coordinator) to dial ``port`` at our address. Returns (dialed, detail).

    Raises:
        asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError: the stream failed.
    """
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), handler_name(run_id))
    try:
        await _write_message(writer, {"op": "dial", "port": port})
        reply = await _read_message(reader)
        return bool(reply.get("ok")), str(reply.get("detail", ""))[:300]
    finally:
        writer.close()


def credit_reply(rows: list[tuple[str, str, int, int]]) -> dict[str, Any]:
    """The "credit" op's reply: as many of ``rows`` (most credited first) as fit one message (2-byte length)."""
    rows = [[str(p)[:128], str(n)[:64], int(w), int(c)] for p, n, w, c in rows]
    while True:
        reply = {"ok": True, "credit": rows}
        if len(msgpack.packb(reply)) <= MAX_REPLY_BYTES:
            return reply
        rows = rows[: len(rows) * 3 // 4]


async def fetch_credit(p2p: P2P, peer_id: str, run_id: str) -> list[tuple[str, str, int, int]]:
    """The run's top contributors from its coordinator ``peer_id``: (peer id, public name, samples witnessed by the
    members of its groups, samples it claims), most witnessed first (``diloco/credit.py``).

    Raises:
        ValueError: the coordinator refused (saying why) or answered something else than a credit table.
        asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError: the stream failed.
    """
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), handler_name(run_id))
    try:
        await _write_message(writer, {"op": "credit"})
        reply = await _read_message(reader, MAX_REPLY_BYTES)
        if not reply.get("ok"):
            raise ValueError(str(reply.get("detail", "refused"))[:300])
        rows = reply.get("credit")
        if not isinstance(rows, list) or len(rows) > MAX_CREDIT_ROWS:
            raise ValueError("the coordinator's credit table is not a list of rows")
        out = []
        for row in rows:
            if not (isinstance(row, list) and len(row) == 4 and all(isinstance(x, str) for x in row[:2])):
                raise ValueError("a credit row is not [peer id, name, witnessed, claimed]")
            if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in row[2:]):
                raise ValueError("a credit row's samples are not non-negative integers")
            out.append((row[0][:128], row[1][:64], row[2], row[3]))
        return out
    finally:
        writer.close()


async def probe_rate(p2p: P2P, peer_id: str, run_id: str, direction: str, num_bytes: int) -> float:
    """Bytes per second of ``num_bytes`` (<= ``MAX_PROBE_BYTES``) sent "up" to ``peer_id`` or "down" from it.

    Raises:
        ValueError: the coordinator refused the probe (saying why) or ``direction`` is neither.
        asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError: the stream failed.
    """
    if direction not in ("up", "down"):
        raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), handler_name(run_id))
    try:
        await _write_message(writer, {"op": direction, "bytes": num_bytes})
        go = await _read_message(reader)  # the coordinator refuses (saying why) before any byte moves
        if not go.get("ok"):
            raise ValueError(str(go.get("detail", "refused"))[:300])
        started = time.monotonic()
        if direction == "down":
            await asyncio.wait_for(reader.readexactly(num_bytes), READ_TIMEOUT_S)
            return num_bytes / max(time.monotonic() - started, 1e-6)
        chunk, left = bytes(CHUNK_BYTES), num_bytes
        while left > 0:
            writer.write(chunk[: min(left, CHUNK_BYTES)])
            await writer.drain()
            left -= CHUNK_BYTES
        reply = await _read_message(reader)
        if not reply.get("ok"):
            raise ValueError(str(reply.get("detail", "refused"))[:300])
        return num_bytes / max(time.monotonic() - started, 1e-6)  # our clock: the reply's latency counts against us
    finally:
        writer.close()
