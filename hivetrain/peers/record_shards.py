"""Peer records in shards, so that no DHT value grows with the swarm (issue 23 item 3).

At level 0 every peer stores its ``PeerRecord`` under one key, ``"{run_id}.peers"`` (``records.peers_key``), and every
heartbeat reads them all: one value of N records (~1.3 KiB each), which passes hivemind's 4 MiB message limit at a few
thousand peers and makes each heartbeat read O(N) bytes. At level ``bits`` > 0 a trainer stores its record under
one of 2^bits shard keys, ``"{run_id}.peers.b{bits}.{shard}"``, the shard being the first ``bits`` bits of
sha256(peer id), so a peer cannot choose its shard (``RecordGuard`` refuses a record stored in another shard).

Who decides the level: the run's coordinator, from the trainers it counts (``decide_shard_bits``: about
``RECORDS_PER_SHARD`` records per shard, with hysteresis so that a swarm near a boundary does not flap), and says it
in its own record (``PeerRecord.record_shard_bits``), which stays under the level-0 key with a few others (the
coordinator, and any peer that knows no level). A trainer takes the level from the coordinator it trusts; without
one it probes its own shard at every level once (``probe_level``): the deepest level where another live trainer
shares its shard is the swarm's. After a level change a trainer also publishes and reads at the previous level for
one record TTL, so no reader misses a record while the swarm moves.

What a trainer reads (``ShardPlan``): the level-0 key, its own shard, and ``extra_shards`` more in rotation each
heartbeat; its view is every shard read within ``max_age_s`` (one record TTL). At level 0 that is the whole swarm,
as before; at level b the view covers ``coverage`` = (shards in view) / 2^b of it, a uniform sample (shards are
hashes of peer ids), which is what the schedule, the quorum rules and the matchmaker then see (README, "The DHT at
scale"). DHT bytes read per heartbeat: at most (2 + ``extra_shards``) x ``RECORDS_PER_SHARD`` x 1.5 records.

Pure functions, one small stateful planner (no I/O), and ``fetch_swarm``, the coordinator's read of every shard.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import hivemind

from hivetrain.peers.records import MAX_SHARD_BITS, PeerRecord, fetch_records_at, live_records, peers_key

__all__ = ["MAX_SHARD_BITS"]  # 1,024 shards: ~65,000 trainers at RECORDS_PER_SHARD
RECORDS_PER_SHARD = 64
RAISE_AT = 1.5  # raise the level when the mean shard holds more than RAISE_AT x RECORDS_PER_SHARD records
LOWER_AT = 0.375  # lower it when the mean shard at the level below would hold fewer than 2 x LOWER_AT x ... records


@functools.lru_cache(maxsize=1 << 16)  # heartbeats, the guard and the simulator ask again for the same ids
def shard_of(peer_id: str, bits: int) -> int:
    """The shard (0 .. 2^bits - 1) of ``peer_id`` at level ``bits``: the first ``bits`` bits of sha256(peer id)."""
    if not 0 <= bits <= MAX_SHARD_BITS:
        raise ValueError(f"shard bits must be in [0, {MAX_SHARD_BITS}], got {bits}")
    if bits == 0:
        return 0
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:2], "big") >> (16 - bits)


def shard_key(run_id: str, bits: int, shard: int) -> str:
    """The DHT key of shard ``shard`` at level ``bits`` (level 0: the run's one peers key)."""
    if bits == 0:
        return peers_key(run_id)
    if not 0 <= shard < 1 << bits:
        raise ValueError(f"shard {shard} is outside level {bits} (0 .. {(1 << bits) - 1})")
    return f"{peers_key(run_id)}.b{bits}.{shard}"


def all_shard_keys(run_id: str) -> dict[str, tuple[int, int]]:
    """Every shard key of the run at levels 1 .. MAX_SHARD_BITS -> (bits, shard): what ``RecordGuard`` recognises."""
    return {shard_key(run_id, b, s): (b, s) for b in range(1, MAX_SHARD_BITS + 1) for s in range(1 << b)}


SKETCH_BITS = 3  # in a sharded swarm, 1 trainer in 2^SKETCH_BITS carries its θ sketch at a given epoch


def carries_sketch(peer_id: str, epoch: int, bits: int) -> bool:
    """Whether our record carries our θ sketch (``PeerRecord.param_sketch``, 2.7 KB of a ~4 KB record) at ``epoch``:
    always at level 0; in a sharded swarm (``bits`` > 0) only for the trainers whose id hashes to ``epoch`` mod
    2^SKETCH_BITS, a different eighth each epoch. A view of 2 shards of ~64 then still holds ~16 sketches of an epoch
    (a joiner's check needs 3, ``diloco/join_check.py``), and a heartbeat reads 1.7 KB per record instead of 4 KB."""
    return bits == 0 or shard_of(peer_id, SKETCH_BITS) == epoch % (1 << SKETCH_BITS)


def decide_shard_bits(num_trainers: int, bits: int, per_shard: int = RECORDS_PER_SHARD) -> tuple[int, str]:
    """The level the swarm should use, given ``num_trainers`` live trainers and the current level ``bits``.

    Up as far as needed at once when the mean shard holds more than ``RAISE_AT`` x ``per_shard`` records (a crowd must
    not sit in an overfull key while the level climbs a step per poll); one level down when the level below would
    hold fewer than ``2 x LOWER_AT`` x ``per_shard`` per shard (a 4x hysteresis band: 96 and 24 records at the
    default), one step per call. Readers follow either way (``ShardPlan`` keeps the previous level for a TTL).
    Returns (bits, reason).
    """
    if num_trainers < 0 or per_shard < 1 or not 0 <= bits <= MAX_SHARD_BITS:
        raise ValueError(f"bad level input: num_trainers={num_trainers}, bits={bits}, per_shard={per_shard}")
    mean = num_trainers / (1 << bits)
    if mean > RAISE_AT * per_shard and bits < MAX_SHARD_BITS:
        up = bits
        while up < MAX_SHARD_BITS and num_trainers / (1 << up) > RAISE_AT * per_shard:
            up += 1
        return up, f"{num_trainers} trainers: {mean:.0f} per shard > {RAISE_AT * per_shard:.0f}"
    if bits > 0 and num_trainers / (1 << (bits - 1)) < 2 * LOWER_AT * per_shard:
        return bits - 1, f"{num_trainers} trainers: {mean:.0f} per shard, {mean * 2:.0f} one level down"
    return bits, f"{num_trainers} trainers: {mean:.0f} per shard"


def level_for(num_trainers: int, per_shard: int = RECORDS_PER_SHARD) -> int:
    """The level ``decide_shard_bits`` raises level 0 to for ``num_trainers`` (the trainer's floor, simulator, docs)."""
    return decide_shard_bits(num_trainers, 0, per_shard)[0]


def probe_level(found: dict[int, Iterable[PeerRecord]], me: str, now: float, stale_after_s: float) -> int:
    """The swarm's level as a peer without a coordinator finds it: ``found`` maps each level probed to the records
    of its own shard there; the deepest level with a live trainer other than ``me`` wins (0 if none)."""
    live = [b for b, records in found.items() if live_records(records, now, stale_after_s, exclude={me}, departed=True)]
    return max(live, default=0)


def newest_per_peer(groups: Iterable[Iterable[PeerRecord]]) -> list[PeerRecord]:
    """One record per peer, its newest (``updated_at``), from several shard reads (a peer may show at two levels
    while the swarm moves); sorted by peer ID."""
    newest: dict[str, PeerRecord] = {}
    for records in groups:
        for r in records:
            if r.peer_id not in newest or r.updated_at > newest[r.peer_id].updated_at:
                newest[r.peer_id] = r
    return sorted(newest.values(), key=lambda r: r.peer_id)


@dataclass
class ShardPlan:
    """Which shard keys a trainer publishes to and reads, and its cached reads (the view).

    Args:
        run_id: the run.
        peer_id: ours (fixes our shard at every level).
        extra_shards: shards read per heartbeat beyond ours, in rotation.
        max_age_s: a shard read longer ago than this leaves the view (one record TTL).

    Not thread-safe: the swarm view calls it under its lock.
    """

    run_id: str
    peer_id: str
    extra_shards: int = 1
    max_age_s: float = 30.0
    bits: int = 0
    previous_bits: int = 0
    changed_at: float = -math.inf
    _cursor: int = 0
    _reads: dict[tuple[int, int], tuple[float, list[PeerRecord]]] = field(default_factory=dict)

    def set_level(self, bits: int, now: float) -> bool:
        """Follow the swarm to level ``bits`` (bounded to [0, MAX_SHARD_BITS]). Returns whether it changed."""
        bits = max(0, min(MAX_SHARD_BITS, int(bits)))
        if bits == self.bits:
            return False
        self.previous_bits, self.bits, self.changed_at = self.bits, bits, now
        return True

    def levels(self, now: float) -> list[int]:
        """The levels we publish at and read: ours, and the previous one for ``max_age_s`` after a change."""
        if self.previous_bits != self.bits and now - self.changed_at <= self.max_age_s:
            return [self.bits, self.previous_bits]
        return [self.bits]

    def publish_keys(self, now: float) -> list[str]:
        """Where our record goes: our shard at each level of ``levels``."""
        return [shard_key(self.run_id, b, shard_of(self.peer_id, b)) for b in self.levels(now)]

    def read_keys(self, now: float) -> list[tuple[int, int]]:
        """(bits, shard) to read this heartbeat: level 0, our shard, and ``extra_shards`` others in rotation, at
        each level of ``levels`` (the previous one: level 0 and our shard only)."""
        out: list[tuple[int, int]] = [(0, 0)]
        for b in self.levels(now):
            if b == 0:
                continue
            own = shard_of(self.peer_id, b)
            out.append((b, own))
            if b != self.bits:
                continue
            others = [s for s in range(1 << b) if s != own]
            for i in range(min(self.extra_shards, len(others))):
                out.append((b, others[(self._cursor + i) % len(others)]))
            self._cursor = (self._cursor + self.extra_shards) % max(1, len(others))
        return out

    def record_read(self, bits: int, shard: int, records: list[PeerRecord], now: float) -> None:
        """Remember what one shard read returned at ``now``."""
        self._reads[(bits, shard)] = (now, list(records))

    def viewed_shards(self, now: float) -> list[tuple[int, int]]:
        """(bits, shard) of level 0, our shard, and every shard in the view: what a fresh read of the view reads."""
        out = {(0, 0), (self.bits, shard_of(self.peer_id, self.bits))}
        out |= {bs for bs, (t, _) in self._reads.items() if now - t <= self.max_age_s}
        return sorted(out)

    def view(self, now: float) -> list[PeerRecord]:
        """Every record of the shards read within ``max_age_s`` at our levels (one per peer: its newest)."""
        levels = set(self.levels(now)) | {0}
        for (b, shard), (read_at, _) in list(self._reads.items()):
            if b not in levels or now - read_at > self.max_age_s:
                del self._reads[(b, shard)]
        return newest_per_peer(records for _, records in self._reads.values())

    def coverage(self, now: float) -> float:
        """The fraction of the swarm's id space whose records the view holds: the union of the shards read within
        ``max_age_s`` at the levels trainers publish at now (ours and, after a change, the previous one, where they
        still publish too). 1.0 at level 0, and while the swarm leaves level 0 (everyone is still there)."""
        levels = self.levels(now)
        if 0 in levels:
            return 1.0
        finest = max(levels)
        covered: set[int] = set()
        for (b, shard), (t, _) in self._reads.items():
            if b in levels and now - t <= self.max_age_s:
                span = 1 << (finest - b)
                covered.update(range(shard * span, (shard + 1) * span))
        return len(covered) / (1 << finest)


def fetch_swarm(dht: hivemind.DHT, run_id: str, levels: Iterable[int], timeout_s: float = 30.0) -> list[PeerRecord]:
    """Every record of the run: the level-0 key and every shard at each of ``levels`` (the coordinator's read; one
    DHT get per shard, in parallel). A record found at two levels counts once (its newest). A shard whose read fails
    is left out (logged); raises nothing."""
    keys = [peers_key(run_id)] + [shard_key(run_id, b, s) for b in sorted(set(levels)) if b for s in range(1 << b)]
    return newest_per_peer(records or () for records in fetch_records_at(dht, keys, run_id, timeout_s).values())
