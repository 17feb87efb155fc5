"""Which failed peers of the simulated swarm may share one ``decide_after_round`` call, and its cache across ticks.

``decide_after_round`` (``diloco.sync_policy``) is O(N) in the records: at 10,000 peers a late storm otherwise costs
one such call per peer per retry, most of the simulator's time. The function is pure, so a call whose answer is
provably the same for several peers is made once: ``share_key`` puts together peers whose inputs differ only where
the function cannot tell them apart, ``policy_key`` extends that across times while the DHT's records are unchanged.
``tests/sim/test_sharing.py`` compares shared and cached answers with individual calls on churned runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from hivetrain.diloco.round_policy import RoundPolicy, RoundView
from hivetrain.diloco.sync_policy import SyncDecision

if TYPE_CHECKING:
    from hivetrain.sim.dataparallel import DataParallelSim

HashTest = Callable[[str], bool]


def _every_hash(state_hash: str) -> bool:
    return True


class SharedCalls:
    """``share_key`` / ``commit_key`` / ``policy_key`` / ``top_key`` for one ``DataParallelSim``, and the answers cached
    under ``policy_key`` (dropped when the board changes) and ``top_key`` (``tops``: kept)."""

    def __init__(self, sim: DataParallelSim):
        self.sim = sim
        self._policies: dict[tuple, RoundPolicy] = {}  # ``policy_key`` -> decide_after_round's answer
        self.tops: dict[tuple, SyncDecision] = {}  # ``top_key`` -> decide_sync's answer (kept: the key says it all)
        self._version = -1  # the board version ``_policies`` holds answers for

    def cached(self, key: tuple) -> RoundPolicy | None:
        """The ``decide_after_round`` answer stored under a ``policy_key``, if any."""
        return self._policies.get(key)

    def store(self, key: tuple, policy: RoundPolicy) -> None:
        self._policies[key] = policy

    def top_key(self, epoch: int, now: float) -> tuple | None:
        """A key under which every post-commit ``decide_sync`` at ``epoch`` has one answer, or None.

        ``decide_sync`` downloads only for a state backed at our epoch or a newer one (behind, forked) and its reason
        names only newer epochs; the simulation has no coordinator records and no run-age bound. When no live record
        (within ``record_ttl_s``, the download's staleness) is past ``epoch`` and no state can be backed at
        ``epoch`` whatever the caller's vote (``free_hashes`` clears every hash), nothing it reads differs between
        callers: the answer is one for the epoch, whoever asks and whatever else the records hold.
        """
        sim = self.sim
        ttl = sim.sc.schedule.record_ttl_s
        if sim.views is not None or sim.trust.coordinator_id or sim.trust.run_started_at is not None:
            return None
        board = sim.board
        live = board.published & (now - board.cols["updated_at"] <= ttl)
        if (
            int(board.cols["epoch"][live].max(initial=0)) > epoch
            or self.free_hashes(epoch, now, ttl) is not _every_hash
        ):
            return None
        return ("top", epoch)

    def policy_key(self, share: tuple, epoch: int, failure: object, now: float) -> tuple:
        """Failed peers with equal keys get the same ``decide_after_round`` answer, also at different times.

        ``decide_after_round`` reads ``now`` only through records' liveness (``now - updated_at <= stale_after_s``)
        and the view's ``time_left_s > 0`` (in ``share_key``); it reads no clock otherwise. Within one board version
        (no record published or expired) the records are fixed and live ones only go stale as time passes, so the
        number of live records tells the live set: equal keys mean equal inputs but the caller's id (``share_key``).
        The cache is dropped when the board changes.
        """
        board = self.sim.board
        if board.version != self._version:
            self._policies.clear()
            self._version = board.version
        return (board.num_live(now, self.sim.sc.schedule.stale_after_s), share, epoch, failure)

    def failed_view(
        self, slot: int, epoch: int, failure: str, now: float, closed: frozenset[str] = frozenset()
    ) -> RoundView:
        """What ``slot`` knows after a failed attempt at ``epoch`` (``closed``: the members of the epoch's group
        that closed without it)."""
        st = self.sim.state
        deadline = float(st.f["ready_since"][slot]) + self.sim.sc.averaging.round_timeout_s
        return RoundView(epoch, st.state_hash[slot], int(st.i["attempt"][slot]) + 1, committed=False,
                         failure=failure, time_left_s=deadline - now, closed_without_us=closed)  # fmt: skip

    def share_key(self, slot: int, now: float, free: HashTest | None = None, epoch: int = -1) -> tuple:
        """Failed peers with equal keys get the same ``decide_after_round`` answer, so one call stands for them.

        The policy reads of the caller: its view (state hash, attempt; ``time_left_s`` only as "> 0"), and the
        swarm's records without its own (``decide_sync``, ``may_commit_alone`` exclude the caller's id). Peers whose
        own records agree in every field those functions read (epoch, phase epoch, state, liveness) therefore see
        the same records but for an id: the same votes, the same counts.

        ``free`` (from ``free_hashes`` at the round's ``epoch``): state hashes that change nothing in the answer,
        whether they are the caller's vote or its own record's at ``epoch``; they are keyed as "*". Butterfly groups
        of 16 among 10,000 peers each commit their own hash: without this, a late storm split into one call per
        group's hash.
        """
        st, board = self.sim.state, self.sim.board
        left = float(st.f["ready_since"][slot]) + self.sim.sc.averaging.round_timeout_s - now > 0
        own: tuple = ()
        if board.published[slot]:
            live = now - board.cols["updated_at"][slot] <= self.sim.sc.schedule.stale_after_s
            own_epoch, own_hash = int(board.cols["epoch"][slot]), board.state_hash[slot]
            if free is not None and own_epoch == epoch and own_hash and free(own_hash):
                own_hash = "*"
            own = (bool(live), own_epoch, int(board.cols["phase_epoch"][slot]), own_hash)
        mine = st.state_hash[slot]
        if free is not None and mine and free(mine):
            mine = "*"
        side = -1 if self.sim.views is None else int(self.sim.partition.side[slot])  # views differ per side
        return (mine, int(st.i["attempt"][slot]), left, own, side)

    def commit_key(self, slot: int, now: float, free: HashTest | None) -> tuple:
        """Members of groups that just committed with equal keys get the same post-commit ``decide_sync`` answer.

        The caller votes at the new epoch with its new state and excludes its own record, which is still at the old
        epoch (``after_commit`` reads the records before the group's own are republished). ``decide_sync`` reads
        nothing of an epoch older than the caller's (no "behind" or "fork" there, no reason names it) but the counts
        of voters, which that record's liveness and epoch tell; its own hash only where ``free`` does not clear it.
        """
        st, board = self.sim.state, self.sim.board
        own: tuple = ()
        if board.published[slot]:
            live = now - board.cols["updated_at"][slot] <= self.sim.sc.schedule.record_ttl_s
            own_epoch = int(board.cols["epoch"][slot])
            own_hash = board.state_hash[slot] if own_epoch >= int(st.i["epoch"][slot]) else "*"
            own = (bool(live), own_epoch, int(board.cols["phase_epoch"][slot]), own_hash)
        mine = st.state_hash[slot]
        side = -1 if self.sim.views is None else int(self.sim.partition.side[slot])
        return ("*" if free is not None and mine and free(mine) else mine, int(st.i["epoch"][slot]), own, side)

    def free_hashes(self, epoch: int, now: float, stale_s: float | None = None) -> HashTest | None:
        """The state hashes at ``epoch`` that no caller's vote or own record can make matter, or None (all matter).

        ``backed_states`` (``peers.quorum``) reads a caller's hash at ``epoch`` only through the counts of each hash
        there, and ``decide_sync`` compares it with the state backed there (the fork check). A caller adds its vote
        (one more for its hash) and excludes its own record (one fewer), so when, in every view the policy reads
        (its records' staleness, and a resync's download's), the most common hash plus one is at most
        ``min_fraction`` of the voters at ``epoch``, no state of that epoch can be backed whatever the caller's
        hash: every hash is free (``backed_states`` counts it at that epoch alone, which stays unbacked, so
        ``decide_sync`` finds no fork there and its reasons do not name it).

        Only for exact averaging, and not while the network is split (each side votes on its own records).
        """
        sim = self.sim
        if not sim.exact or sim.views is not None:
            return None
        board, schedule, quorum = sim.board, sim.sc.schedule, sim.trust.quorum
        views = {schedule.stale_after_s, schedule.record_ttl_s} if stale_s is None else {stale_s}
        for stale_s in views:  # after_round's, and a resync's download (or only the one given)
            live = board.published & (now - board.cols["updated_at"] <= stale_s)
            at = np.flatnonzero(live & (board.cols["epoch"] == epoch)).tolist()
            counts = Counter(h for h in (board.state_hash[s] for s in at) if h)
            if max(counts.values(), default=0) + 1 > quorum.min_fraction * sum(counts.values()):
                return None
        return _every_hash
