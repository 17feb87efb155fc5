"""A connection flood against one TCP port, as a stranger with one address would send it (tests, benchmarks, chaos).

Three kinds of connection, each slot re-opened ``reopen_after_s`` after the target closes it:

- idle: connects and sends nothing;
- slowloris: sends a valid frame header one byte every ``drip_interval_s`` (so a timeout restarted by every byte
  would never fire), then keeps dripping bytes of metadata;
- oversized: sends a header claiming ``claimed_meta_num_bytes`` of DECLARE metadata (8 MiB: the most a data port
  takes for a signed group declaration), then ``sent_meta_num_bytes`` of it, then nothing.

One thread, non-blocking sockets. Counters say what the flood did (``stats``). Lifecycle: ``start`` -> ``stop``.
"""

from __future__ import annotations

import errno
import selectors
import socket
import threading
import time
from dataclasses import dataclass

from hivetrain.averaging.wire import HEADER, VERSION, FrameType

__all__ = ["DataPortFlood", "FloodConfig"]

_MAGIC = b"HVA1"


@dataclass(frozen=True)
class FloodConfig:
    """What the flood holds open. Counts are connections; times in seconds; sizes in bytes."""

    num_idle: int = 1000
    num_slowloris: int = 100
    num_oversized: int = 0
    drip_interval_s: float = 0.5
    claimed_meta_num_bytes: int = 8 << 20
    sent_meta_num_bytes: int = 64 << 10
    reopen_after_s: float = 0.1
    source_host: str = ""  # bind this address before connecting ("" = the OS picks)


@dataclass(eq=False)
class _Slot:
    kind: str
    sock: socket.socket | None = None
    pending: bytes = b""  # what a slowloris or oversized slot has still to send
    next_at: float = 0.0  # when to send the next byte (slowloris) or reopen (closed)


class DataPortFlood:
    """Holds ``config``'s connections open to ``host:port`` until ``stop``.

    Attributes:
        stats: "opened" (connections made), "closed_by_target" (EOF or reset seen), "bytes_sent".
    """

    def __init__(self, host: str, port: int, config: FloodConfig = FloodConfig()):
        self.host, self.port, self.config = host, port, config
        kinds = ["idle"] * config.num_idle + ["slowloris"] * config.num_slowloris + ["oversized"] * config.num_oversized
        self._slots = [_Slot(k) for k in kinds]
        self._sel = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = {"opened": 0, "closed_by_target": 0, "bytes_sent": 0}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hivetrain-flood", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop and close every connection; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def open_count(self) -> int:
        return sum(s.sock is not None for s in self._slots)

    def _payload(self, kind: str) -> bytes:
        cfg = self.config
        if kind == "slowloris":  # a HELLO header claiming 4000 bytes of metadata, then metadata bytes forever
            return HEADER.pack(_MAGIC, VERSION, int(FrameType.HELLO), 0, 4000, 0) + b"\x00" * 4000
        if kind == "oversized":
            header = HEADER.pack(_MAGIC, VERSION, int(FrameType.DECLARE), 0, cfg.claimed_meta_num_bytes, 0)
            return header + b"\x00" * min(cfg.sent_meta_num_bytes, cfg.claimed_meta_num_bytes)
        return b""

    def _open(self, slot: _Slot, now: float) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            if self.config.source_host:
                sock.bind((self.config.source_host, 0))
            err = sock.connect_ex((self.host, self.port))
        except OSError:
            err = errno.ECONNREFUSED
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            slot.next_at = now + self.config.reopen_after_s
            return
        slot.sock, slot.pending, slot.next_at = sock, self._payload(slot.kind), now
        self._sel.register(sock, selectors.EVENT_READ, slot)
        self.stats["opened"] += 1

    def _close(self, slot: _Slot, now: float, by_target: bool) -> None:
        if slot.sock is not None:
            self._sel.unregister(slot.sock)
            slot.sock.close()
        slot.sock, slot.next_at = None, now + self.config.reopen_after_s
        self.stats["closed_by_target"] += by_target

    def _send(self, slot: _Slot, now: float) -> None:
        if slot.sock is None or not slot.pending or now < slot.next_at:
            return
        size = 1 if slot.kind == "slowloris" else len(slot.pending)
        try:
            n = slot.sock.send(slot.pending[:size])
        except BlockingIOError:  # still connecting, or the target's window is full: later
            return
        except OSError:
            self._close(slot, now, by_target=True)
            return
        slot.pending = slot.pending[n:]
        self.stats["bytes_sent"] += n
        if slot.kind == "slowloris":
            slot.next_at = now + self.config.drip_interval_s

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                for slot in self._slots:
                    if slot.sock is None and now >= slot.next_at:
                        self._open(slot, now)
                    self._send(slot, now)
                for key, _ in self._sel.select(0.02):
                    slot = key.data
                    try:
                        gone = slot.sock.recv(4096) == b""
                    except BlockingIOError:
                        gone = False
                    except OSError:
                        gone = True
                    if gone:
                        self._close(slot, time.monotonic(), by_target=True)
        finally:
            for slot in self._slots:
                self._close(slot, 0.0, by_target=False)
            self._sel.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m hivetrain.testing.flood HOST PORT --duration-s S [--idle N] [--slowloris N] [--oversized N]``:
    flood for S seconds, then print the counters as one JSON line (the chaos harness runs it in its own process)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--duration-s", type=float, required=True)
    parser.add_argument("--idle", type=int, default=1000)
    parser.add_argument("--slowloris", type=int, default=100)
    parser.add_argument("--oversized", type=int, default=0)
    args = parser.parse_args(argv)
    flood = DataPortFlood(
        args.host,
        args.port,
        FloodConfig(num_idle=args.idle, num_slowloris=args.slowloris, num_oversized=args.oversized),
    )
    flood.start()
    peak, deadline = 0, time.monotonic() + args.duration_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        peak = max(peak, flood.open_count())
    flood.stop()
    print(json.dumps({**flood.stats, "peak_open": peak}), flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
