"""Matchmaking and averaging rounds of the simulated swarm, decided by the production functions.

Per round key (epoch E, DHT key ``{prefix}.eE.mm``) the engine keeps what the DHT would hold: each peer's newest
``ReadyEntry`` (one subkey per peer: a newer announcement replaces the older; until ``round_timeout_s`` after it) and
every ``GroupDeclaration``. At each tick it calls
``averaging.matchmaking.decide`` for the waiting peer with the smallest id: that peer is the leader of any group that
can form now (``decide`` sorts candidates by id), so "declare" forms a group, a failure ("late", "no_group", ...)
fails that peer and the next one is asked, and "wait" means no group forms this tick. A peer that announces while a
"window" declaration exists at its key is asked at once (only then can a fresh entry fail: with no window declaration
its decision is "wait" or "declare"). Followers are not asked separately: a declaration that lists them is their
"joined". Groups run as SimPy processes (``sim.group_rounds``) whose duration comes from ``sim.network``; the
pseudo-gradients are averaged with ``sim.consensus.group_means``; failures go through
``diloco.round_policy.decide_after_round``.

Shared calls (the functions are pure, so a call whose answer is provably the same for several peers is made once):
peers that announce together are decided by two ``decide`` calls (``decide_fresh``), and failed peers whose views and
own records agree share one ``decide_after_round`` (``sim.sharing``: ``share_key``), also at later times while the
board holds the same records and the same of them are live (``policy_key``). Retries announce on the tick grid, all
those due at a tick in one batch (``_retry``). At 10,000 peers a "late" storm otherwise costs an O(N) call of each
per peer per retry. ``tests/sim/test_sharing.py`` compares shared and cached with individual calls.

While the network is split (``sim.partition``) each side sees only its own side's entries, declarations and
records: matchmaking runs per side, and a group that spans both sides when the split begins fails at that moment.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from hivetrain.averaging.config import AveragingConfig
from hivetrain.averaging.entry_shards import entry_levels
from hivetrain.averaging.matchmaking import (
    MAX_MEMBERS,
    Decision,
    GroupDeclaration,
    ReadyEntry,
    decide,
    make_round_id,
    over_because,
)
from hivetrain.averaging.reduce import part_codec
from hivetrain.diloco.round_policy import RoundView, decide_after_round
from hivetrain.diloco.rounds import expected_peers, patience_for
from hivetrain.sim import dht as simdht
from hivetrain.sim.dht import RoundKey
from hivetrain.sim.group_rounds import PREFIX, GroupRounds
from hivetrain.sim.network import Transfer, download_cost
from hivetrain.sim.sharing import SharedCalls
from hivetrain.sim.swarm_state import ABSENT, AVERAGING, READY

if TYPE_CHECKING:
    from hivetrain.sim.dataparallel import DataParallelSim


class RoundEngine:
    """Matchmaking, all-reduce processes, commits and failures for a ``DataParallelSim``."""

    max_members = MAX_MEMBERS
    """The most members of one declaration (``averaging.matchmaking.MAX_MEMBERS``, as the engine matches): past it an
    epoch forms several declarations, each its own state. Tests lower it to reach that case with few peers."""

    def __init__(self, sim: DataParallelSim):
        self.sim = sim
        self.avg = sim.sc.averaging
        self.keys: dict[int, RoundKey] = {}
        self.sessions = 0
        self._retries: dict[float, list[int]] = {}  # tick -> slots that announce again then (``_retry``)
        self.shared = SharedCalls(sim)  # which peers share one decision call (``sim.sharing``)
        self.wire_bytes = wire_bytes(sim.sc.sim.model_bytes, self.avg)
        self.groups = GroupRounds(self)
        # ``over_because``'s rules as ``averaging.engine`` passes them (butterfly, ``drop_failed``: rows of target size)
        tolerant = self.avg.drop_failed and self.avg.exact_average
        self.over_rules = {"tolerant_rows": self.avg.target_group_size if tolerant else 0,
                           "min_group_size": self.avg.min_group_size}  # fmt: skip

    def check_round_fits(self) -> None:
        """Refuse a scenario whose rounds cannot finish: the all-reduce of the starting swarm's first declaration
        (every peer, cut into rows past ``target_group_size``) on its links takes longer than
        ``averaging.round_timeout_s``, which bounds the whole call (``averaging.engine``). Every round would time
        out and the simulation would never reach an outer step. Raises ValueError naming both figures."""
        st = self.sim.state
        slots = st.alive()
        if len(slots) < 2 or not self.avg.exact_average:
            return
        ids = sorted(st.peer_ids[int(s)] for s in slots)
        order = np.array([st.index_of[p] for p in ids])
        cost = self.groups.cost(order, make_round_id(PREFIX, "e0", ()))
        if cost.duration_s + self.avg.matchmaking_time_s > self.avg.round_timeout_s:
            raise ValueError(
                f"averaging.round_timeout_s ({self.avg.round_timeout_s:g} s) is shorter than one round on these "
                f"links: the all-reduce of {len(slots)} peers takes {cost.duration_s:.0f} s (+ "
                f"{self.avg.matchmaking_time_s:g} s matchmaking); every round would time out. Raise "
                "averaging.round_timeout_s, or use fewer bytes (averaging.compression, sim.model_bytes)"
            )

    # ---- matchmaking ---------------------------------------------------------------------------------------------
    def announce(self, slots: list[int], now: float) -> None:
        """``slots`` are ready to average their pseudo-gradients at their phase epochs: store fresh entries. A peer
        that announces while a "window" declaration exists at its key is decided at once (see the module docstring);
        peers announcing together share that decision where it is provably the same (``decide_fresh``)."""
        for epoch, group in self.store(slots, now).items():
            key = self.keys[epoch]
            if not any(d.reason == "window" for d in key.declarations):
                continue
            failed: dict[tuple[str, frozenset[str]], list[int]] = defaultdict(list)
            for part in self._by_side(group):  # callers of one side see the same entries
                for slot, d in self.decide_fresh(key, part, now).items():
                    if d.action not in ("wait", "declare", "joined"):
                        self._withdraw(key, slot)
                        failed[d.action, _members(d.declaration)].append(slot)
            for (action, closed), failing in failed.items():
                self.fail(failing, epoch, action, now, closed)

    def store(self, slots: list[int], now: float) -> dict[int, list[int]]:
        """Store a fresh entry (a new session) for each of ``slots`` at its phase epoch's key; returns epoch ->
        the slots stored there. A newer entry of a peer replaces its older one (one DHT subkey per peer)."""
        st = self.sim.state
        fresh: dict[int, list[int]] = defaultdict(list)
        for slot in slots:
            epoch = int(st.i["phase_epoch"][slot])
            key = self.keys.setdefault(epoch, RoundKey(epoch))
            self.sessions += 1
            session = self.sessions.to_bytes(16, "big")
            peer_id = st.peer_ids[slot]
            st.i["status"][slot] = READY
            if st.f["ready_since"][slot] == 0 or st.i["attempt"][slot] == 0:
                st.f["ready_since"][slot] = now
            # as ``averaging.engine`` makes it: the window closes after matchmaking_time_s; the entry waits until the
            # round's deadline less the grace a follower gives its leader (``_poll_key`` gives up at the deadline)
            window_closes = now + self.avg.matchmaking_time_s
            deadline = max(window_closes, self._round_deadline(slot) - self._grace_s(key))
            entry = simdht.fake_entry(peer_id, f"e{epoch}", session, now, deadline, window_closes)
            key.entries[peer_id] = entry
            key.waiting[slot] = entry
            fresh[epoch].append(slot)
        self.sim.metrics.dht.ops(len(slots))
        for epoch, new in fresh.items():  # a newcomer reads the declarations stored by reference once
            fetch = self.keys[epoch].fetch
            self.sim.metrics.dht.ops(len(new), fetch.chunks, fetch.fetch, "matchmaking.chunks")
            self._key_size(self.keys[epoch])
        return fresh

    def _round_deadline(self, slot: int) -> float:
        """When ``slot``'s averaging call gives up: round_timeout_s after it became ready (its first attempt)."""
        return float(self.sim.state.f["ready_since"][slot]) + self.avg.round_timeout_s

    def decide_fresh(self, key: RoundKey, slots: list[int], now: float) -> dict[int, Decision]:
        """``decide`` for peers that have just announced together at ``key`` (their entries are stored).

        Shared call. Every caller's fresh entry is stored, so each caller sees the same entries and declarations,
        and no declaration lists their fresh sessions. A caller listed (an older session) by a declaration that may
        still commit (``over_because``) is decided alone (``_listed_live``). Of the others ``decide`` reads only
        their ``announced_at`` (the same for all) and whether one is the smallest-id candidate (the leader:
        "declare", "too_small" or a "leading" wait). Hence every caller but the one with the smallest id gets the
        answer of the one with the largest id: two calls stand for them all.
        The expected peers (``diloco.rounds.expected_peers``, as every real caller passes them) are read through
        the caller only by whether it is one of them (the "several groups" count leaves the caller out), so callers
        in and out of that set are shared separately. (A caller listed with an entry announced at ``now`` itself
        would break the argument: it is decided alone.) ``tests/sim/test_sharing.py`` checks them against single calls.
        """
        same_instant = {m.peer_id for d in key.declarations for m in d.members if m.announced_at >= now}
        same_instant |= self._listed_live(key, now)
        ids = self.sim.state.peer_ids
        expected, patience = self._expected(key, slots[0], now)
        sharable = sorted((s for s in slots if ids[s] not in same_instant), key=lambda s: ids[s])
        out: dict[int, Decision] = {}
        for inside in (True, False):  # the smallest id of all may lead: decided alone
            part = [s for s in sharable[1:] if (ids[s] in expected) == inside]
            if len(part) > 1:
                shared = self._decide(key, key.waiting[part[-1]], now, expected, patience)
                out.update(dict.fromkeys(part, shared))
                self.sim.metrics.count("decide." + shared.action, len(part) - 1)  # verdicts, one per peer
                self.sim.metrics.count("decide.shared", len(part) - 1)
        for slot in slots:
            if slot not in out:
                out[slot] = self._decide(key, key.waiting[slot], now, expected, patience)
        return out

    def _listed_live(self, key: RoundKey, now: float) -> set[str]:
        """The members of ``key``'s declarations that may still commit (``over_because`` on every entry stored at the
        key, as each caller of ``decide_fresh`` reads them). While the network is split a side reads fewer entries,
        so fewer members that announced again: then every member of a declaration counts."""
        if not self.over_rules["tolerant_rows"] or not key.declarations:
            return set()
        newest = {} if self.sim.views is not None else {p: e.announced_at for p, e in key.entries.items()}
        return {
            m.peer_id
            for d in key.declarations
            if len(d.members) > 1 and not over_because(d, newest, now, self.avg.round_timeout_s, **self.over_rules)
            for m in d.members
        }

    def _expected(self, key: RoundKey, slot: int, now: float) -> tuple[frozenset[str], float]:
        """The peers every caller at ``key`` on ``slot``'s side expects (``expected_peers`` with nobody left out:
        ``decide`` removes the caller itself), and how long a group waits for a missing one (``patience_for``, as
        the trainer passes it; the same for every caller)."""
        records = self.sim.records_for(slot)
        expected = expected_peers(records, "", key.epoch, now, self.sim.sc.schedule.stale_after_s)
        per_step = self.sim.sc.schedule.batch_size
        return expected, patience_for(records, expected, key.epoch, per_step, self.avg.round_timeout_s)

    def forget(self, slot: int) -> None:
        """A departed peer stops waiting (its entry stays in the DHT until it expires)."""
        for key in self.keys.values():
            key.waiting.pop(slot, None)

    def _key_size(self, key: RoundKey) -> int:
        """Bytes of one matchmaking read of ``key`` (the round key's value and its entry shards': ``entry_shards``);
        its largest value goes to the peak."""
        size = len(key.entries) * simdht.entry_bytes() + key.declarations_bytes
        self.sim.metrics.dht.value_size("matchmaking", key.largest_value(self._entry_level()), self.sim.env.now)
        return size

    def _entry_level(self) -> int:
        return entry_levels([self.sim.shard_bits])[0]

    def _reads_per_s(self, size: int) -> float:
        """Matchmaking reads per second of one waiting peer at a key of ``size`` bytes: one per poll interval, or
        fewer where the read budget binds (``Matchmaker.read_gap_s``: a read of B bytes, then B /
        ``matchmaking_read_kib_s`` before the next)."""
        return min(1.0 / self.avg.poll_interval_s, self.avg.matchmaking_read_kib_s * 1024 / max(size, 1))

    def _grace_s(self, key: RoundKey) -> float:
        """``Matchmaker.grace_s`` at ``key``: the declare grace, plus how much longer than the poll interval the read
        budget spaces the reads (the simulated DHT answers at once: no latency term)."""
        return self.avg.declare_grace_s + max(
            0.0, 1.0 / self._reads_per_s(self._key_size(key)) - self.avg.poll_interval_s
        )

    def _by_side(self, slots: list[int]) -> list[list[int]]:
        """``slots`` split by partition side while the network is split, else ``[slots]``."""
        if self.sim.views is None:
            return [slots]
        side = self.sim.partition.side
        return [p for p in ([s for s in slots if side[s] == k] for k in (0, 1)) if p]

    def _visible(self, key: RoundKey, me: ReadyEntry) -> tuple[Iterable[ReadyEntry], list[GroupDeclaration]]:
        """The entries and declarations at ``key`` that ``me`` can read: all, or its side's while split."""
        if self.sim.views is None:
            return key.entries.values(), key.declarations
        side, index_of = self.sim.partition.side, self.sim.state.index_of
        mine = side[index_of[me.peer_id]]
        entries = [e for e in key.entries.values() if side[index_of[e.peer_id]] == mine]
        return entries, [d for d in key.declarations if side[index_of[d.leader]] == mine]

    def _decide(
        self, key: RoundKey, me: ReadyEntry, now: float, expected: frozenset[str] = frozenset(), patience_s: float = 0.0
    ):
        # every strategy matches everyone ready at the epoch into one declaration (``averaging.engine``): butterfly
        # then runs the two-stage all-reduce when they are more than target_group_size
        entries, declarations = self._visible(key, me)
        gone = self._gone_leaders(key, entries, me, now)
        d = decide(me, entries, declarations, now, target_group_size=self.max_members,
                   min_group_size=self.avg.min_group_size, declare_grace_s=self._grace_s(key),
                   declaration_ttl_s=self.avg.round_timeout_s, banned=gone, expected=expected,
                   patience_s=patience_s, tolerant_rows=self.over_rules["tolerant_rows"])  # fmt: skip
        self.sim.metrics.count("decide." + d.action)
        return d

    def _gone_leaders(self, key: RoundKey, entries: Iterable[ReadyEntry], me: ReadyEntry, now: float) -> frozenset[str]:
        """The departed peers that would lead ``me``'s group, as ``Matchmaker.match`` finds them gone: a follower that
        has waited on its leader's declaration for longer than the declare grace probes the leader's data port once,
        and a port that refuses connections marks it gone (passed to ``decide`` as banned). Here: entries of peers
        that left more than that grace (+ the 1 s probe) ago, smaller in id than every entry of a live peer
        waiting at ``key`` (the candidates that would lead instead). Without it a departed peer's entry, live until
        its call's deadline (up to ``round_timeout_s``), led every group at its key: at 1,000 simulated peers,
        60,000 "leader declared nothing" verdicts in 900 s."""
        st, grace = self.sim.state, self._grace_s(key) + 1.0
        gone = []
        for e in sorted(entries, key=lambda e: e.peer_id):
            slot = st.index_of.get(e.peer_id)
            if e.peer_id == me.peer_id or slot is None or slot in key.waiting:
                break
            if st.i["status"][slot] != ABSENT:
                continue  # a live peer's used or withdrawn entry: no candidate
            if now - float(st.f["leaves_at"][slot]) < grace:
                break  # not found gone yet: it still leads
            gone.append(e.peer_id)
        return frozenset(gone)

    def poll(self, now: float) -> None:
        """One matchmaking tick for every round key with waiting peers (see the module docstring)."""
        m = self.sim.metrics
        for epoch in sorted(self.keys):
            key = self.keys[epoch]
            expired = [p for p, e in key.entries.items() if now - e.announced_at > self.avg.round_timeout_s]
            for p in expired:
                del key.entries[p]
            if not key.waiting:
                if not key.entries and epoch < max(self.keys):
                    del self.keys[epoch]
                continue
            size = self._key_size(key)
            polls = self.sim.sc.sim.tick_s * self._reads_per_s(size)
            level = self._entry_level()  # a read gets the round key and each entry shard
            gets = max(1, round(polls)) * (1 + ((1 << level) if level else 0))
            m.dht.ops(len(key.waiting), gets, int(polls * size), "matchmaking")
            for part in self._by_side(list(key.waiting)):  # each side of a split matches on its own
                self._poll_key(key, part, now)

    def _poll_key(self, key: RoundKey, waiting: list[int], now: float) -> None:
        """One tick at ``key`` for the ``waiting`` slots (all of them, or one side's while split)."""
        st, epoch = self.sim.state, key.epoch
        expected, patience = self._expected(key, waiting[0], now)
        # the waiting peer with the smallest id is asked first; nobody starts waiting during this loop
        for slot in sorted(waiting, key=lambda s: st.peer_ids[s]):
            if slot not in key.waiting:
                continue  # consumed by a group declared earlier in this loop
            d = self._decide(key, key.waiting[slot], now, expected, patience)
            if d.action == "wait" and now < self._round_deadline(slot):
                break
            if d.action == "wait":  # the leader's own call deadline: it gives up, the next peer is asked
                self._give_up(key, slot, now)
                continue
            if d.action == "declare":
                decl = GroupDeclaration.model_construct(
                    leader=st.peer_ids[slot], round_key=f"e{epoch}",
                    round_id=make_round_id(PREFIX, f"e{epoch}", d.members), members=d.members,
                    declared_at=now, reason="full" if d.closed_by == "full" else "window", signature=b"s" * 256,
                )  # fmt: skip
                stored = key.declare(decl)  # members have it pushed; other waiting peers read its chunks
                if stored.chunk:
                    members = {m.peer_id for m in d.members}
                    others = sum(e.peer_id not in members for e in key.waiting.values())
                    self.sim.metrics.dht.ops(others, stored.chunks, stored.fetch, "matchmaking.chunks")
                    self.sim.metrics.dht.value_size("matchmaking.chunk", stored.chunk, now)
                self._start_group(key, decl, now)
                continue
            self._withdraw(key, slot)
            self.fail([slot], epoch, d.action, now, _members(d.declaration))
        # peers past their call deadline that were not asked (a smaller id waits): no group formed for them either
        for slot in [s for s in waiting if s in key.waiting and now >= self._round_deadline(s)]:
            self._give_up(key, slot, now)

    def _give_up(self, key: RoundKey, slot: int, now: float) -> None:
        """``slot``'s averaging call reached its deadline while matchmaking: as ``Matchmaker.match`` does, it withdraws
        its entry and fails "no_group"."""
        self._withdraw(key, slot)
        self.fail([slot], key.epoch, "no_group", now)

    @staticmethod
    def _withdraw(key: RoundKey, slot: int) -> None:
        """``slot`` stops waiting at ``key`` with a failure verdict, and, as ``Matchmaker.match`` does on every one,
        withdraws its entry (a copy whose deadline has passed: stale to every ``decide``). Without this the simulated
        entry of a peer told "late" or "no_group" stayed a candidate until its deadline; with the smallest id it led
        a group it never declared, and its followers failed "no_group" after the grace (16,301 such verdicts in
        ``dp-1000-churn``, 8 outer steps, 2026-12-01)."""
        entry = key.waiting.pop(slot)
        key.entries[entry.peer_id] = entry.model_copy(update={"deadline": 0.0, "window_closes_at": 0.0})

    # ---- groups --------------------------------------------------------------------------------------------------
    def _start_group(self, key: RoundKey, decl: GroupDeclaration, now: float) -> None:
        st = self.sim.state
        members, present = [], []
        for e in decl.members:
            slot = st.index_of[e.peer_id]
            members.append(slot)
            ok = key.waiting.get(slot) is not None and key.waiting[slot].session == e.session
            present.append(ok and st.i["status"][slot] == READY)
            if ok:
                del key.waiting[slot]
                st.i["status"][slot] = AVERAGING
        self.sim.metrics.group_sizes.append(len(members))
        slots = np.array(members)
        live = slots[np.array(present)]
        if self.groups.tolerant_grid(len(slots)) and self.sim.partition.cut_s(slots, now) == float("inf"):
            self.sim.env.process(self.groups.grid(slots, np.array(present), decl, key.epoch, now))
            return
        if not all(present) and not self.groups.goes_on_without(len(live), len(slots)):
            # a member is gone (its entry outlived it): the round fails at connect
            self.sim.env.process(self._fail_after(list(live), key.epoch, "member gone", self.avg.connect_timeout_s))
            return
        if len(slots) == 1:
            self.groups.solo(int(slots[0]), key.epoch, now)
        elif self.avg.exact_average and len(live) < len(slots):
            # ``allreduce``: a member with no link by the connect deadline is not among the contributors; the others
            # start their round once they gave up on it
            self.sim.metrics.count("round.members_dropped", len(slots) - len(live))
            self.sim.env.process(self.groups.butterfly(live, decl, key.epoch, now, len(slots)))
        elif self.avg.exact_average:
            self.sim.env.process(self.groups.butterfly(slots, decl, key.epoch, now))
        else:
            self.sim.env.process(self.groups.mixing(slots, decl, key.epoch, now))

    def _fail_after(self, slots: list[int], epoch: int, failure: str, delay_s: float):
        yield self.sim.env.timeout(delay_s)
        self.fail([s for s in slots if self.sim.state.i["status"][s] != ABSENT], epoch, failure, self.sim.env.now)

    def _after_round(self, slot: int, view: RoundView, now: float):
        sc = self.sim.sc
        policy = decide_after_round(
            self.sim.state.peer_ids[slot],
            view,
            self.sim.records_for(slot),
            now,
            max_retries=self.avg.max_retries,
            stale_after_s=sc.schedule.stale_after_s,
            dht_lost_after_s=sc.schedule.record_ttl_s,
            exact_average=self.sim.exact,
            trust=self.sim.trust,
        )
        self.sim.metrics.count("after_round." + policy.action)
        return policy

    def fail(
        self, slots: list[int], epoch: int, failure: str, now: float, closed: frozenset[str] = frozenset()
    ) -> None:
        """A round failed for ``slots``: one ``decide_after_round`` per group of them that ``sim.sharing`` puts
        together (``share_key``), or its cached answer (``policy_key``). ``closed``: the members of the epoch's
        group that closed without them (matchmaking's "late" / "not_in_group", as the engine reports it:
        ``RoundFailed.closed_without_us``), or the peers ahead whose round outweighed theirs
        (``round_policy.went_ahead``): whose result they follow (``RoundView.closed_without_us``)."""
        st = self.sim.state
        self.sim.metrics.count("round_failed." + failure)
        by_view: dict[tuple, list[int]] = defaultdict(list)
        shared = self.shared
        free = shared.free_hashes(epoch, now)
        for slot in slots:
            if st.i["status"][slot] != ABSENT:
                by_view[shared.share_key(slot, now, free, epoch)].append(slot)
        for share, group in by_view.items():
            key = shared.policy_key(share, epoch, (failure, closed), now)
            policy = shared.cached(key)
            if policy is None:
                view = shared.failed_view(group[0], epoch, failure, now, closed)
                policy = self._after_round(group[0], view, now)
                shared.store(key, policy)
            else:
                self.sim.metrics.count("after_round." + policy.action)
                self.sim.metrics.count("after_round.cached")
            self.sim.metrics.count("after_round.shared", len(group) - 1)
            self._apply_policy(group, epoch, policy, now, closed)

    def _apply_policy(self, slots: list[int], epoch: int, policy, now: float, closed=frozenset[str]()) -> None:
        st = self.sim.state
        for slot in slots:
            st.i["attempt"][slot] += 1
        hash_ = st.state_hash[slots[0]]
        if policy.action == "resync" and self.sim.sync.sync_or_download(slots, epoch, hash_, now, closed=closed):
            for slot in slots:
                st.f["carried_samples"][slot] = 0  # ``keep_carried`` with max_staleness 0: lost across a download
                st.i["carried_phases"][slot] = 0
                self.sim.metrics.lose("dropped by a resync", st.f["weight"][slot])
            return
        if policy.action in ("retry", "lost"):
            self._retry(slots, now + policy.backoff_s)
            return
        for slot in slots:  # carry (or resync without donors): train on at this epoch, send both later
            st.f["carried_samples"][slot] = st.f["weight"][slot]
            st.i["carried_phases"][slot] = st.i["phases"][slot]
            st.f["ready_since"][slot] = 0
            st.i["attempt"][slot] = 0
            st.start_phase(slot, epoch, now)

    def _retry(self, slots: list[int], at: float) -> None:
        """``slots`` announce again at the first tick at or after ``at`` (``announce_retries``): like every other
        decision of the simulation, a retry is taken on the tick grid (a backoff of 0.25 s becomes up to one
        ``tick_s``). Retries due at one tick announce as one batch, so ``decide_fresh`` and ``share_key`` share calls
        among all of them; peers acting in one tick are concurrent, as peers ending their phases in one tick are."""
        st = self.sim.state
        for slot in slots:
            st.i["status"][slot] = AVERAGING  # not training, not yet announced
        tick_s = self.sim.sc.sim.tick_s
        due = math.ceil(at / tick_s - 1e-9) * tick_s
        self._retries.setdefault(due, []).extend(slots)

    def announce_retries(self, now: float) -> None:
        """Announce every retry due by ``now`` (called once per tick, before matchmaking)."""
        due = [at for at in self._retries if at <= now + 1e-9]
        if not due:
            return
        st = self.sim.state
        back = [slot for at in sorted(due) for slot in self._retries.pop(at) if st.i["status"][slot] == AVERAGING]
        if back:
            self.announce(back, now)

    # ---- downloads -----------------------------------------------------------------------------------------------
    def download_cost(self, slot: int, donors: np.ndarray, concurrent: np.ndarray) -> Transfer:
        st, sc = self.sim.state, self.sim.sc
        return download_cost(sc.sim.resolved_state_bytes(), sc.download.chunk_bytes, float(st.f["down_bps"][slot]),
                             float(st.f["latency_s"][slot]), st.f["up_bps"][donors], st.f["latency_s"][donors],
                             concurrent)  # fmt: skip


def _members(declaration: GroupDeclaration | None) -> frozenset[str]:
    """The member ids of a declaration matchmaking failed us for ("late", "not_in_group"), or empty."""
    return frozenset() if declaration is None else frozenset(declaration.member_ids())


def wire_bytes(model_bytes: int, avg: AveragingConfig) -> int:
    """Bytes of a ``model_bytes`` fp32 pseudo-gradient once ``averaging.compression`` encodes it (parts and averaged
    results alike, as ``averaging.allreduce`` sends both; a scenario cannot pick "topk", which needs error feedback),
    with the production codec sizes (``reduce.part_codec``: fp16 halves it, int8/int4 add one fp32 scale per
    ``codec_block_size`` elements) as one frame (the header counts once, not once per slice)."""
    return part_codec(avg).frame_num_bytes(model_bytes // 4)
