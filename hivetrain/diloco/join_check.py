"""Checking a state a moshpit/gossip peer downloads against the θ sketches of the epoch's other peers.

With moshpit or gossip groups no two peers of an epoch hold one state, so the hash quorum that guards butterfly
downloads cannot vouch for a donor (``diloco.sync_policy.decide_sync`` names the epoch's largest hash). What does is
the θ count sketches (``drift.ParamSketcher``) the epoch's other peers publish in their records a few seconds after
their commit: ``drift.sketch_outlier`` refuses a θ far from them. ``JoinCheck`` holds what the trainer must remember for
it (when it began waiting for an epoch's sketches, and which refusal is unsettled); the decisions are the pure
functions below and ``drift.sketch_outlier``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hivetrain.diloco.drift import epoch_sketches, sketch_outlier
from hivetrain.peers.records import PeerRecord


def wait_for_sketches(num_others: int, num_published: int, waited_s: float, max_wait_s: float) -> bool:
    """Should a joiner wait before downloading and checking a state (``sketch_outlier``)? Yes while fewer than
    min(3, ``num_others``) of the other trainers at the state's epoch or one behind it (committing it; donors and
    banned peers left out) have
    published their θ sketch, for at most ``max_wait_s`` seconds (``waited_s`` since the first wait at that epoch):
    honest peers publish a few seconds after their commit, so one that has not by then withholds its sketch, and the
    check runs on those there are."""
    return num_published < min(3, num_others) and waited_s <= max_wait_s


def may_ban_refused_donor(num_published: int) -> bool:
    """May a donor whose state ``sketch_outlier`` refused be banned, with ``num_published`` sketches as evidence?
    Only from 2 on: a refusal on 2 means both publishers contradicted it, which one liar among the donor and the two
    publishers cannot bring about against an honest donor; with 1, the publisher may be the liar (the joiner then
    retries, and joins once a second sketch of the epoch agrees with a donor)."""
    return num_published >= 2


@dataclass(frozen=True)
class JoinVerdict:
    """``refused``: why the downloaded θ is not adopted ("" = adopt it); ``ban_donors``: whether the evidence is enough
    to ban the donors for it (``may_ban_refused_donor``)."""

    refused: str
    ban_donors: bool


class JoinCheck:
    """When a downloaded state of an epoch may be checked, and whether it passes.

    Args:
        max_wait_s: the longest a download waits for min(3, others) sketches of one epoch, seconds (the trainer passes
            the record TTL: a peer that has not published its sketch by then withholds it).
    """

    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s
        self._waiting: tuple[int, float] = (-1, 0.0)  # (epoch, monotonic s) of the first wait for its sketches
        self._unsettled: tuple[int, frozenset[str], int] | None = None  # (epoch, donors, sketches) of a refusal

    def ready(
        self, records: Sequence[PeerRecord], epoch: int, donors: Sequence[str], exclude: set[str], now: float
    ) -> tuple[bool, str]:
        """May a state of ``epoch`` from ``donors`` be downloaded and checked at ``now`` (monotonic seconds)? Returns
        (ready, note): the note says how many of the epoch's other trainers published a sketch when it waits or gives
        up waiting. After a refusal that banned nobody (one sketch against the donor) the same donors are not asked
        again for that epoch until another sketch of it is out: the answer could only be the same."""
        # the epoch's other trainers, and those one epoch behind: they are committing it and publish its sketch
        # seconds later (a joiner started 0.3 s after the first commit saw only a liar's record at the epoch, found
        # no sketch to compare, and adopted its random weights: chaos moshpit-hash-liar, 2026-11-30)
        at = {
            r.peer_id for r in records if r.role == "trainer" and r.epoch in (epoch - 1, epoch) and not r.left_reason
        } - exclude
        published = len(epoch_sketches(records, epoch, exclude))
        if self._unsettled is not None and self._unsettled[:2] == (epoch, frozenset(donors)):
            if published <= self._unsettled[2]:
                return False, f"waiting for a second θ sketch of epoch {epoch}: its only one contradicts the donor"
        if self._waiting[0] != epoch:
            self._waiting = (epoch, now)
        note = f"{published} of {len(at)} other peers at or committing epoch {epoch} published a θ sketch"
        if wait_for_sketches(len(at), published, now - self._waiting[1], self.max_wait_s):
            return False, note
        return True, note if published < min(3, len(at)) else ""

    def verdict(
        self,
        candidate: torch.Tensor,
        records: Sequence[PeerRecord],
        epoch: int,
        donors: Sequence[str],
        exclude: set[str],
    ) -> JoinVerdict:
        """Judge the sketch ``candidate`` (shape ``(SKETCH_SIZE,)``) of a downloaded θ of ``epoch`` served by
        ``donors`` against the sketches the epoch's trainers outside ``exclude`` (us, the donors, banned peers)
        published."""
        sketches = epoch_sketches(records, epoch, exclude)
        refused = sketch_outlier(candidate, sketches)
        ban = bool(refused) and may_ban_refused_donor(len(sketches))
        self._unsettled = (epoch, frozenset(donors), len(sketches)) if refused and not ban else None
        return JoinVerdict(refused, ban)
