"""What a training peer weighs the swarm's records with: the quorum rule, the run's coordinator, and its bans.

``Evidence`` holds the peer's ``SyncTrust`` (``sync_policy``) and grows its ban list: peers whose claims the run's
age rules out (``SyncDecision.ban``) and state donors that served chunks contradicting their own manifest
(``state_fetch``). Everything a peer adopts (an epoch to download, the hash a download must reach, the epoch a
catch-up waits for) goes through ``published_hashes``, so one identity's record is never evidence on its own
(issue 12, item 1; ``hivetrain.peers.quorum``).

Thread-safety: ``trust`` is replaced, never mutated, so readers on other threads (the background round) see a
consistent value.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable

from hivetrain.diloco.sync_policy import SyncTrust, published_hashes
from hivetrain.peers.quorum import SENIORITY_CAP
from hivetrain.peers.records import PeerRecord

logger = logging.getLogger(__name__)


class Evidence:
    """The trust a peer applies to records, and its bans.

    Args:
        my_peer_id: ours (our own record is never evidence for us).
        coordinator_id: the run's coordinator (signer of the run config we trust); "" = none known.
        run_started_at: DHT time (seconds) of the run's epoch 0 as that coordinator publishes it (the run-age bound,
            ``hivetrain.coordinator.run_clock``); None = unknown, no bound.
        exact_average: peers of an epoch hold one state (butterfly); False for moshpit/gossip.
        stale_after_s: records older than this are ignored, seconds.
        now: DHT time, seconds (injectable for tests).
        on_ban: callback(peer_ids, reason) for each new ban (events, logs).
    """

    def __init__(
        self,
        my_peer_id: str,
        coordinator_id: str,
        *,
        run_started_at: float | None = None,
        exact_average: bool,
        stale_after_s: float,
        now: Callable[[], float],
        on_ban: Callable[[list[str], str], None] = lambda peers, reason: None,
    ):
        self.my_peer_id, self.exact_average, self.stale_after_s = my_peer_id, exact_average, stale_after_s
        self.now, self.on_ban = now, on_ban
        self.trust = SyncTrust(coordinator_id=coordinator_id, run_started_at=run_started_at)
        self._closed_without_us: tuple[int, frozenset[str]] = (-1, frozenset())

    def note_closed_without_us(self, epoch: int, members: frozenset[str]) -> None:
        """Matchmaking found our ``epoch``'s group closed without us (``RoundFailed.closed_without_us``: its
        members, peer IDs), or trainers one epoch ahead outweighed our round (``round_policy.went_ahead``): the
        peers whose result ``decide_sync`` follows once they hold it (the latest such set of the newest epoch is
        kept)."""
        if members and epoch >= self._closed_without_us[0]:
            self._closed_without_us = (epoch, frozenset(members))

    def closed_without_us(self, epoch: int) -> frozenset[str]:
        """The members of ``epoch``'s group that closed without us (``note_closed_without_us``), or empty."""
        noted, members = self._closed_without_us
        return members if noted == epoch else frozenset()

    def anchor(self, epoch: int) -> None:
        """We adopted a verified (quorum- or coordinator-backed) state at ``epoch``: move the run's start earlier if
        the bound would not allow it (a stale start from the coordinator must never get honest peers banned)."""
        started = self.trust.run_started_at
        if started is None:
            return
        earliest = self.now() - epoch * self.trust.quorum.min_epoch_s
        if earliest < started:
            logger.info("run start moved %.0f s earlier: the swarm is at epoch %d", started - earliest, epoch)
            self.trust = dataclasses.replace(self.trust, run_started_at=earliest)

    def published_hashes(self, records: Iterable[PeerRecord]) -> dict[int, str]:
        """epoch -> the state hash a quorum of others' live records (or the run's coordinator) backs."""
        others = [r for r in records if r.peer_id != self.my_peer_id]
        return published_hashes(
            others, trust=self.trust, exact_average=self.exact_average, now=self.now(), stale_after_s=self.stale_after_s
        )

    def note_round(self, group: Iterable[str]) -> None:
        """We committed an outer step in one group with ``group`` (peer IDs, ours included or not): each other member
        gains a round of seniority, which weighs its votes in the quorum (``SyncTrust.seniority``); counts stop at
        ``SENIORITY_CAP``, where weights stop growing."""
        others = [p for p in group if p != self.my_peer_id]
        if others:
            seniority = dict(self.trust.seniority)
            for peer in others:
                seniority[peer] = min(seniority.get(peer, 0) + 1, SENIORITY_CAP)
            self.trust = dataclasses.replace(self.trust, seniority=seniority)

    def ban(self, peer_ids: Iterable[str], reason: str) -> None:
        """Ignore these peers' records from now on."""
        new = frozenset(peer_ids) - self.trust.banned - {self.my_peer_id}
        if new:
            logger.warning("ignoring the records of %s from now on: %s", ", ".join(sorted(new)), reason)
            self.trust = dataclasses.replace(self.trust, banned=self.trust.banned | new)
            self.on_ban(sorted(new), reason)
