"""Agreeing on averaging groups over the DHT: signed readiness, a deterministic leader, a signed declaration.

Protocol for one round key (e.g. ``"e12"`` = epoch 12), all records under the one DHT key ``{prefix}.{round_key}.mm``
(one DHT get per poll reads both kinds):

1. Every peer that calls ``average`` announces a ``ReadyEntry`` (DHT subkey = its owner marker + ``b"|ready"``, so
   every DHT node checks hivemind's RSA signature). The entry also carries its own RSA signature (``signature``
   over ``signed_bytes``) so that it can be embedded in someone else's declaration and still be checked offline.
   It holds the data-plane address, a fresh session id and a fresh X25519 public key (``kx_public``) used to
   authenticate data-plane connections (see ``dataplane``).
2. Candidates are the announced, live, unbanned entries not yet consumed by a declaration. The group deadline is
   the earliest candidate ``deadline`` (the first ready peer's arrival + ``matchmaking_time_s``): peers that call
   ``average`` within ``matchmaking_time_s`` of the first one are grouped together. When ``target_group_size``
   candidates are ready the group is declared at once ("full").
3. The leader is the smallest peer id among the candidates. It stores a ``GroupDeclaration`` (signed: subkey = its
   owner marker + ``b"|group"``) listing the members' signed entries. Followers accept only a declaration that
   lists their own current session, signed by its leader, whose embedded entries all verify; with several, the one
   with the smallest leader id wins (the rare case of two leaders that did not see each other; if members then disagree,
   the data-plane handshake or the commit vote fails the round and the callers retry).
4. A peer not listed in a group whose window closed fails at once: ``late`` (it closed before we announced) or
   ``not_in_group`` (its leader did not see us in time); a follower whose leader declares nothing fails with
   ``no_group`` after the group deadline + ``declare_grace_s``.

The same signed records also travel directly between data ports (``Matchmaker``): followers push their entry to
the expected leader, the leader pushes its declaration to the followers. They only speed things up (a group forms in
one round trip instead of several DHT polls); what is decided is the same.

The records themselves, their signatures and checks live in ``group_records`` (re-exported here).

``decide`` is a pure function of what a peer has read and ``now`` (DHT time, seconds): tests drive it without a
DHT. ``Matchmaker`` does the I/O. Clocks of peers are assumed synchronised within ~1 s (NTP), as hivemind does.
Nothing read from the DHT is unpickled: values are msgpack dicts validated with pydantic; forged ones are dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from hivemind.utils import get_dht_time

from hivetrain.averaging.group_records import (
    MAX_MEMBERS,
    GroupDeclaration,
    ReadyEntry,
    make_round_id,
    sign_declaration,
    sign_entry,
    signed_bytes,
    verify_declaration,
    verify_entry,
)
from hivetrain.peers.records import parse_signed

__all__ = [
    "MAX_MEMBERS",
    "Decision",
    "GroupDeclaration",
    "Matchmaker",
    "ReadyEntry",
    "decide",
    "make_round_id",
    "sign_declaration",
    "sign_entry",
    "signed_bytes",
    "verify_declaration",
    "verify_entry",
]

logger = logging.getLogger(__name__)

MAX_PUSHED = 64  # pushed declarations remembered per round key, and round keys remembered
MAX_PUSHED_ENTRIES = 1024  # pushed ready entries remembered per round key (the latest per peer)
MAX_VERIFIED = 4096  # signature checks remembered
FAST_POLL_S = 0.02  # DHT polling period while a declaration is imminent, seconds
FAST_LEAD_S = 1.0  # a prospective leader polls fast for this long after announcing, seconds
HINT_FANOUT = 2  # we push our entry to this many of the smallest members of our previous group
ANNOUNCE_DELAY_S = 0.05  # a follower that told its likely leader uses the DHT only if not matched by then, seconds


@dataclass(frozen=True)
class Decision:
    """What a peer does next. ``action``: "wait", "declare" (``members`` to declare), "joined" (``declaration``),
    or a failure: "late", "not_in_group", "no_group", "too_small". ``leader``: while waiting, the entry of the peer
    expected to declare our group (ourselves when we lead)."""

    action: Literal["wait", "declare", "joined", "late", "not_in_group", "no_group", "too_small"]
    reason: str
    members: tuple[ReadyEntry, ...] = ()
    declaration: GroupDeclaration | None = None
    leader: ReadyEntry | None = None


def decide(
    me: ReadyEntry,
    entries: Iterable[ReadyEntry],
    declarations: Iterable[GroupDeclaration],
    now: float,
    *,
    target_group_size: int,
    min_group_size: int,
    declare_grace_s: float,
    banned: frozenset[str] = frozenset(),
) -> Decision:
    """Decide the next matchmaking step of ``me`` from what it has read (pure: no I/O, no clock).

    Args:
        me: our own entry (our current session).
        entries: verified ready entries read from the DHT (ours may or may not be among them).
        declarations: verified group declarations of this round key.
        now: current DHT time, seconds.
        target_group_size: declare as soon as this many candidates are ready.
        min_group_size: a group smaller than this is not formed ("too_small").
        declare_grace_s: how long past the group deadline a follower waits for its leader's declaration, seconds.
        banned: peer ids we refuse to group with.

    Returns:
        The decision and a human-readable reason.
    """
    declarations = list(declarations)
    mine = sorted((d for d in declarations if d.includes(me)), key=lambda d: d.leader)
    if mine:
        return Decision("joined", f"declared by {mine[0].leader} ({len(mine[0].members)} members)", declaration=mine[0])
    consumed = {(m.peer_id, m.session) for d in declarations for m in d.members}
    # A window closed without us: after we announced (its leader did not see us in time), or before (we are late
    # for a group that formed). Either way the epoch's group formed without us: fail fast so the caller resyncs.
    # ("full" groups leave room for a next group; a lone peer's window is no group to be late for: its caller may
    # refuse to commit alone and retry with us.)
    for d in declarations:
        if d.reason != "window" or me.peer_id in d.member_ids():
            continue
        if d.declared_at >= me.announced_at:
            return Decision("not_in_group", f"{d.leader} closed its window at {d.declared_at:.2f} without us")
        if len(d.members) > 1:
            return Decision("late", f"group of {d.leader} closed at {d.declared_at:.2f} before we announced")
    by_id: dict[str, ReadyEntry] = {}
    for e in [*entries, me]:
        if e.round_key != me.round_key or e.peer_id in banned or (e.peer_id, e.session) in consumed:
            continue
        if e.peer_id != me.peer_id and e.deadline + declare_grace_s < now:
            continue  # its owner gave up waiting: stale
        if e.peer_id == me.peer_id and e.session != me.session:
            continue
        if e.peer_id not in by_id or e.announced_at > by_id[e.peer_id].announced_at:
            by_id[e.peer_id] = e
    candidates = sorted(by_id.values(), key=lambda e: e.peer_id)
    group_deadline = min(e.deadline for e in candidates)
    if len(candidates) >= target_group_size:
        group, why = tuple(candidates[:target_group_size]), "full"
    elif now >= group_deadline:
        group, why = tuple(candidates), "window"
    else:
        role = "leading" if candidates[0].peer_id == me.peer_id else "following"
        why = f"{role}: {len(candidates)} ready, window closes in {group_deadline - now:.2f}s"
        return Decision("wait", why, leader=candidates[0])
    if group[0].peer_id == me.peer_id:
        if len(group) < min_group_size:
            return Decision("too_small", f"{len(group)} ready peers, min_group_size is {min_group_size}")
        return Decision("declare", f"leader of {len(group)} ({why})", members=group)
    if now < group_deadline + declare_grace_s:
        return Decision("wait", f"waiting for leader {group[0].peer_id}'s declaration", leader=group[0])
    others = [d for d in declarations if d.declared_at >= me.announced_at]
    if others:
        return Decision("not_in_group", f"{len(others)} group(s) declared without us")
    return Decision("no_group", f"leader {group[0].peer_id} declared nothing within {declare_grace_s}s")


class Matchmaker:
    """Runs ``decide`` on what the DHT and our data port bring: announce, read, push, declare.

    A DHT read takes ~5-20 ms on loopback (more under load), so the records also travel directly between data ports
    (``push(kind, raw, targets)``, e.g. ``dataplane.Pusher``; all pushes are best effort):

    - a follower pushes its signed entry to the peer it expects to lead: before its first DHT read, the smallest
      members of its previous group (the same peers usually average every epoch), then whoever ``decide`` names;
      the leader so declares "full" when the last member arrives, not at its next DHT poll;
    - the leader pushes its signed declaration to the followers;
    - each push and each finished DHT read wakes ``match``, which decides from the union of its last DHT read and
      the pushed records at once; DHT reads (one get of one key per poll) run in the background.

    Pushed records are verified (signatures) before use, bounded in number, and only add what the DHT would show
    anyway; the DHT stays the source of truth for latecomers and for pushes that were lost. Someone flooding our
    port with records of other round keys can evict pushed records (we then wait for the DHT), not forge any.
    One per GroupAverager; ``match`` from one thread at a time, ``offer``/``offer_entry`` from any thread.
    """

    def __init__(self, node, prefix: str, *, poll_interval_s: float, declare_grace_s: float, push=None):
        self.node, self.prefix, self.push = node, prefix, push
        self.poll_interval_s, self.declare_grace_s = poll_interval_s, declare_grace_s
        self._decls: dict[str, list[GroupDeclaration]] = {}  # round key -> verified declarations: ours, pushed, read
        self._entries: dict[str, dict[str, ReadyEntry]] = {}  # round key -> peer id -> latest pushed entry
        self._verified: dict[object, bool] = {}  # record -> whether its signatures verify
        self._hints: tuple[ReadyEntry, ...] = ()  # our previous group, by peer id
        self._lock = threading.Lock()
        self._wake = threading.Event()

    def _key(self, round_key: str) -> str:
        return f"{self.prefix}.{round_key}.mm"

    def _subkey(self, kind: bytes) -> bytes:
        return self.node.owner_marker + b"|" + kind  # still an owner marker: every DHT node checks the signature

    def make_entry(
        self, round_key: str, session: bytes, host: str, port: int, kx_public: bytes, wait_s: float
    ) -> ReadyEntry:
        """Our signed entry: ready now, waiting at most ``wait_s`` seconds for a group."""
        now = get_dht_time()
        entry = ReadyEntry(
            peer_id=self.node.peer_id,
            round_key=round_key,
            session=session,
            host=host,
            port=port,
            kx_public=kx_public,
            announced_at=now,
            deadline=now + wait_s,
            public_key=self.node.identity.private_key.get_public_key().to_bytes(),
        )
        return sign_entry(self.prefix, entry, self.node.identity.private_key)

    def announce(self, entry: ReadyEntry, ttl_s: float):
        """Start storing our entry until ``entry.deadline + ttl_s``; returns the DHT's future (True if stored)."""
        return self.node.dht.store(
            self._key(entry.round_key),
            entry.model_dump(),
            entry.deadline + ttl_s,
            subkey=self._subkey(b"ready"),
            return_future=True,
        )

    def declare(self, me: ReadyEntry, members: tuple[ReadyEntry, ...], reason: str, ttl_s: float) -> GroupDeclaration:
        """Sign the declaration of ``members`` (we are its leader), push it to them, store it for ``ttl_s`` seconds."""
        decl = GroupDeclaration(
            leader=me.peer_id,
            round_key=me.round_key,
            round_id=make_round_id(self.prefix, me.round_key, members),
            members=members,
            declared_at=get_dht_time(),
            reason="full" if reason.endswith("(full)") else "window",
        )
        decl = sign_declaration(self.prefix, decl, self.node.identity.private_key)
        self._remember(decl)  # a retry of this round key must see these entries as consumed, DHT or not
        raw = decl.model_dump()
        if self.push is not None:  # followers hear it at once instead of at their next DHT poll
            self.push("group", raw, [m for m in members if m.peer_id != me.peer_id])
        self.node.dht.store(  # for latecomers ("late") and followers the push missed; not awaited
            self._key(me.round_key), raw, decl.declared_at + ttl_s, subkey=self._subkey(b"group"), return_future=True
        )
        return decl

    # ---- verified records ---------------------------------------------------------------------------------------
    def _verify(self, record: ReadyEntry | GroupDeclaration) -> bool:
        """Signature check, remembered (records are frozen and hashable; polls see the same ones again)."""
        with self._lock:
            known = self._verified.get(record)
        if known is not None:
            return known
        if isinstance(record, ReadyEntry):
            ok = verify_entry(self.prefix, record)
        else:
            ok = verify_declaration(self.prefix, record, lambda _, m: self._verify(m))
        with self._lock:
            self._verified[record] = ok
            while len(self._verified) > MAX_VERIFIED:
                del self._verified[next(iter(self._verified))]
        return ok

    def offer(self, raw: object) -> bool:
        """A declaration pushed to us over the data plane (any thread). Kept if valid and signed; returns that."""
        try:
            decl = GroupDeclaration.model_validate(raw)
        except ValueError:
            return False
        if not self._verify(decl):
            logger.warning("dropping a pushed group declaration that does not verify (leader %s)", decl.leader)
            return False
        self._remember(decl)
        return True

    def _remember(self, decl: GroupDeclaration) -> None:
        """Keep a verified declaration (at most ``MAX_PUSHED`` per round key and round keys) and wake ``match``."""
        with self._lock:
            known = self._decls.setdefault(decl.round_key, [])
            if decl not in known:
                known.append(decl)
                del known[:-MAX_PUSHED]
            while len(self._decls) > MAX_PUSHED:  # forget the oldest round keys
                del self._decls[next(iter(self._decls))]
            self._wake.set()

    def offer_entry(self, raw: object) -> bool:
        """A ready entry pushed to us by a peer that expects us to lead (any thread). Kept if valid and signed by its
        peer (the latest per peer, at most ``MAX_PUSHED_ENTRIES`` per round key); returns that."""
        try:
            entry = ReadyEntry.model_validate(raw)
        except ValueError:
            return False
        if not self._verify(entry):
            logger.warning("dropping a pushed ready entry that does not verify (peer %s)", entry.peer_id)
            return False
        with self._lock:
            by_peer = self._entries.setdefault(entry.round_key, {})
            old = by_peer.get(entry.peer_id)
            if old is None and len(by_peer) >= MAX_PUSHED_ENTRIES:
                return False
            if old is None or entry.announced_at > old.announced_at:
                by_peer[entry.peer_id] = entry
            while len(self._entries) > MAX_PUSHED:
                del self._entries[next(iter(self._entries))]
            self._wake.set()
        return True

    def _merge(self, round_key: str, entries: list[ReadyEntry]) -> tuple[list[ReadyEntry], list[GroupDeclaration]]:
        """Entries the DHT showed plus those pushed to us (``decide`` keeps the latest per peer), and every
        declaration we know of: read, pushed, or ours."""
        with self._lock:
            pushed_entries = list(self._entries.get(round_key, {}).values())
            decls = list(self._decls.get(round_key, ()))
        return entries + pushed_entries, decls

    # ---- DHT reads ----------------------------------------------------------------------------------------------
    def _start_read(self, round_key: str):
        future = self.node.dht.get(self._key(round_key), latest=True, return_future=True)
        future.add_done_callback(lambda _: self._wake.set())
        return future

    def _collect(self, future, round_key: str, timeout_s: float) -> list[ReadyEntry]:
        """The verified entries of a DHT read; its verified declarations are remembered (forged or malformed records
        are dropped; a failed or unfinished read gives nothing)."""
        try:
            found = future.result(timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - a failed poll is retried at the next interval
            logger.debug("DHT read failed: %s", exc)
            return []
        if found is None or not isinstance(found.value, dict):
            return []
        entries = []
        for subkey, item in found.value.items():
            kind = subkey.rsplit(b"|", 1)[-1] if isinstance(subkey, bytes) else b""
            schema, id_field = {b"ready": (ReadyEntry, "peer_id"), b"group": (GroupDeclaration, "leader")}.get(
                kind, (None, "")
            )
            record = parse_signed(subkey, getattr(item, "value", None), schema, id_field) if schema else None
            if record is None or record.round_key != round_key:
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
    ) -> tuple[Decision, str]:
        """Announce ``me``, then decide on every push and DHT read until a decision other than "wait" (or the call
        deadline, ``time.monotonic()``).

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
        stored = None
        read_timeout_s = max(5.0, 10 * self.poll_interval_s)
        dht_entries: list[ReadyEntry] = []
        read, read_started, next_read_at = None, 0.0, announce_at
        read_started_dht = seen_as_of_dht = 0.0  # DHT time the pending / the last collected read started
        while True:
            now_m = time.monotonic()
            if read is not None and (read.done() or now_m > read_started + read_timeout_s):
                dht_entries = self._collect(read, me.round_key, 0.0)
                read, seen_as_of_dht = None, read_started_dht
            if announce_at is not None and now_m >= announce_at:
                stored, announce_at = self.announce(me, ttl_s), None  # we read meanwhile: our entry is in our view
            if stored is not None and stored.done():
                if not stored.exception() and not stored.result():
                    logger.warning("no DHT node accepted our ready entry for %s", me.round_key)
                stored = None
            self._wake.clear()  # anything pushed from here on wakes the wait below
            entries, decls = self._merge(me.round_key, dht_entries)
            decision = decide(
                me,
                entries,
                decls,
                get_dht_time(),
                target_group_size=target_group_size,
                min_group_size=min_group_size,
                declare_grace_s=self.declare_grace_s,
                banned=banned,
            )
            # A window closes on what the DHT showed after it closed: a view read before the deadline (a slow DHT under
            # load) may lack peers that announced in time, and would leave them out of the group (or split it).
            stale = decision.action == "declare" and decision.reason.endswith("(window)")
            stale = stale and seen_as_of_dht < min(m.deadline for m in decision.members)
            if decision.action == "declare" and not stale:
                # decide() would have returned "joined" had a smaller leader's declaration listed us; two leaders
                # that did not see each other yield two groups whose overlap fails at the handshake and retries.
                declared = self.declare(me, decision.members, decision.reason, ttl_s)
                self._hints = declared.members
                return Decision("joined", decision.reason, declaration=declared), decision.reason
            if decision.action == "joined" and decision.declaration is not None:
                self._hints = decision.declaration.members
            if decision.action not in ("wait", "declare"):
                return decision, decision.reason
            leader = decision.leader
            if leader is not None and leader.peer_id != me.peer_id:
                self._push_entry(me, [leader], pushed_to)
            # Poll fast when a declaration is imminent (followers whose window closed), and during the first second
            # while we lead (the group may fill up any moment) or have not told our leader yet.
            just_started = get_dht_time() - me.announced_at < FAST_LEAD_S
            imminent = decision.reason.startswith("waiting for leader") or (
                just_started and (leader is None or leader.peer_id == me.peer_id or leader.peer_id not in pushed_to)
            )
            interval_s = min(self.poll_interval_s, FAST_POLL_S) if imminent else self.poll_interval_s
            if read is None and (now_m >= next_read_at or stale):
                read_started_dht = get_dht_time()
                read, read_started, next_read_at = self._start_read(me.round_key), now_m, now_m + interval_s
            if now_m >= deadline_monotonic:
                return Decision("no_group", "call deadline reached during matchmaking"), "deadline"
            wake_at = read_started + read_timeout_s if read is not None else next_read_at
            wake_at = wake_at if announce_at is None else min(wake_at, announce_at)
            self._wake.wait(max(0.0, min(wake_at, deadline_monotonic) - now_m))
