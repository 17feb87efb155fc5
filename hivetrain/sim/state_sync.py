"""Joiners, state downloads and peers that wait out a round, in the simulated swarm (``DataParallelSim.sync``).

As the trainer does it (``DilocoTrainer.run``): a joiner's first view of the swarm decides whether it downloads
(``diloco.sync_policy.decide_sync``); a peer whose round failed or whose records show it behind downloads from the
holders of the backed state (``download.max_downloaders`` per donor, ``sim.network.download_cost``); a peer that holds
state while its epoch's round is under way without it (``diloco.schedule.round_under_way``) waits for that round and
trains for the next epoch (status WAITING).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hivetrain.diloco.schedule import round_to_wait_for, round_under_way
from hivetrain.diloco.sync_policy import decide_sync
from hivetrain.sim.swarm_state import ABSENT, DOWNLOADING, SYNCING, WAITING

if TYPE_CHECKING:
    from hivetrain.sim.dataparallel import DataParallelSim

GENESIS = "genesis"  # the state hash of θ₀ (every peer builds the same θ₀ from the run's seed)


class StateSync:
    """Joiners' first views, downloads and round waits for a ``DataParallelSim``."""

    def __init__(self, sim: DataParallelSim):
        self.sim = sim

    def first_views(self, now: float) -> None:
        """Joiners whose first heartbeat read is due decide whether to download state (``decide_sync``)."""
        st = self.sim.state
        syncing = st.with_status(SYNCING)
        due = syncing[self.sim.next_publish[syncing] <= now + self.sim.sc.sim.tick_s]
        if len(due) == 0:
            return
        for side_due in self.sim.by_side(due):
            # a joiner holds no state (epoch 0, no hash) and has no record yet: the inputs differ only in its own id
            first = int(side_due[0])
            ttl = self.sim.sc.schedule.record_ttl_s
            d = decide_sync(st.peer_ids[first], 0, "", self.sim.records_for(first), now, ttl, self.sim.exact,
                            trust=self.sim.trust)  # fmt: skip
            self.sim.metrics.count("decide_sync." + d.action)
            if d.action == "download" and d.donors:  # not while the round under way replaces that state
                waited = self._round_to_wait_for(first, 0, now)
                if waited is not None:
                    self._wait(side_due, waited, now)
                    continue
            for slot in side_due:
                if d.action == "download" and d.donors:
                    self.sim.env.process(self._download(int(slot), d.target_epoch, d.donors))
                else:  # no state to download: it trains from θ₀, which the run's seed makes the same everywhere
                    st.state_hash[int(slot)] = GENESIS
                    self.begin_phase(int(slot), 0, now)
                    self.sim.partition.on_fresh_model(int(slot), now)

    def begin_phase(self, slot: int, epoch: int, now: float) -> None:
        """``slot`` holds the state of ``epoch`` and nothing carried (after a download, or θ₀): it starts its phase
        for ``epoch``, or waits while a round is under way without it (``_round_to_wait_for``)."""
        waited = self._round_to_wait_for(slot, epoch, now)
        if waited is None:
            self.sim.state.start_phase(slot, epoch, now)
        else:
            self._wait(np.array([slot]), waited, now)

    def _round_to_wait_for(self, slot: int, epoch: int, now: float) -> int | None:
        """``schedule.round_to_wait_for`` for ``slot`` holding ``epoch`` (as ``round_wait.RoundWait``)."""
        sc = self.sim.sc
        records = self.sim.records_for(slot)
        peer_id = self.sim.state.peer_ids[slot]
        return round_to_wait_for(peer_id, epoch, records, now, sc.schedule.record_ttl_s, sc.averaging.min_group_size)

    def _wait(self, slots: np.ndarray, round_epoch: int, now: float) -> None:
        """``slots`` wait for ``round_epoch``'s round, showing the next epoch's phase with 0 samples and 0 throughput,
        at most ``round_timeout_s`` (``_waiting`` ends it)."""
        st = self.sim.state
        st.i["status"][slots] = WAITING
        st.i["phase_epoch"][slots] = round_epoch + 1
        st.f["phase_start"][slots] = now + self.sim.sc.averaging.round_timeout_s  # the trainer waits at most this long
        self.sim.metrics.count("round_wait", len(slots))
        self.sim.publish_now(slots, now)

    def waiting(self, now: float) -> None:
        """Waiting slots whose round is over (or whose wait reached its bound) download its result if
        ``decide_sync`` says so, else start their phase for the epoch they hold (the round failed: the others
        compute for it again; a joiner holding nothing starts from θ₀). One ``round_under_way`` call per (round,
        side): a waiting peer's own record counts neither way; one ``decide_sync`` per held epoch and state, which
        differ in the caller's own record only."""
        st = self.sim.state
        waiting = st.with_status(WAITING)
        for part in self.sim.by_side(waiting) if len(waiting) else ():
            rounds = st.i["phase_epoch"][part] - 1
            for round_epoch in np.unique(rounds).tolist():
                slots = part[rounds == round_epoch]
                first = int(slots[0])
                over = not round_under_way(st.peer_ids[first], round_epoch, self.sim.records_for(first), now,
                                           self.sim.sc.schedule.record_ttl_s,
                                           self.sim.sc.averaging.min_group_size)  # fmt: skip
                going = slots if over else slots[st.f["phase_start"][slots] <= now]
                by_state: dict[tuple[int, str], list[int]] = {}
                for slot in going.tolist():
                    by_state.setdefault((int(st.i["epoch"][slot]), st.state_hash[slot]), []).append(slot)
                for (epoch, state_hash), group in by_state.items():
                    if self.sync_or_download(group, epoch, state_hash, now):
                        continue
                    for slot in group:
                        if not state_hash:  # a joiner with nothing to download: θ₀, as ``_first_views`` starts it
                            st.state_hash[slot] = GENESIS
                        st.start_phase(slot, epoch, now)

    def sync_or_download(
        self, slots: list[int], epoch: int, state_hash: str, now: float, top: bool = False,
        closed: frozenset[str] = frozenset(),
    ) -> bool:  # fmt: skip
        """Peers at ``epoch`` with state ``state_hash`` (after a failed round, or a commit): download if ``decide_sync``
        says so. ``top``: reuse the answer of an earlier call under ``SharedCalls.top_key`` when there is one;
        ``closed``: the members of the epoch's group that closed without them (``decide_sync``'s
        ``closed_without_us``, as the trainer's ``Evidence`` keeps it)."""
        key = self.sim.rounds.shared.top_key(epoch, now) if top and not closed else None
        d = self.sync_decision(slots, epoch, state_hash, now, key, closed)
        self.sim.metrics.count("decide_sync." + d.action)
        if d.action != "download" or not d.donors:
            return False
        for slot in slots:
            self.sim.env.process(self._download(slot, d.target_epoch, d.donors))
        return True

    def sync_decision(
        self, slots: list[int], epoch: int, state_hash: str, now: float, key: tuple | None = None,
        closed: frozenset[str] = frozenset(),
    ):  # fmt: skip
        """``decide_sync`` for ``slots`` (one call stands for them: ``sim.sharing``), or the answer cached under
        ``key``."""
        tops = self.sim.rounds.shared.tops
        if key is not None and key in tops:
            self.sim.metrics.count("decide_sync.cached")
            return tops[key]
        d = decide_sync(self.sim.state.peer_ids[slots[0]], epoch, state_hash, self.sim.records_for(slots[0]), now,
                        self.sim.sc.schedule.record_ttl_s, self.sim.exact, trust=self.sim.trust,
                        closed_without_us=closed)  # fmt: skip
        if key is not None:
            tops[key] = d
        return d

    def _download(self, slot: int, epoch: int, donors: tuple[str, ...]):
        st, dl = self.sim.state, self.sim.sc.download
        st.i["status"][slot] = DOWNLOADING
        holders = [st.index_of[p] for p in donors if p in st.index_of and st.peer_ids[slot] != p]
        while True:
            # donors at ``max_downloaders`` answer "busy" (``StateServer``): the joiner fetches from the others
            live = [d for d in holders if st.i["status"][d] != ABSENT]
            pool = [d for d in live if not dl.max_downloaders or self.sim.metrics.serving[d] < dl.max_downloaders]
            if pool or not live:
                break
            self.sim.metrics.count("download.all_donors_busy")
            yield self.sim.env.timeout(1.0)  # the trainer looks again a second after a failed download
            if st.i["status"][slot] != DOWNLOADING:
                return  # left meanwhile
        self.sim.rng.shuffle(pool)  # ``state_routing.rank_candidates`` shuffles donors
        pool = pool[: dl.num_donors] if dl.num_donors else pool
        if not pool:
            st.start_phase(slot, int(st.i["epoch"][slot]), self.sim.env.now)
            return
        donor_slots = np.array(pool)
        concurrent = self.sim.metrics.serving[donor_slots] + 1
        cost = self.sim.rounds.download_cost(slot, donor_slots, concurrent)
        busy = donor_slots[cost.sent_bytes > 0]  # the donors it takes chunks from: one stream each (``state_fetch``)
        self.sim.metrics.serving[busy] += 1
        source = int(donor_slots[0])
        theta, hash_, src_epoch = st.theta[source].copy(), st.state_hash[source], int(st.i["epoch"][source])
        started = self.sim.env.now
        cut_s = self.sim.partition.cut_s(np.append(donor_slots, slot), started)
        if cut_s < started + cost.duration_s:  # donors across a split: the fetch fails, the joiner looks again
            yield self.sim.env.timeout(cut_s - started + self.sim.sc.averaging.part_timeout_s)
            self.sim.metrics.serving[busy] -= 1
            self.sim.partition.cut_downloads += 1
            if st.i["status"][slot] == DOWNLOADING:
                st.i["status"][slot] = SYNCING
            return
        yield self.sim.env.timeout(cost.duration_s)
        self.sim.metrics.serving[busy] -= 1
        self.sim.metrics.record_download(
            slot, donor_slots, cost, started, self.sim.env.now, slot in self.sim.metrics.flash_set
        )
        if st.i["status"][slot] != DOWNLOADING:
            return  # left during the download
        st.theta[slot], st.state_hash[slot], st.i["epoch"][slot] = theta, hash_, src_epoch
        st.f["carried_samples"][slot] = 0
        st.i["carried_phases"][slot] = 0
        self.begin_phase(slot, src_epoch, self.sim.env.now)
        self.sim.partition.on_download(slot, source, self.sim.env.now)
        self.sim.publish_now(np.array([slot]), self.sim.env.now)
