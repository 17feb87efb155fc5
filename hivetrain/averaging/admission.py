"""Who may hold a connection to our data port, and for how long: the limits that keep strangers from jamming it.

Anyone can open TCP connections to a data port; on Linux those that send nothing are never accepted (the server's
TCP_DEFER_ACCEPT), the rest count here. Until a connection's first frame is complete it is a *stranger*:
it has proved nothing. Strangers share a small pool, limited per source address and in total, with a total deadline
(from accept, never extended by a byte that arrives) and a budget for the bytes they may make us buffer. A member of a
registered round proves itself in that first frame (its HELLO carries a MAC with the pair key; see ``dataplane``) and
leaves the pool at once, so the pool never holds the capacity round members need:

- A new connection always gets in. If its source (or the whole pool) is full, the *oldest* stranger of that source
  (or of the source holding most strangers) is evicted. A member's HELLO is complete within a round trip of its
  connect, so only an attacker that opens ``max_strangers_per_source`` connections from the member's own source
  within that round trip can push it out (and the dialer then tries again); connections that sit idle or drip bytes
  (slowloris) are the oldest and go first. Refusing newcomers instead would let 32 idle connections lock members
  out for good.
- Past ``max_buffered_bytes`` held by strangers (claimed headers being sent), the stranger holding most is dropped.
- Past ``handshake_timeout_s`` since accept, a connection that has not finished its handshake is dropped.

Sources are grouped by IPv4 address and by IPv6 /64 (one host usually owns a whole /64); streams bridged from libp2p
share one source, "libp2p" (the libp2p daemon applies its own limits). On loopback every peer shares 127.0.0.1, so
there eviction, not the per-source cap, is what keeps members in.

``StrangerPool`` is pure (time injected, no sockets): the server asks it and acts on its answers.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

__all__ = ["DataPlaneLimits", "StrangerPool", "Verdict", "source_key"]


@dataclass(frozen=True)
class DataPlaneLimits:
    """Limits of a data-plane server.

    Attributes:
        max_strangers: connections that have not completed a first frame, in total.
        max_strangers_per_source: of those, from one source (IPv4 address, IPv6 /64, or "libp2p").
        handshake_timeout_s: a connection must complete its handshake (a record push, or HELLO/CHALLENGE/AUTH)
            within this long of being accepted, seconds; bytes arriving do not extend it. 0 = the server's
            ``connect_timeout_s``.
        max_buffered_bytes: bytes of unfinished first frames held for all strangers together.
        max_handshakes_per_member: handshakes in progress at once per (round, member) after a verified HELLO.
        max_queued_records: signed records (pushed declarations and ready entries) waiting to be verified; more are
            dropped (the receiver reads them from the DHT instead).
    """

    max_strangers: int = 128
    max_strangers_per_source: int = 32
    handshake_timeout_s: float = 0.0
    max_buffered_bytes: int = 16 << 20
    max_handshakes_per_member: int = 4
    max_queued_records: int = 64

    def __post_init__(self) -> None:
        if not 1 <= self.max_strangers_per_source <= self.max_strangers:
            raise ValueError(
                f"need 1 <= max_strangers_per_source ({self.max_strangers_per_source}) <= max_strangers "
                f"({self.max_strangers})"
            )
        if not self.handshake_timeout_s >= 0:
            raise ValueError(f"handshake_timeout_s must be >= 0 seconds, got {self.handshake_timeout_s}")
        for name in ("max_buffered_bytes", "max_handshakes_per_member", "max_queued_records"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def source_key(address: object) -> str:
    """The source a connection counts against: its IPv4 address, its IPv6 /64, or "libp2p" for a bridged stream
    (``address`` is then not an (ip, port) pair). An IPv4-mapped IPv6 address counts as the IPv4 address."""
    if not isinstance(address, tuple) or not address or not isinstance(address[0], str):
        return "libp2p"
    try:
        ip = ipaddress.ip_address(address[0].split("%", 1)[0])
    except ValueError:
        return address[0]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


@dataclass(frozen=True)
class Verdict:
    """What the server must do: close ``evict`` (connection ids, possibly including the one asked about) and why."""

    evict: tuple[int, ...] = ()
    reason: str = ""


@dataclass
class _Stranger:
    source: str
    accepted_at: float
    buffered_num_bytes: int = 0


@dataclass
class StrangerPool:
    """The pool of connections whose first frame is not complete. Pure: every call takes ``now`` (seconds, any
    monotonic clock) and returns what to close; the caller closes those and must not report them again.

    Args:
        limits: the server's limits.
        handshake_timeout_s: the total handshake deadline actually used, seconds (> 0).
    """

    limits: DataPlaneLimits
    handshake_timeout_s: float
    _conns: dict[int, _Stranger] = field(default_factory=dict)
    _by_source: dict[str, list[int]] = field(default_factory=dict)  # source -> ids, oldest first
    _buffered_num_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.handshake_timeout_s > 0:
            raise ValueError(f"handshake_timeout_s must be > 0, got {self.handshake_timeout_s}")

    def __len__(self) -> int:
        return len(self._conns)

    def __contains__(self, conn_id: int) -> bool:
        return conn_id in self._conns

    @property
    def buffered_num_bytes(self) -> int:
        return self._buffered_num_bytes

    def count(self, source: str) -> int:
        return len(self._by_source.get(source, ()))

    def admit(self, conn_id: int, source: str, now: float) -> Verdict:
        """A new connection from ``source``: it is admitted; returns whom to evict to make room (oldest first)."""
        assert conn_id not in self._conns, "connection admitted twice"
        evict: list[int] = []
        if self.count(source) >= self.limits.max_strangers_per_source:
            evict.append(self._by_source[source][0])
            reason = f"source {source} holds {self.limits.max_strangers_per_source} unfinished handshakes"
        elif len(self._conns) >= self.limits.max_strangers:
            busiest = max(self._by_source, key=lambda s: (len(self._by_source[s]), s))
            evict.append(self._by_source[busiest][0])
            reason = f"{self.limits.max_strangers} unfinished handshakes; evicting the oldest of {busiest}"
        else:
            reason = ""
        for victim in evict:
            self.remove(victim)
        self._conns[conn_id] = _Stranger(source, now)
        self._by_source.setdefault(source, []).append(conn_id)
        return Verdict(tuple(evict), reason)

    def grow(self, conn_id: int, num_bytes: int) -> Verdict:
        """``conn_id`` now buffers ``num_bytes`` more; past the byte budget, the stranger holding most is evicted."""
        s = self._conns[conn_id]
        s.buffered_num_bytes += num_bytes
        self._buffered_num_bytes += num_bytes
        evict: list[int] = []
        while self._buffered_num_bytes > self.limits.max_buffered_bytes:
            victim = max(self._conns, key=lambda c: (self._conns[c].buffered_num_bytes, c))
            evict.append(victim)
            self.remove(victim)
        reason = f"strangers buffer more than {self.limits.max_buffered_bytes} bytes" if evict else ""
        return Verdict(tuple(evict), reason)

    def expired(self, now: float) -> Verdict:
        """Strangers past the handshake deadline (they are removed)."""
        late = [c for c, s in self._conns.items() if now - s.accepted_at >= self.handshake_timeout_s]
        for c in late:
            self.remove(c)
        return Verdict(tuple(late), f"no complete frame within {self.handshake_timeout_s:g} s" if late else "")

    def next_deadline(self) -> float | None:
        """When the oldest stranger expires (None: the pool is empty)."""
        if not self._conns:
            return None
        return min(s.accepted_at for s in self._conns.values()) + self.handshake_timeout_s

    def remove(self, conn_id: int) -> None:
        """Forget ``conn_id`` (its first frame is complete, or it closed); idempotent."""
        s = self._conns.pop(conn_id, None)
        if s is None:
            return
        self._buffered_num_bytes -= s.buffered_num_bytes
        ids = self._by_source[s.source]
        ids.remove(conn_id)
        if not ids:
            del self._by_source[s.source]
