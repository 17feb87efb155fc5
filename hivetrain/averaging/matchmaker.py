"""The I/O side of matchmaking: announce our entry, read the DHT, push records between data ports, declare.

``Matchmaker.match`` runs the pure ``matchmaking.decide`` (the protocol is described there) on every DHT read and
every pushed record until a group is joined or the attempt fails.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from hivetrain.averaging.base import ExpectedPeers
from hivetrain.averaging.decl_store import (
    INLINE_BYTES,
    DeclarationFetcher,
    DeclarationRef,
    chunk_key,
    declaration_bytes,
    group_record_model,
    split_declaration,
)
from hivetrain.averaging.entry_shards import entry_key, entry_levels, read_keys
from hivetrain.averaging.group_records import (
    GroupDeclaration,
    ReadyEntry,
    make_round_id,
    sign_declaration,
    sign_entry,
)
from hivetrain.averaging.matchmaking import ClosedBy, Decision, EpochGroups, decide, rival_groups
from hivetrain.averaging.record_book import RecordBook
from hivetrain.averaging.transport import refuses_connections
from hivetrain.peers.records import parse_signed

logger = logging.getLogger(__name__)

FAST_POLL_S = 0.02  # DHT polling period while a declaration is imminent, seconds
FAST_LEAD_S = 1.0  # a prospective leader polls fast for this long after announcing, seconds
HINT_FANOUT = 2  # we push our entry to this many of the smallest members of our previous group
EPOCH_GROUPS_WAIT_S = 1.0  # how long ``accept`` waits for the epoch's declarations read during the round, seconds
ANNOUNCE_DELAY_S = 0.05  # a follower that told its likely leader uses the DHT only if not matched by then, seconds
LATENCY_SAMPLES = 16  # DHT operations whose durations ``dht_latency_s`` looks at
LATENCY_FACTOR = 3.0  # windows and graces last at least this many DHT latencies (a store, a read, and slack)
WITHDRAW_AFTER_S = 1e-3  # a withdrawn entry expires this much later than the entry (a next one comes later), seconds


class _Read:
    """The gets of one matchmaking read (the round key's and its entry shards'): done when all are."""

    def __init__(self, futures: list):
        self.futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self.futures)


class Matchmaker(RecordBook):
    """Runs ``decide`` on what the DHT and our data port bring: announce, read, push, declare.

    A DHT read takes ~5-20 ms on loopback (more under load), so the records also travel directly between data ports
    (``push(kind, raw, targets)``, e.g. ``dataplane.Pusher``; all pushes are best effort):

    - a follower pushes its signed entry to the peer it expects to lead: before its first DHT read, the smallest
      members of its previous group (the same peers usually average every epoch), then whoever ``decide`` names;
      the leader so declares ("full", "complete") when the last member arrives, not at its next DHT poll;
    - the leader pushes its signed declaration to the followers down a tree (``group_records.relay_targets``: each
      member passes it on to at most ``DECLARATION_FANOUT`` others, so nobody uploads it O(group) times);
    - each push and each finished DHT read wakes ``match``, which decides from the union of its last DHT read and
      the pushed records at once; DHT reads (per poll, one get of the round key and one of each entry shard) run in the
      background.

    DHT reads are spaced by their size: after a read of B bytes the next starts no sooner than B /
    ``read_bytes_per_s`` (``averaging.matchmaking_read_kib_s``; the poll interval when longer). A read gets every
    ready peer's entry: at 1,000 peers ~1.6 MB, and a 0.1 s poll would take 16 MB/s of a waiting peer's downlink.
    Pushes carry what is urgent; a read gap delays only a follower whose pushed declaration was lost (its grace grows
    by the gap: ``grace_s``) or whose expected leader changed since its last read.

    Pushed records are verified (signatures) before use, bounded in number, and only add what the DHT would show
    anyway; the DHT stays the source of truth for latecomers and for pushes that were lost. Someone flooding our
    port with records of other round keys can evict pushed records (we then wait for the DHT), not forge any.
    One per GroupAverager; ``match`` from one thread at a time, ``offer``/``offer_entry`` from any thread.
    """

    def __init__(
        self, node, prefix: str, *, poll_interval_s: float, declare_grace_s: float, push=None, admits=None,
        dht_clock=get_dht_time, read_bytes_per_s: float = float("inf"), record_levels=lambda: (0,),
    ):  # fmt: skip
        """``dht_clock()``: the DHT's time, seconds (hivemind's ``get_dht_time``): entries' announce times, windows and
        declarations use it. Tests freeze it to prove that a group closed without waiting out its window.
        ``read_bytes_per_s``: the reads' budget, bytes per second (class docstring; inf = none), > 0.
        ``record_levels()``: the swarm's peer-record shard levels (``SwarmView.shard_levels``), asked at every
        announce and read: our entries go in the shards one level coarser (``entry_shards``)."""
        super().__init__(prefix, push=push, admits=admits, peer_id=lambda: node.peer_id)
        self.read_bytes_per_s, self._read_bytes = read_bytes_per_s, 0  # _read_bytes: size of our last read
        self.node, self.dht_clock, self.record_levels = node, dht_clock, record_levels
        self.poll_interval_s, self.declare_grace_s = poll_interval_s, declare_grace_s
        self._hints: tuple[ReadyEntry, ...] = ()  # our previous group, by peer id
        self._latencies: deque[float] = deque(maxlen=LATENCY_SAMPLES)  # recent DHT read / store durations, seconds
        self._fetcher = DeclarationFetcher(getattr(node, "dht", None), self._found)  # large declarations' chunks

    def _key(self, round_key: str) -> str:
        return f"{self.prefix}.{round_key}.mm"

    def _subkey(self, kind: bytes) -> bytes:
        return self.node.owner_marker + b"|" + kind  # still an owner marker: every DHT node checks the signature

    @property
    def dht_latency_s(self) -> float:
        """The slowest of our recent DHT reads and stores (the last ``LATENCY_SAMPLES``), seconds; 0 before any.

        Windows and graces scale with it (``window_s``, ``grace_s``): on a loaded machine a DHT operation takes
        seconds, and a fixed 2 s window then closes before a peer that announced in time is visible (hivemind #676
        asks for the same: deadlines that adapt to the measured latency)."""
        with self._lock:
            return max(self._latencies, default=0.0)

    def _measured(self, seconds: float) -> None:
        with self._lock:
            self._latencies.append(seconds)

    def window_s(self, matchmaking_time_s: float) -> float:
        """Our window: ``matchmaking_time_s``, or ``LATENCY_FACTOR`` x the DHT latency when that is longer, seconds."""
        return max(matchmaking_time_s, LATENCY_FACTOR * self.dht_latency_s)

    def grace_s(self) -> float:
        """How long a follower waits for its leader's declaration past the group's close: ``declare_grace_s``, or
        ``LATENCY_FACTOR`` x the DHT latency when that is longer (the leader reads our entry through the DHT when a
        push is lost), plus how much longer than the poll interval our reads are spaced (``read_gap_s``), seconds."""
        extra = max(0.0, self.read_gap_s() - self.poll_interval_s)
        return max(self.declare_grace_s, LATENCY_FACTOR * self.dht_latency_s) + extra

    def read_gap_s(self) -> float:
        """The least time between the starts of two matchmaking reads that the read budget allows after our last
        read: its size over ``read_bytes_per_s``, seconds (0 before any read)."""
        with self._lock:
            return self._read_bytes / self.read_bytes_per_s

    def make_entry(
        self,
        round_key: str,
        session: bytes,
        host: str,
        port: int,
        kx_public: bytes,
        wait_s: float,
        window_s: float | None = None,
        upload_mbps: float | None = None,
    ) -> ReadyEntry:
        """Our signed entry: ready now, waiting at most ``wait_s`` seconds for a group; the window it opens closes
        after ``window_s`` seconds (at most ``wait_s``; None = ``wait_s``); ``upload_mbps``: our upload rate, Mbit/s
        (None = unknown), which sizes the slice we reduce."""
        now = self.dht_clock()
        window_s = wait_s if window_s is None else min(window_s, wait_s)
        entry = ReadyEntry(
            peer_id=self.node.peer_id,
            round_key=round_key,
            session=session,
            host=host,
            port=port,
            kx_public=kx_public,
            announced_at=now,
            deadline=now + wait_s,
            window_closes_at=now + window_s,
            public_key=self.node.identity.private_key.get_public_key().to_bytes(),
            upload_mbps=upload_mbps,
        )
        return sign_entry(self.prefix, entry, self.node.identity.private_key)

    def announce(self, entry: ReadyEntry, ttl_s: float):
        """Start storing our entry until ``entry.announced_at + ttl_s``; returns the DHT's future (True if stored).

        ``ttl_s`` (the round timeout) exceeds any wait (``matchmaking_time_s``), so the entry outlives its deadline.
        The expiration grows with ``announced_at``: a DHT node keeps, per subkey, the value that expires last, so our
        newer entry (or withdrawal) always replaces an older one, whatever each one's wait.
        """
        return self._store_entry(entry, entry.announced_at + ttl_s)

    def withdraw(self, entry: ReadyEntry, ttl_s: float):
        """Replace our stored entry by a copy whose deadline has passed, which every peer's ``decide`` finds stale, so
        that nobody groups with a session we stopped waiting with (a peer told "late" would otherwise be declared
        into the next group by its old entry, and that group would fail). It expires WITHDRAW_AFTER_S later than the
        entry (a DHT node keeps the value that expires last), and earlier than our next entry. Not awaited.
        Returns the DHT's future."""
        gone = entry.model_copy(update={"deadline": 0.0, "window_closes_at": 0.0})
        gone = sign_entry(self.prefix, gone, self.node.identity.private_key)
        return self._store_entry(gone, entry.announced_at + ttl_s + WITHDRAW_AFTER_S)

    def _store_entry(self, entry: ReadyEntry, expiration: float):
        """Store ``entry`` at each entry level in use (``entry_shards``); returns the current level's future."""
        key = self._key(entry.round_key)
        levels = entry_levels(self.record_levels())
        return [self._store(entry, expiration, b"ready", entry_key(key, entry.peer_id, b)) for b in levels][0]

    def _store(self, record, expiration: float, kind: bytes, key: str = ""):
        """Start storing ``record`` under ``key`` (its round key's DHT key) and our ``kind`` subkey; a declaration
        larger than ``decl_store.INLINE_BYTES`` goes in chunks and a reference to them. Returns the DHT's future."""
        key = key or self._key(record.round_key)
        if isinstance(record, GroupDeclaration) and len(declaration_bytes(record)) > INLINE_BYTES:
            ref, chunks = split_declaration(record)
            for c in chunks:
                self._store(c, expiration, b"chunk", chunk_key(key, ref.round_id, c.index))
            record = ref
        return self.node.dht.store(key, record.model_dump(), expiration, subkey=self._subkey(kind), return_future=True)

    def declare(
        self, me: ReadyEntry, members: tuple[ReadyEntry, ...], closed_by: ClosedBy, ttl_s: float
    ) -> GroupDeclaration:
        """Sign the declaration of ``members`` (we are its leader), push it to them, store it for ``ttl_s`` seconds.

        The signed ``reason`` tells latecomers what the group means for them: "full" leaves room for a next group;
        "window" (also for a group closed early because every expected peer was ready) is the epoch's group.
        """
        decl = GroupDeclaration(
            leader=me.peer_id,
            round_key=me.round_key,
            round_id=make_round_id(self.prefix, me.round_key, members),
            members=members,
            declared_at=self.dht_clock(),
            reason="full" if closed_by == "full" else "window",
        )
        decl = sign_declaration(self.prefix, decl, self.node.identity.private_key)
        self._remember(decl)  # consumed entries for a retry, DHT or not; followers hear it at once (``_remember``)
        self._store(decl, decl.declared_at + ttl_s, b"group")  # for latecomers and followers the push missed
        return decl

    # ---- DHT reads ----------------------------------------------------------------------------------------------
    def _start_read(self, round_key: str) -> _Read:
        """Start one matchmaking read: gets of the round key and of its entry shards (``entry_shards.read_keys``)."""
        keys = read_keys(self._key(round_key), entry_levels(self.record_levels()))
        futures = [self.node.dht.get(k, latest=True, return_future=True) for k in keys]
        for future in futures:
            future.add_done_callback(lambda _: self._wake.set())
        return _Read(futures)

    def _collect(self, read: _Read, round_key: str, timeout_s: float) -> list[ReadyEntry]:
        """The verified entries of a DHT read; its verified declarations are remembered (forged or malformed records
        are dropped; a failed or unfinished get of the read gives nothing)."""
        items: list[tuple[object, object]] = []
        deadline = time.monotonic() + timeout_s
        for future in read.futures:
            try:
                found = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - a failed poll is retried at the next interval
                logger.debug("DHT read failed: %s", exc)
                continue
            items += list(found.value.items()) if found is not None and isinstance(found.value, dict) else []
        size = sum(len(MSGPackSerializer.dumps(getattr(item, "value", None))) for _, item in items)
        with self._lock:
            self._read_bytes = size
        entries = []
        for subkey, item in items:
            kind = subkey.rsplit(b"|", 1)[-1] if isinstance(subkey, bytes) else b""
            value = getattr(item, "value", None)
            schema, id_field = {b"ready": (ReadyEntry, "peer_id"), b"group": (GroupDeclaration, "leader")}.get(
                kind, (None, "")
            )
            schema = group_record_model(value) if schema is GroupDeclaration else schema
            record = parse_signed(subkey, value, schema, id_field) if schema else None
            if record is None or record.round_key != round_key or not self._admitted(record):
                continue
            if isinstance(record, DeclarationRef):  # a large declaration: its chunks are read once, in the background
                if not any(d.round_id == record.round_id for d in self._merge(round_key, [])[1]):
                    self._fetcher.want(self._key(round_key), record)
                continue
            if not self._verify(record):
                logger.warning("dropping an invalid %s by %s", schema.__name__, getattr(record, id_field))
            elif isinstance(record, ReadyEntry):
                entries.append(record)
            else:
                self._remember(record)
        return entries

    def read(self, round_key: str) -> tuple[list[ReadyEntry], list[GroupDeclaration]]:
        """One blocking DHT read merged with what was pushed to us: verified entries and declarations."""
        timeout_s = max(5.0, 10 * self.poll_interval_s)
        return self._merge(round_key, self._collect(self._start_read(round_key), round_key, timeout_s))

    def epoch_groups(self, decl: GroupDeclaration, ttl_s: float, **rules: int) -> Callable[[], EpochGroups]:
        """What a member's ``accept`` ranks its round against (``matchmaking.EpochGroups``): ``decl``'s members and the
        other live declarations of its round key (``ttl_s``, ``rules``: ``rival_groups``' ``declaration_ttl_s``,
        ``tolerant_rows`` and ``min_group_size``). A DHT read starts now, while the round runs; the returned function
        ranks what it found with what we already knew, waiting at most ``EPOCH_GROUPS_WAIT_S`` for a read still in
        flight (a slow read must not hold our vote past the round's commit timeout)."""
        future = self._start_read(decl.round_key)

        def read() -> EpochGroups:
            until = time.monotonic() + EPOCH_GROUPS_WAIT_S
            entries = self._collect(future, decl.round_key, EPOCH_GROUPS_WAIT_S)
            concurrent.futures.wait(self._fetcher.pending(decl.round_key), max(0.0, until - time.monotonic()))
            entries, declarations = self._merge(decl.round_key, entries)
            rivals = rival_groups(decl, entries, declarations, self.dht_clock(), ttl_s, **rules)
            return EpochGroups(frozenset(decl.member_ids()), rivals)

        return read

    # ---- matching -----------------------------------------------------------------------------------------------
    def _push_entry(self, me: ReadyEntry, targets: Sequence[ReadyEntry], pushed_to: set[str]) -> None:
        targets = [t for t in targets if t.peer_id not in pushed_to and t.peer_id != me.peer_id]
        if self.push is not None and targets:
            pushed_to.update(t.peer_id for t in targets)
            self.push("ready", me.model_dump(), targets)

    def match(
        self,
        me: ReadyEntry,
        *,
        target_group_size: int,
        min_group_size: int,
        ttl_s: float,
        deadline_monotonic: float,
        banned: frozenset[str] = frozenset(),
        expected: ExpectedPeers = frozenset(),
        patience_s: float = 0.0,
        tolerant_rows: int = 0,
    ) -> tuple[Decision, str]:
        """Announce ``me``, then decide on every push and DHT read until a decision other than "wait" (or the call
        deadline, ``time.monotonic()``).

        Args:
            me: our signed entry (``make_entry``).
            target_group_size, min_group_size, banned, expected, patience_s, tolerant_rows: as in ``decide``;
                ``expected`` may be a function, asked before every decision (``base.Averager.average``). Raises
                TypeError if it returns anything but a frozenset of peer ids.
            ttl_s: our entry and declaration live this long in the DHT, seconds; also ``decide``'s
                ``declaration_ttl_s`` (the round timeout: a declaration older than that is over).
            deadline_monotonic: the call gives up at this ``time.monotonic()``.

        Returns:
            (decision, reason); ``decision.action`` is "joined" (with its declaration) or a failure action.
            A "timeout" is reported as ("no_group", ...).
        """
        # A follower of a previous group tells its likely leader directly, and uses the DHT (store its entry, read)
        # only if that formed no group within ANNOUNCE_DELAY_S: a matched entry is consumed at once, nobody needs it.
        # Leaders and newcomers (no smaller peer to tell) announce and read at once, so a newcomer finds the leader
        # in the DHT and the leader finds the newcomer. This takes two DHT operations per follower off every round.
        pushed_to: set[str] = set()
        hinted = [h for h in self._hints if h.peer_id < me.peer_id and h.peer_id not in banned][:HINT_FANOUT]
        self._push_entry(me, hinted, pushed_to)
        announce_at = time.monotonic() + (ANNOUNCE_DELAY_S if hinted else 0.0)
        stored, stored_at = None, 0.0
        read_timeout_s = max(5.0, 10 * self.poll_interval_s, 2 * self.dht_latency_s)  # a loaded DHT answers late
        dht_entries: list[ReadyEntry] = []
        read, read_started, next_read_at = None, 0.0, announce_at
        # leaders whose declaration we waited for past a grace and whose data port then refused a connection: gone
        # (SIGKILLed, crashed). ``decide`` waits for a live expected leader until our deadline (issue 22); a dead one
        # whose record is still fresh held its 8 followers for the whole 40 s round (issue 23, 9-peer chaos run).
        gone: set[str] = set()
        waiting_on: dict[str, float | None] = {}  # leader -> when we began waiting for its declaration; None: probed
        read_started_dht = seen_as_of_dht = 0.0  # DHT time the pending / the last collected read started
        while True:
            now_m = time.monotonic()
            if read is not None and (read.done() or now_m > read_started + read_timeout_s):
                self._measured(now_m - read_started)
                dht_entries = self._collect(read, me.round_key, 0.0)
                read, seen_as_of_dht = None, read_started_dht
            if announce_at is not None and now_m >= announce_at:
                stored, announce_at = self.announce(me, ttl_s), None  # we read meanwhile: our entry is in our view
                stored_at = now_m
                stored.add_done_callback(lambda _: self._wake.set())
            if stored is not None and stored.done():
                self._measured(now_m - stored_at)
                if not stored.exception() and not stored.result():
                    logger.warning("no DHT node accepted our ready entry for %s", me.round_key)
                stored = None
            self._wake.clear()  # anything pushed from here on wakes the wait below
            entries, decls = self._merge(me.round_key, dht_entries)
            expected_now = expected() if callable(expected) else expected
            if not isinstance(expected_now, frozenset):
                raise TypeError(f"expected peers must be a frozenset of peer ids, got {type(expected_now).__name__}")
            decision = decide(
                me,
                entries,
                decls,
                self.dht_clock(),
                target_group_size=target_group_size,
                min_group_size=min_group_size,
                declare_grace_s=self.grace_s(),
                declaration_ttl_s=ttl_s,
                banned=banned | gone,
                expected=expected_now,
                patience_s=patience_s,
                tolerant_rows=tolerant_rows,
            )
            # A window closes on what the DHT showed after it closed: a view read before the deadline (a slow DHT under
            # load) may lack peers that announced in time, and would leave them out of the group (or split it).
            # ("full" and "complete" wait for nobody else: no re-read needed.)
            stale = decision.action == "declare" and decision.closed_by == "window"
            stale = stale and seen_as_of_dht < decision.closed_at
            if decision.action == "declare" and not stale:
                # decide() would have returned "joined" had a smaller leader's declaration listed us; two leaders
                # that did not see each other yield two groups whose overlap fails at the handshake and retries.
                assert decision.closed_by is not None
                declared = self.declare(me, decision.members, decision.closed_by, ttl_s)
                self._hints = declared.members
                joined = Decision("joined", decision.reason, declaration=declared, closed_by=decision.closed_by)
                return joined, decision.reason
            if decision.action == "joined" and decision.declaration is not None:
                self._hints = decision.declaration.members
                return decision, decision.reason
            # A verdict that the epoch's group formed without us stands only on a DHT view read after we announced:
            # declarations remembered from earlier attempts lack their members' newer entries that may show them over.
            unproven = decision.action in ("late", "not_in_group") and seen_as_of_dht < me.announced_at
            if decision.action not in ("wait", "declare") and not unproven:
                if announce_at is None:
                    self.withdraw(me, ttl_s)
                return decision, decision.reason
            leader = decision.leader
            if leader is not None and leader.peer_id != me.peer_id:
                self._push_entry(me, [leader], pushed_to)
                if decision.closed_by is not None:  # its group is closed: only its declaration is missing
                    since = waiting_on.setdefault(leader.peer_id, now_m)
                    probe = since is not None and now_m - since > self.grace_s()
                    if probe:
                        waiting_on[leader.peer_id] = None  # once per leader: a firewall's timeout costs 1 s
                    if probe and refuses_connections(leader.host, leader.port, 1.0):
                        logger.warning("leader %s is gone (its data port refuses connections)", leader.peer_id)
                        gone.add(leader.peer_id)
                        continue
            # Poll fast when a declaration is imminent (followers whose window closed or group filled up), and during
            # the first second while we lead (the group may fill up any moment) or have not told our leader yet. A
            # follower that finds the group complete does not: its leader may expect more peers than it does.
            just_started = self.dht_clock() - me.announced_at < FAST_LEAD_S
            imminent = decision.closed_by in ("window", "full") or (
                just_started and (leader is None or leader.peer_id == me.peer_id or leader.peer_id not in pushed_to)
            )
            interval_s = min(self.poll_interval_s, FAST_POLL_S) if imminent else self.poll_interval_s
            interval_s = max(interval_s, self.read_gap_s())  # the read budget (class docstring)
            if read is None and (now_m >= next_read_at or stale or unproven):
                read_started_dht = self.dht_clock()
                read, read_started, next_read_at = self._start_read(me.round_key), now_m, now_m + interval_s
            if now_m >= deadline_monotonic:
                if announce_at is None:
                    self.withdraw(me, ttl_s)
                return Decision("no_group", "call deadline reached during matchmaking"), "deadline"
            wake_at = read_started + read_timeout_s if read is not None else next_read_at
            wake_at = wake_at if announce_at is None else min(wake_at, announce_at)
            self._wake.wait(max(0.0, min(wake_at, deadline_monotonic) - now_m))
