"""The averaging processes of the simulated swarm's declared groups: what one butterfly group, the two-stage grid
(``sim.grid``) and Moshpit/gossip rounds cost and who commits, as SimPy processes (``RoundEngine`` starts them once a
declaration forms; failures go back to it, through ``diloco.round_policy.decide_after_round``).

One butterfly group and the grid follow ``averaging.allreduce`` and ``averaging.hierarchical`` (durations from
``sim.network``, pseudo-gradients averaged with ``sim.consensus.group_means``); members commit the same outer step and
move to the next epoch (``_commit``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING

import numpy as np

from hivetrain.averaging.agreement import quorate
from hivetrain.averaging.groups import UPLOAD_SAMPLE_BUFFERS, gossip_pairs, grid_for, moshpit_groups
from hivetrain.averaging.matchmaking import EpochGroups, GroupDeclaration, rival_groups
from hivetrain.diloco.round_policy import RoundView, group_holds_the_epoch, went_ahead
from hivetrain.diloco.sync_policy import SyncTrust
from hivetrain.sim.consensus import group_means
from hivetrain.sim.grid import grid_round
from hivetrain.sim.network import Transfer, allreduce_cost, two_stage_cost, two_stage_stages
from hivetrain.sim.swarm_state import ABSENT, AVERAGING

if TYPE_CHECKING:
    from hivetrain.sim.rounds import RoundEngine

PREFIX = "sim.avg"  # the simulated averagers' DHT prefix (moshpit/gossip groups and round ids derive from it)


def state_hash_of(*parts: object) -> str:
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:16]


class GroupRounds:
    """The processes of declared groups, for ``RoundEngine`` (which owns matchmaking, failures and retries)."""

    def __init__(self, engine: RoundEngine):
        self.engine, self.sim, self.avg, self.wire_bytes = engine, engine.sim, engine.avg, engine.wire_bytes
        # production cuts a round by its members' measured upload rates once rounds send enough to measure them
        # (``averaging.bandwidth_slices``; a declared ``upload_mbps`` is one value for every simulated peer: equal cuts)
        measured = self.avg.bandwidth_slices and self.avg.upload_mbps == 0
        buffer = max(self.avg.socket_buffer_bytes, 1 << 20)
        self.rate_sample_bytes = UPLOAD_SAMPLE_BUFFERS * buffer if measured else 0
        self.rounds_accepted = 0  # the last ``SwarmState.rounds_with`` token given out

    def cost(self, slots: np.ndarray, round_id: str | None = None) -> Transfer:
        """One butterfly round among ``slots``; with ``round_id``, the two-stage round of that declaration (one
        butterfly round when they fit one group)."""
        st = self.sim.state
        ids = [st.peer_ids[int(s)] for s in slots]
        links = (st.f["up_bps"][slots], st.f["down_bps"][slots], st.f["latency_s"][slots])
        if round_id is None:
            return allreduce_cost(ids, self.wire_bytes, *links, self.rate_sample_bytes)
        cut = (self.avg.target_group_size, round_id, self.rate_sample_bytes)
        return two_stage_cost(ids, self.wire_bytes, *links, *cut)

    def goes_on_without(self, left: int, declared: int) -> bool:
        """Whether ``left`` of ``declared`` members of one butterfly group go on without the others
        (``agreement.quorate`` with ``averaging.drop_failed``); the grid's tolerance is ``grid`` (``sim.grid``),
        and moshpit stays all-or-nothing."""
        tolerant = self.avg.drop_failed and self.avg.exact_average and declared <= self.avg.target_group_size
        return tolerant and quorate(left, declared, self.avg.min_group_size)

    def tolerant_grid(self, declared: int) -> bool:
        """Whether a declaration of ``declared`` members runs the tolerant two-stage round (``sim.grid``)."""
        avg = self.avg
        return avg.exact_average and avg.drop_failed and declared > avg.target_group_size

    def grid(self, slots: np.ndarray, present: np.ndarray, decl: GroupDeclaration, epoch: int, now: float):
        """The tolerant two-stage round (``averaging.hierarchical`` with ``drop_failed``; ``sim.grid``): members
        gone at the declaration and those that leave mid-round are dropped from their rows, the row-mates of a
        failed column fetch the result, and the others commit one state in the same attempt."""
        st = self.sim.state
        ids = [st.peer_ids[int(s)] for s in slots]
        links = (st.f["up_bps"][slots], st.f["down_bps"][slots], st.f["latency_s"][slots])
        stages = two_stage_stages(ids, self.wire_bytes, *links, self.avg.target_group_size, decl.round_id,
                                  self.rate_sample_bytes)  # fmt: skip
        assert stages is not None
        deadlines = st.f["ready_since"][slots] + self.avg.round_timeout_s
        leaves = np.where(present, np.minimum(st.f["leaves_at"][slots], deadlines), now)
        fp32 = self.sim.sc.sim.model_bytes

        def fetch(source: int, fetchers: list[int]) -> Transfer:
            idx = np.array([source, *fetchers])
            return allreduce_cost([ids[i] for i in idx], fp32, *(x[idx] for x in links))

        out = grid_round(stages, leaves, now, part_timeout_s=self.avg.part_timeout_s,
                         connect_grace_s=min(1.0, self.avg.connect_timeout_s),
                         quorate=lambda left, declared: quorate(left, declared, self.avg.min_group_size),
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
                # the round's result is checked once, when its first row commits: every member's ``accept`` sees
                # the same contributors (a refusal fails the round on every member)
                live = [int(s) for s in slots if st.i["status"][int(s)] == AVERAGING]
                if not self.holds_the_epoch(kept, epoch, waiting=np.array(live, np.int64), decl=decl):
                    return
                # members that left after their row committed: their pseudo-gradient is in the mean the swarm keeps
                gone = kept[st.i["status"][kept] == ABSENT]
                st.f["samples_committed"][gone] += st.f["weight"][gone]
                self.sim.metrics.regain("left during its round", float(st.f["weight"][gone].sum()))
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
                    self.engine.fail([int(slots[k]) for k in live], epoch, why, self.sim.env.now)

    def butterfly(self, slots: np.ndarray, decl: GroupDeclaration, epoch: int, now: float, declared: int = 0):
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
        cost = self.cost(slots, decl.round_id)
        # members declared but gone: the others give up on their links at the connect deadline, then go on
        finish = now + cost.duration_s + (self.avg.connect_timeout_s if declared > len(slots) else 0.0)
        # a member whose call reaches its deadline (``round_timeout_s`` after its first attempt) leaves the round
        # then, as one that departs does (``averaging.engine``: the deadline bounds the whole call)
        deadlines = st.f["ready_since"][slots] + self.avg.round_timeout_s
        leaves = np.minimum(st.f["leaves_at"][slots], deadlines)
        cut = self.sim.partition.cut_s(slots, now)
        alive = np.ones(len(slots), bool)
        resent = 0  # slices reduced again and sent once more, after a member was lost during the gather
        if self.goes_on_without(len(slots), declared) and cut >= finish:
            scatter_end = finish - cost.duration_s / 2
            for k in np.argsort(leaves, kind="stable"):
                if leaves[k] >= finish or not self.goes_on_without(int(alive.sum()) - 1, declared):
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
                    self.engine._fail_after([int(slots[k])], epoch, "timeout", max(0.0, float(deadlines[k]) - now))
                )
        first_gone = min(float(leaves[alive].min()), cut)
        if first_gone < finish:  # all-or-nothing: the others notice the silence after part_timeout_s
            self.sim.partition.cut_groups += int(cut < float(leaves[alive].min()))
            timed_out = float(deadlines[alive].min()) <= first_gone
            yield self.sim.env.timeout(max(0.0, first_gone - now + self.avg.part_timeout_s * (not timed_out)))
            failing = [int(s) for s in slots if st.i["status"][s] == AVERAGING]
            self.engine.fail(failing, epoch, "timeout" if timed_out else "member died", self.sim.env.now)
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
        if not self.holds_the_epoch(kept, epoch, decl=decl):
            return
        held = [st.state_hash[int(s)] for s in kept]
        hashes = decl.round_id if len(set(held)) == 1 else [state_hash_of(decl.round_id, h) for h in held]
        self._commit(kept, avg, epoch, hashes, self.sim.env.now)

    def mixing(self, slots: np.ndarray, decl: GroupDeclaration, epoch: int, now: float):
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
                cost = self.cost(slots[idx])
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
            self.engine.fail(failed, epoch, "no mixing round committed", self.sim.env.now)

    def _commit_later(self, slots, averaged, epoch, round_id, final_group, when):
        yield self.sim.env.timeout(max(when - self.sim.env.now, 0.0))
        keep = self.sim.state.i["status"][slots] == AVERAGING
        hashes = [f"{round_id}:{g}" for g in final_group[keep]]
        self._commit(slots[keep], averaged[keep], epoch, hashes, self.sim.env.now)

    def holds_the_epoch(
        self, contributors: np.ndarray, epoch: int, waiting: np.ndarray | None = None,
        decl: GroupDeclaration | None = None,
    ) -> bool:  # fmt: skip
        """Production's ``accept`` (``diloco.rounds.RoundRunner._accept``): a result of several contributors is
        applied only if they outweigh the live trainers of their epoch (or one past it) outside the round
        (``round_policy.group_holds_the_epoch``, read from a member's records). Each trainer is weighed as that
        member weighs it: by the rounds the two accepted together (``SwarmState.rounds_with``; production counts
        them in ``diloco.evidence.note_round``), so a joiner that never averaged with the member weighs nothing once
        the member has averaged with anyone, and a member that has not yet counts heads. Refused, the round fails on
        every member still in it (``waiting``, default the contributors) and they decide what next
        (``decide_after_round``, which follows the result of the trainers ahead: ``went_ahead``). Accepted, every
        contributor gains the round in ``rounds_with``. ``decl``: the round's declaration, whose live rivals at its
        key (``matchmaking.rival_groups``) it may outrank (``matchmaking.EpochGroups``), as the engine passes them.
        Returns whether the result may be applied."""
        if len(contributors) < 2:
            return True
        st = self.sim.state
        me = int(contributors[0])
        records = self.sim.records_for(me)
        groups = None
        if decl is not None:
            key = self.engine.keys[epoch]
            rivals = rival_groups(decl, key.entries.values(), key.declarations, self.sim.env.now,
                                  self.avg.round_timeout_s, **self.engine.over_rules)  # fmt: skip
            groups = EpochGroups(frozenset(decl.member_ids()), rivals)
        ok, _ = group_holds_the_epoch(
            st.peer_ids[me], epoch, [st.peer_ids[int(s)] for s in contributors], records,
            self.sim.env.now, self.sim.sc.schedule.stale_after_s, self._trust_of(me, records, contributors),
            epoch_groups=groups,
        )  # fmt: skip
        if ok:
            self.rounds_accepted += 1
            for s in contributors.tolist():
                st.rounds_with[int(s)].add(self.rounds_accepted)
            return True
        self.sim.metrics.count("round.refused_outweighed")
        waiting = contributors if waiting is None else waiting
        failing = [int(s) for s in waiting if st.i["status"][int(s)] == AVERAGING]
        ids = [st.peer_ids[int(s)] for s in contributors]
        ahead = went_ahead(epoch, ids, records, self.sim.env.now, self.sim.sc.schedule.stale_after_s)
        ahead = ahead.union(*(groups.ahead() if groups is not None else ()))  # and the declarations outranking ours
        self.engine.fail(failing, epoch, "outweighed", self.sim.env.now, ahead)
        return False

    def _trust_of(self, me: int, records: list, contributors: np.ndarray) -> SyncTrust:
        """The sim's trust (``dataparallel``) with ``me``'s seniority toward the peers of ``records`` and
        ``contributors``: the rounds each accepted together with ``me`` (``SwarmState.rounds_with``)."""
        st = self.sim.state
        mine = st.rounds_with[me]
        if not mine:
            return self.sim.trust
        slots = {st.index_of[r.peer_id] for r in records} | set(contributors.tolist())
        seniority = {st.peer_ids[s]: n for s in slots if s != me and (n := len(mine & st.rounds_with[s]))}
        return dataclasses.replace(self.sim.trust, seniority=seniority)

    def solo(self, slot: int, epoch: int, now: float) -> None:
        st = self.sim.state
        view = RoundView(epoch, st.state_hash[slot], int(st.i["attempt"][slot]) + 1, committed=True, group_size=1)
        policy = self.engine._after_round(slot, view, now)
        if policy.action == "apply":
            self._commit(np.array([slot]), st.delta[[slot]], epoch, f"solo:{slot}:{epoch}", now)
        else:
            self.engine._apply_policy([slot], epoch, policy, now)

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
