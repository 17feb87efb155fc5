"""Matchmaking and averaging rounds of the simulated swarm, decided by the production functions.

Per round key (epoch E, DHT key ``{prefix}.eE.mm``) the engine keeps what the DHT would hold: each peer's newest
``ReadyEntry`` (one subkey per peer: a newer announcement replaces the older; until ``round_timeout_s`` after it) and
every ``GroupDeclaration``. At each tick it calls
``averaging.matchmaking.decide`` for the waiting peer with the smallest id: that peer is the leader of any group that
can form now (``decide`` sorts candidates by id), so "declare" forms a group, a failure ("late", "no_group", ...)
fails that peer and the next one is asked, and "wait" means no group forms this tick. A peer that announces while a
"window" declaration exists at its key is asked at once (only then can a fresh entry fail: with no window declaration
its decision is "wait" or "declare"). Followers are not asked separately: a declaration that lists them is their
"joined". Groups run as SimPy processes whose duration comes from ``sim.network``; the pseudo-gradients are averaged
with ``sim.consensus.group_means``; failures go through ``diloco.round_policy.decide_after_round``.

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

import hashlib
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hivetrain.averaging.codecs import payload_num_bytes, scales_num_bytes
from hivetrain.averaging.groups import gossip_pairs, grid_for, moshpit_groups
from hivetrain.averaging.matchmaking import (
    MAX_MEMBERS,
    Decision,
    GroupDeclaration,
    ReadyEntry,
    decide,
    make_round_id,
)
from hivetrain.diloco.round_policy import RoundView, decide_after_round
from hivetrain.diloco.rounds import expected_peers, patience_for
from hivetrain.sim import dht as simdht
from hivetrain.sim.consensus import group_means
from hivetrain.sim.grid import grid_round
from hivetrain.sim.network import Transfer, allreduce_cost, download_cost, two_stage_cost, two_stage_stages
from hivetrain.sim.sharing import SharedCalls
from hivetrain.sim.swarm_state import ABSENT, AVERAGING, READY

if TYPE_CHECKING:
    from hivetrain.sim.dataparallel import DataParallelSim

PREFIX = "sim.avg"


@dataclass
class RoundKey:
    """What the DHT holds for one round key, and which slots wait on it."""

    epoch: int
    entries: dict[str, ReadyEntry] = field(default_factory=dict)  # peer id -> its newest entry (one DHT subkey each)
    declarations: list[GroupDeclaration] = field(default_factory=list)
    declarations_bytes: int = 0
    waiting: dict[int, ReadyEntry] = field(default_factory=dict)

    def declare(self, decl: GroupDeclaration) -> None:
        self.declarations.append(decl)
        self.declarations_bytes += simdht.declaration_bytes(len(decl.members))


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
        self.wire_bytes = wire_bytes(sim.sc.sim.model_bytes, self.avg.compression, self.avg.codec_block_size)

    def check_round_fits(self) -> None:
        """Refuse a scenario whose rounds cannot finish: the all-reduce of the starting swarm's first declaration
        (every peer, cut into rows past ``target_group_size``) on its links takes longer than
        ``averaging.round_timeout_s``, which bounds the whole call (``averaging.engine``). Every round would time
        out and the simulation would never reach an outer step. Raises ValueError naming both figures."""
        st = self.sim.state
        slots = st.alive()
        if len(slots) < 2 or self.avg.strategy != "butterfly":
            return
        ids = sorted(st.peer_ids[int(s)] for s in slots)
        order = np.array([st.index_of[p] for p in ids])
        cost = self._cost(order, make_round_id(PREFIX, "e0", ()))
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
            failed: dict[str, list[int]] = defaultdict(list)
            for part in self._by_side(group):  # callers of one side see the same entries
                for slot, d in self.decide_fresh(key, part, now).items():
                    if d.action not in ("wait", "declare", "joined"):
                        del key.waiting[slot]
                        failed[d.action].append(slot)
            for action, failing in failed.items():
                self.fail(failing, epoch, action, now)

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
            deadline = max(window_closes, self._round_deadline(slot) - self.avg.declare_grace_s)
            entry = simdht.fake_entry(peer_id, f"e{epoch}", session, now, deadline, window_closes)
            key.entries[peer_id] = entry
            key.waiting[slot] = entry
            fresh[epoch].append(slot)
        self.sim.metrics.dht.ops(len(slots))
        for epoch in fresh:
            self._key_size(self.keys[epoch])
        return fresh

    def _round_deadline(self, slot: int) -> float:
        """When ``slot``'s averaging call gives up: round_timeout_s after it became ready (its first attempt)."""
        return float(self.sim.state.f["ready_since"][slot]) + self.avg.round_timeout_s

    def decide_fresh(self, key: RoundKey, slots: list[int], now: float) -> dict[int, Decision]:
        """``decide`` for peers that have just announced together at ``key`` (their entries are stored).

        Shared call. Every caller's fresh entry is stored, so each caller sees the same entries and declarations;
        a declaration that lists a caller (an older session of it) is over for all of them (``over_because``: its
        member announced again), so no live declaration lists any caller, and no declaration lists their fresh
        sessions. ``decide`` then reads of the caller only its ``announced_at`` (the same for all) and whether it is
        the smallest-id candidate (the leader: "declare", "too_small" or a "leading" wait). Hence every caller but
        the one with the smallest id gets the answer of the one with the largest id: two calls stand for them all.
        The expected peers (``diloco.rounds.expected_peers``, as every real caller passes them) are read through
        the caller only by whether it is one of them (the "several groups" count leaves the caller out), so callers
        in and out of that set are shared separately. (A caller listed with an entry announced at ``now`` itself
        would break the argument: it is decided alone.) ``tests/sim/test_sharing.py`` checks the shared answers
        equal individual calls.
        """
        same_instant = {m.peer_id for d in key.declarations for m in d.members if m.announced_at >= now}
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
        size = len(key.entries) * simdht.entry_bytes() + key.declarations_bytes
        self.sim.metrics.dht.value_size("matchmaking", size, self.sim.env.now)
        return size

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
        d = decide(me, entries, declarations, now, target_group_size=self.max_members,
                   min_group_size=self.avg.min_group_size, declare_grace_s=self.avg.declare_grace_s,
                   declaration_ttl_s=self.avg.round_timeout_s, expected=expected, patience_s=patience_s)  # fmt: skip
        self.sim.metrics.count("decide." + d.action)
        return d

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
            polls = max(1, round(self.sim.sc.sim.tick_s / self.avg.poll_interval_s))
            m.dht.ops(len(key.waiting), polls, polls * size, "matchmaking")
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
                key.declare(decl)
                self._start_group(key, decl, now)
                continue
            del key.waiting[slot]
            self.fail([slot], epoch, d.action, now)
        # peers past their call deadline that were not asked (a smaller id waits): no group formed for them either
        for slot in [s for s in waiting if s in key.waiting and now >= self._round_deadline(s)]:
            self._give_up(key, slot, now)

    def _give_up(self, key: RoundKey, slot: int, now: float) -> None:
        """``slot``'s averaging call reached its deadline while matchmaking: as ``Matchmaker.match`` does, it withdraws
        its entry (a copy whose deadline has passed: stale to every ``decide``) and fails "no_group"."""
        entry = key.waiting.pop(slot)
        key.entries[entry.peer_id] = entry.model_copy(update={"deadline": 0.0, "window_closes_at": 0.0})
        self.fail([slot], key.epoch, "no_group", now)

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
        if self._tolerant_grid(len(slots)) and self.sim.partition.cut_s(slots, now) == float("inf"):
            self.sim.env.process(self._grid(slots, np.array(present), decl, key.epoch, now))
            return
        if not all(present) and not self._goes_on_without(len(live), len(slots)):
            # a member is gone (its entry outlived it): the round fails at connect
            self.sim.env.process(self._fail_after(list(live), key.epoch, "member gone", self.avg.connect_timeout_s))
            return
        if len(slots) == 1:
            self._solo(int(slots[0]), key.epoch, now)
        elif self.avg.strategy == "butterfly" and len(live) < len(slots):
            # ``allreduce``: a member with no link by the connect deadline is not among the contributors; the others
            # start their round once they gave up on it
            self.sim.metrics.count("round.members_dropped", len(slots) - len(live))
            self.sim.env.process(self._butterfly(live, decl, key.epoch, now, len(slots)))
        elif self.avg.strategy == "butterfly":
            self.sim.env.process(self._butterfly(slots, decl, key.epoch, now))
        else:
            self.sim.env.process(self._mixing(slots, decl, key.epoch, now))

    def _cost(self, slots: np.ndarray, round_id: str | None = None) -> Transfer:
        """One butterfly round among ``slots``; with ``round_id``, the two-stage round of that declaration (one
        butterfly round when they fit one group)."""
        st = self.sim.state
        ids = [st.peer_ids[int(s)] for s in slots]
        links = (st.f["up_bps"][slots], st.f["down_bps"][slots], st.f["latency_s"][slots])
        if round_id is None:
            return allreduce_cost(ids, self.wire_bytes, *links)
        return two_stage_cost(ids, self.wire_bytes, *links, self.avg.target_group_size, round_id)

    def _goes_on_without(self, left: int, declared: int) -> bool:
        """Whether ``left`` of ``declared`` members of one butterfly group go on without the others
        (``ButterflyRound._quorate`` with ``averaging.drop_failed``): the grid and moshpit stay all-or-nothing."""
        tolerant = self.avg.drop_failed and self.avg.strategy == "butterfly" and declared <= self.avg.target_group_size
        return tolerant and left >= max(2, self.avg.min_group_size) and 2 * left > declared

    def _tolerant_grid(self, declared: int) -> bool:
        """Whether a declaration of ``declared`` members runs the tolerant two-stage round (``sim.grid``)."""
        avg = self.avg
        return avg.strategy == "butterfly" and avg.drop_failed and declared > avg.target_group_size

    def _grid(self, slots: np.ndarray, present: np.ndarray, decl: GroupDeclaration, epoch: int, now: float):
        """The tolerant two-stage round (``averaging.hierarchical`` with ``drop_failed``; ``sim.grid``): members
        gone at the declaration and those that leave mid-round are dropped from their rows, the row-mates of a
        failed column fetch the result, and the others commit one state in the same attempt."""
        st = self.sim.state
        ids = [st.peer_ids[int(s)] for s in slots]
        links = (st.f["up_bps"][slots], st.f["down_bps"][slots], st.f["latency_s"][slots])
        stages = two_stage_stages(ids, self.wire_bytes, *links, self.avg.target_group_size, decl.round_id)
        assert stages is not None
        deadlines = st.f["ready_since"][slots] + self.avg.round_timeout_s
        leaves = np.where(present, np.minimum(st.f["leaves_at"][slots], deadlines), now)
        fp32 = self.sim.sc.sim.model_bytes

        def fetch(source: int, fetchers: list[int]) -> Transfer:
            idx = np.array([source, *fetchers])
            return allreduce_cost([ids[i] for i in idx], fp32, *(x[idx] for x in links))

        out = grid_round(stages, leaves, now, part_timeout_s=self.avg.part_timeout_s,
                         connect_grace_s=min(1.0, self.avg.connect_timeout_s),
                         quorate=lambda left, declared: left >= max(2, self.avg.min_group_size) and 2 * left > declared,
                         fetch_s=lambda source, fetchers: fetch(source, fetchers).duration_s)  # fmt: skip
        metrics = self.sim.metrics
        metrics.count("round.members_dropped", int((~out.contributors).sum()))
        metrics.count("round.columns_failed", out.columns_failed)
        sent, received = stages.sent_bytes.copy(), stages.received_bytes.copy()
        for _, source, fetchers in out.fetch_rows:
            cost = fetch(source, list(fetchers))
            idx = np.array([source, *fetchers])
            sent[idx] += cost.sent_bytes
            received[idx] += cost.received_bytes
        duration_s = float(np.nanmax(out.commit_at_s, initial=now) - now) if out.reason == "" else 0.0
        self._account(slots, Transfer(duration_s, sent, received))
        kept = slots[out.contributors]
        avg, _ = group_means(st.delta[kept], st.f["weight"][kept], np.zeros(len(kept), np.int64))
        held = [st.state_hash[int(s)] for s in slots]
        hashes = np.array([decl.round_id if len(set(held)) == 1 else state_hash_of(decl.round_id, h) for h in held])
        timed_out = np.isnan(out.commit_at_s) & np.isnan(out.fail_at_s) & (deadlines < st.f["leaves_at"][slots])
        events = [(float(t), "commit", k) for k, t in enumerate(out.commit_at_s) if not np.isnan(t)]
        events += [(float(t), "fail", k) for k, t in enumerate(out.fail_at_s) if not np.isnan(t)]
        events += [(float(deadlines[k]), "timeout", int(k)) for k in np.flatnonzero(timed_out)]
        credited = False
        for when in sorted({t for t, _, _ in events}):
            yield self.sim.env.timeout(max(0.0, when - self.sim.env.now))
            if not credited and any(t == when and a == "commit" for t, a, _ in events):
                # members that left after their row committed: their pseudo-gradient is in the mean the swarm keeps
                gone = kept[st.i["status"][kept] == ABSENT]
                st.f["samples_committed"][gone] += st.f["weight"][gone]
                self.sim.metrics.regain("left before its round", float(st.f["weight"][gone].sum()))
                credited = True
            for action in ("commit", "fail", "timeout"):
                ks = [k for t, a, k in events if t == when and a == action]
                live = [k for k in ks if st.i["status"][int(slots[k])] == AVERAGING]
                if not live:
                    continue
                if action == "commit":
                    members = slots[live]
                    self._commit(members, np.broadcast_to(avg[:1], (len(live), avg.shape[1])), epoch,
                                 [str(h) for h in hashes[live]], self.sim.env.now)  # fmt: skip
                else:
                    why = "timeout" if action == "timeout" else ("member died" if out.reason == "" else out.reason)
                    self.fail([int(slots[k]) for k in live], epoch, why, self.sim.env.now)

    def _butterfly(self, slots: np.ndarray, decl: GroupDeclaration, epoch: int, now: float, declared: int = 0):
        """One mean for every participant of the epoch's declaration (``averaging.hierarchical`` past one group).

        One group with ``averaging.drop_failed`` (``averaging.allreduce``): a member that leaves mid-round is
        dropped, and the others commit while a strict majority of the ``declared`` members (default: ``slots``) is
        left. One that leaves during the scatter (the first half of the round's cost) is simply not counted: the
        reducers wait ``part_timeout_s`` for its part, and its slice moves to another member (1/k of a scatter
        more). One that leaves during the gather costs ``part_timeout_s`` and its own slice once more: the others
        resend their parts of it to the next member, which reduces it and sends it to everyone (1/k of the round;
        the slices already reduced are kept). Otherwise, and in the two-stage grid or a network partition, rounds
        are all-or-nothing: the others fail ``part_timeout_s`` after the first loss."""
        st = self.sim.state
        declared = declared or len(slots)
        cost = self._cost(slots, decl.round_id)
        # members declared but gone: the others give up on their links at the connect deadline, then go on
        finish = now + cost.duration_s + (self.avg.connect_timeout_s if declared > len(slots) else 0.0)
        # a member whose call reaches its deadline (``round_timeout_s`` after its first attempt) leaves the round
        # then, as one that departs does (``averaging.engine``: the deadline bounds the whole call)
        deadlines = st.f["ready_since"][slots] + self.avg.round_timeout_s
        leaves = np.minimum(st.f["leaves_at"][slots], deadlines)
        cut = self.sim.partition.cut_s(slots, now)
        alive = np.ones(len(slots), bool)
        resent = 0  # slices reduced again and sent once more, after a member was lost during the gather
        if self._goes_on_without(len(slots), declared) and cut >= finish:
            scatter_end = finish - cost.duration_s / 2
            for k in np.argsort(leaves, kind="stable"):
                if leaves[k] >= finish or not self._goes_on_without(int(alive.sum()) - 1, declared):
                    break
                alive[k] = False
                noticed = float(leaves[k]) + self.avg.part_timeout_s
                if leaves[k] < scatter_end:  # not in the contributors: wait for its part, then resend its slice
                    finish += max(0.0, noticed - scatter_end) + cost.duration_s / (2 * len(slots))
                else:  # its slice, reduced again by the next member: its parts in, its result out
                    finish = max(finish, noticed) + cost.duration_s / len(slots)
                    resent += 1
            self.sim.metrics.count("round.members_dropped", int((~alive).sum()))
            for k in np.flatnonzero(~alive & (deadlines < st.f["leaves_at"][slots])):  # dropped at its deadline
                self.sim.env.process(
                    self._fail_after([int(slots[k])], epoch, "timeout", max(0.0, float(deadlines[k]) - now))
                )
        first_gone = min(float(leaves[alive].min()), cut)
        if first_gone < finish:  # all-or-nothing: the others notice the silence after part_timeout_s
            self.sim.partition.cut_groups += int(cut < float(leaves[alive].min()))
            timed_out = float(deadlines[alive].min()) <= first_gone
            yield self.sim.env.timeout(max(0.0, first_gone - now + self.avg.part_timeout_s * (not timed_out)))
            failing = [int(s) for s in slots if st.i["status"][s] == AVERAGING]
            self.fail(failing, epoch, "timeout" if timed_out else "member died", self.sim.env.now)
            return
        yield self.sim.env.timeout(finish - now)
        kept = slots[alive]
        avg, _ = group_means(st.delta[kept], st.f["weight"][kept], np.zeros(len(kept), np.int64))
        self._account(slots, cost)
        if resent:  # per slice reduced again: each survivor's part of it in, the result out (one slice each way)
            st.f["bytes_sent"][kept] += resent * self.wire_bytes // len(slots)
            st.f["bytes_received"][kept] += resent * self.wire_bytes // len(slots)
        # every member applies the same averaged pseudo-gradient to the state it held: members that came from
        # different groups of the last epoch (several groups per epoch) still hold different states after it
        held = [st.state_hash[int(s)] for s in kept]
        hashes = decl.round_id if len(set(held)) == 1 else [state_hash_of(decl.round_id, h) for h in held]
        self._commit(kept, avg, epoch, hashes, self.sim.env.now)

    def _mixing(self, slots: np.ndarray, decl: GroupDeclaration, epoch: int, now: float):
        """Moshpit / gossip (``averaging.engine._mixing``): rounds in derived groups, each all-or-nothing."""
        st = self.sim.state
        ids = [st.peer_ids[int(s)] for s in slots]
        local = {p: k for k, p in enumerate(ids)}
        x, w = st.delta[slots].copy(), st.f["weight"][slots].copy()
        t = np.full(len(slots), now)
        committed = np.zeros(len(slots), np.int64)
        final_group = np.zeros(len(slots), np.int64)
        grid = grid_for(len(ids), self.avg.target_group_size) if len(ids) > 1 else (2,)
        leaves = st.f["leaves_at"][slots]
        cut = self.sim.partition
        for r in range(self.avg.moshpit_rounds):
            index = epoch * self.avg.moshpit_rounds + r
            if self.avg.strategy == "moshpit":
                groups, _ = moshpit_groups(ids, grid, index, PREFIX)
            else:
                groups, _ = gossip_pairs(ids, index, PREFIX)
            labels = np.full(len(slots), -1, np.int64)
            for g, group in enumerate(groups):
                idx = np.array([local[p] for p in group])
                final_group[idx] = g
                if len(idx) < 2:
                    continue
                start = float(t[idx].max())
                cost = self._cost(slots[idx])
                end = start + cost.duration_s
                gone = min(float(leaves[idx].min()), cut.cut_s(slots[idx], start))
                if gone < end:  # a member gone (or across a split): this group's round fails, values kept
                    t[idx] = max(start, gone) + self.avg.part_timeout_s
                    cut.cut_groups += int(gone < float(leaves[idx].min()))
                    continue
                t[idx] = end
                labels[idx] = g
                committed[idx] += 1
                self._account(slots[idx], cost)
            x, w_new = group_means(x, w, labels)
            if self.avg.strategy == "moshpit":
                w = w_new
        alive_end = leaves > t
        ok = (committed > 0) & alive_end
        for when in np.unique(t[ok]):
            sel = ok & (t == when)
            self.sim.env.process(self._commit_later(slots[sel], x[sel], epoch, decl.round_id, final_group[sel], when))
        failed = [int(s) for s in slots[(committed == 0) & alive_end]]
        if failed:
            yield self.sim.env.timeout(max(float(t.max()) - now, 0.0))
            self.fail(failed, epoch, "no mixing round committed", self.sim.env.now)

    def _commit_later(self, slots, averaged, epoch, round_id, final_group, when):
        yield self.sim.env.timeout(max(when - self.sim.env.now, 0.0))
        keep = self.sim.state.i["status"][slots] == AVERAGING
        hashes = [f"{round_id}:{g}" for g in final_group[keep]]
        self._commit(slots[keep], averaged[keep], epoch, hashes, self.sim.env.now)

    def _solo(self, slot: int, epoch: int, now: float) -> None:
        st = self.sim.state
        view = RoundView(epoch, st.state_hash[slot], int(st.i["attempt"][slot]) + 1, committed=True, group_size=1)
        policy = self._after_round(slot, view, now)
        if policy.action == "apply":
            self._commit(np.array([slot]), st.delta[[slot]], epoch, f"solo:{slot}:{epoch}", now)
        else:
            self._apply_policy([slot], epoch, policy, now)

    def _account(self, slots: np.ndarray, cost: Transfer) -> None:
        st = self.sim.state
        st.f["bytes_sent"][slots] += cost.sent_bytes
        st.f["bytes_received"][slots] += cost.received_bytes
        self.sim.metrics.round_s.append(cost.duration_s)

    def _commit(self, slots: np.ndarray, averaged: np.ndarray, epoch: int, state_hash, now: float) -> None:
        """Members apply the averaged pseudo-gradient (outer step), move to epoch + 1 and start their next phase."""
        st = self.sim.state
        if len(slots) == 0:
            return
        st.theta[slots] += averaged
        st.f["samples_committed"][slots] += st.f["weight"][slots]
        st.i["epoch"][slots] = epoch + 1
        st.i["attempt"][slots] = 0
        st.f["ready_since"][slots] = 0
        lineage = self.sim.partition.lineage[slots] if self.sim.partition.enabled else None
        forked = lineage is not None and len(np.unique(lineage)) > 1
        for k, slot in enumerate(slots):
            st.state_hash[int(slot)] = state_hash if isinstance(state_hash, str) else state_hash[k]
            if forked:  # members of different lineages hold different parameters after the same outer step
                st.state_hash[int(slot)] += f"/L{int(lineage[k])}"
        self.sim.metrics.record_commit(epoch, now, len(slots), (st.state_hash[int(s)] for s in slots))
        downloading = self.sim.after_commit(slots, epoch + 1, now)
        start = now + self.sim.sc.peers.outer_step_s  # applying the outer step, evaluating
        for slot in slots.tolist():
            if slot not in downloading:
                st.start_phase(slot, epoch + 1, start)

    # ---- failures ------------------------------------------------------------------------------------------------
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

    def fail(self, slots: list[int], epoch: int, failure: str, now: float) -> None:
        """A round failed for ``slots``: one ``decide_after_round`` per group of them that ``sim.sharing`` puts
        together (``share_key``), or its cached answer (``policy_key``)."""
        st = self.sim.state
        self.sim.metrics.count("round_failed." + failure)
        by_view: dict[tuple, list[int]] = defaultdict(list)
        shared = self.shared
        free = shared.free_hashes(epoch, now)
        for slot in slots:
            if st.i["status"][slot] != ABSENT:
                by_view[shared.share_key(slot, now, free, epoch)].append(slot)
        for share, group in by_view.items():
            key = shared.policy_key(share, epoch, failure, now)
            policy = shared.cached(key)
            if policy is None:
                policy = self._after_round(group[0], shared.failed_view(group[0], epoch, failure, now), now)
                shared.store(key, policy)
            else:
                self.sim.metrics.count("after_round." + policy.action)
                self.sim.metrics.count("after_round.cached")
            self.sim.metrics.count("after_round.shared", len(group) - 1)
            self._apply_policy(group, epoch, policy, now)

    def _apply_policy(self, slots: list[int], epoch: int, policy, now: float) -> None:
        st = self.sim.state
        for slot in slots:
            st.i["attempt"][slot] += 1
        if policy.action == "resync" and self.sim.sync.sync_or_download(slots, epoch, st.state_hash[slots[0]], now):
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


def wire_bytes(model_bytes: int, compression: str, codec_block_size: int) -> int:
    """Bytes of a ``model_bytes`` fp32 pseudo-gradient once ``averaging.compression`` encodes it (parts and averaged
    results alike, as ``averaging.allreduce`` sends both), with the production codec sizes (``averaging.codecs``:
    fp16 halves it, int8/int4 add one fp32 scale per ``codec_block_size`` elements). Frame headers are ignored."""
    num_elements = model_bytes // 4
    return payload_num_bytes(compression, num_elements) + scales_num_bytes(
        compression, num_elements, codec_block_size, "fp32"
    )


def state_hash_of(*parts: object) -> str:
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:16]
