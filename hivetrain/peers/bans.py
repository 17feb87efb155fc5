"""One ban list for every part of hivetrain: peers excluded for a while, with exponential backoff for repeat
offenders (the policy of hivemind's ``dht.node.Blacklist``), time injected so that decisions are pure and testable:
every method takes ``now``, in seconds on any clock that all calls share.

Used by the averaging engine (peers that sent bad data are skipped by matchmaking), the coordinator's state follower
(donors that served bad chunks) and SWARM trainers (stage servers that failed a call: ``weight`` > 1 for worse
failures, ``forgive`` after a success).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class BanConfig:
    """How long peers are banned.

    Args:
        ban_base_s: a first offence bans for this long, seconds (unless ``ban`` is given its own ``ban_time_s``).
        backoff_factor: each further offence multiplies the duration by this, >= 1.
        ban_max_s: no ban is longer than this, seconds, >= ban_base_s.
        forget_after_s: an offender whose last ban ended this long ago starts again from a first offence, seconds.
        max_entries: the most peers remembered; past it, forgotten and then soonest-ending entries are dropped
            (bounds memory against peers that mint new ids).
    """

    ban_base_s: float = 60.0
    backoff_factor: float = 2.0
    ban_max_s: float = 3600.0
    forget_after_s: float = 3600.0
    max_entries: int = 100_000

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ban_base_s) and self.ban_base_s > 0):
            raise ValueError(f"ban_base_s must be finite and > 0, got {self.ban_base_s}")
        if not (math.isfinite(self.backoff_factor) and self.backoff_factor >= 1):
            raise ValueError(f"backoff_factor must be finite and >= 1, got {self.backoff_factor}")
        if not (math.isfinite(self.ban_max_s) and self.ban_max_s >= self.ban_base_s):
            raise ValueError(f"ban_max_s ({self.ban_max_s}) must be finite and >= ban_base_s ({self.ban_base_s})")
        if not (math.isfinite(self.forget_after_s) and self.forget_after_s >= 0):
            raise ValueError(f"forget_after_s must be finite and >= 0, got {self.forget_after_s}")
        if self.max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {self.max_entries}")


@dataclass(frozen=True)
class BanRecord:
    """One peer's ban: ``since <= now < until`` means banned; ``offences`` counts bans not yet forgotten."""

    peer_id: str
    reason: str
    since: float
    until: float
    offences: int


class BanList:
    """Peers excluded from matchmaking until a time, with exponential backoff for repeat offenders. Thread-safe."""

    def __init__(self, config: BanConfig | None = None):
        self.config = config or BanConfig()
        self._records: dict[str, BanRecord] = {}
        self._lock = threading.Lock()

    def ban(
        self, peer_id: str, now: float, ban_time_s: float | None = None, reason: str = "", weight: int = 1
    ) -> BanRecord:
        """Ban ``peer_id`` from ``now``; returns the resulting record.

        The duration is ``(ban_time_s or ban_base_s) * backoff_factor ** (offences - 1)``, capped at
        ``ban_max_s``, where ``offences`` counts this ban (``weight`` offences: > 1 for worse failures) and
        earlier ones not yet forgotten or forgiven. Banning a peer that is already banned extends its ban (never
        shortens it).

        Raises:
            ValueError: empty ``peer_id``, non-finite ``now``, ``ban_time_s`` not finite and > 0, or ``weight`` < 1.
        """
        if not peer_id:
            raise ValueError("peer_id must be a non-empty string")
        if not math.isfinite(now):
            raise ValueError(f"now must be finite, got {now}")
        if ban_time_s is not None and not (math.isfinite(ban_time_s) and ban_time_s > 0):
            raise ValueError(f"ban_time_s must be finite and > 0, got {ban_time_s}")
        if weight < 1:
            raise ValueError(f"weight must be >= 1, got {weight}")
        cfg = self.config
        with self._lock:
            old = self._records.get(peer_id)
            offences = weight if old is None or self._forgotten(old, now) else old.offences + weight
            base = ban_time_s if ban_time_s is not None else cfg.ban_base_s
            length = min(base * cfg.backoff_factor ** min(offences - 1, 1000), cfg.ban_max_s)
            until = max(now + length, old.until if old is not None else -math.inf)
            record = BanRecord(peer_id, reason, now, until, offences)
            self._records[peer_id] = record
            if len(self._records) > cfg.max_entries:
                self._shrink(now)
            return record

    def check(self, peer_id: str, now: float) -> tuple[bool, str]:
        """Whether ``peer_id`` is banned at ``now``, and why (for logs and the dashboard)."""
        with self._lock:
            record = self._records.get(peer_id)
        if record is None or now >= record.until:
            return False, "not banned"
        return True, f"banned until {record.until:.1f} (offence {record.offences}: {record.reason or 'no reason'})"

    def is_banned(self, peer_id: str, now: float) -> bool:
        """True if ``peer_id`` is banned at ``now``."""
        return self.check(peer_id, now)[0]

    def forgive(self, peer_id: str) -> None:
        """``peer_id`` behaved (e.g. a call succeeded): its next ban starts from a first offence; a ban in force
        still runs out at its time. No-op if unknown."""
        with self._lock:
            record = self._records.get(peer_id)
            if record is not None:
                self._records[peer_id] = dataclasses.replace(record, offences=0)

    def banned(self, now: float) -> set[str]:
        """Peer IDs banned at ``now``."""
        return {r.peer_id for r in self.active(now)}

    def unban(self, peer_id: str) -> None:
        """Lift a ban and forget the peer's offences (e.g. an operator's decision); no-op if unknown."""
        with self._lock:
            self._records.pop(peer_id, None)

    def active(self, now: float) -> list[BanRecord]:
        """Bans in force at ``now``, soonest-ending first (for dashboards)."""
        with self._lock:
            records = [r for r in self._records.values() if now < r.until]
        return sorted(records, key=lambda r: (r.until, r.peer_id))

    def prune(self, now: float) -> int:
        """Forget peers whose ban ended more than ``forget_after_s`` before ``now``; returns how many."""
        with self._lock:
            stale = [p for p, r in self._records.items() if self._forgotten(r, now)]
            for p in stale:
                del self._records[p]
            return len(stale)

    def __len__(self) -> int:
        return len(self._records)

    def _forgotten(self, record: BanRecord, now: float) -> bool:
        return now >= record.until + self.config.forget_after_s

    def _shrink(self, now: float) -> None:
        for p in [p for p, r in self._records.items() if self._forgotten(r, now)]:
            del self._records[p]
        excess = len(self._records) - self.config.max_entries
        if excess > 0:
            for r in sorted(self._records.values(), key=lambda r: (r.until, r.peer_id))[:excess]:
                del self._records[r.peer_id]
