"""Probing a claim ahead of us that no quorum backs: the evidence that gets lying identities banned (issue 28).

A trainer does not follow an epoch ahead of it on numbers alone (``sync_policy.decide_sync``: a seniority-weighted
strict majority counting our own vote, or the run's coordinator). That keeps a swarm's honest peers on their state
when fresh identities claim one epoch ahead with a poisoned one, but it leaves the liars in the swarm: nobody ever
downloads what they serve, so nobody holds evidence against them, and every joiner, every coordinator restart and
every honest peer that misses a round weighs their claims again. The probe gathers that evidence. A claim ahead of us
that ``decide_sync`` does not follow and whose holders have all stayed ahead of us for ``settle_s`` (an honest group
that committed without us is followed or joined within a round; see ``probe_target``) is downloaded once, and checked
as an adoption would be (``adoption.StateAdopter``: the hash, the per-epoch step from our θ, the loss on our
windows). A state that fails gets its holders banned; one that passes is not adopted (the quorum rule decides what we
follow), and its holders are vouched for: not probed again for ``vouch_s``.

Cost: one state download and one evaluation per probe: at most one per ``retry_s`` (5 s) while probes fail, one per
``every_s`` (30 s) after one passed. An attacker pays for each failed probe with its identities banned for an hour and
the upload of the state; an honest minority ahead of us costs one probe per ``vouch_s``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from hivetrain.diloco.adoption import Adoption, StateAdopter
from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.sync_policy import SyncDecision, keep_first_seen
from hivetrain.peers.records import PeerRecord


@dataclass(frozen=True)
class ProbeView:
    """What ``probe_target`` weighs besides the records.

    Attributes:
        history: epoch -> the sha256 of the state we held at that epoch (ours included): with butterfly every epoch
            has one committed state, so a claim of another hash at an epoch we held contradicts it.
        banned: peers whose records are ignored.
        ahead_since: peer id -> DHT time (seconds) since which it has been at or ahead of our epoch (``note_ahead``).
        vouched: peer id -> DHT time a probe of its state passed.
        probed: (epoch, sha256) of every state probed already.
        last_probe: DHT time of our last probe (-inf: none yet).
    """

    history: Mapping[int, str] = field(default_factory=dict)
    banned: frozenset[str] = frozenset()
    ahead_since: Mapping[str, float] = field(default_factory=dict)
    vouched: Mapping[str, float] = field(default_factory=dict)
    probed: frozenset[tuple[int, str]] = frozenset()
    last_probe: float = float("-inf")


@dataclass(frozen=True)
class ProbePolicy:
    """When claims are probed (seconds).

    Attributes:
        settle_s: how long every holder must have been at or ahead of our epoch (the trainer: 2 record intervals).
        every_s: the least time between two probes after one that passed (an honest minority ahead of us);
            ``retry_s`` after one that failed: its holders were banned (their colluders may hold the next claim:
            under load, a second liar was not probed within a 20-epoch run at 30 s) or it yielded no evidence (the
            holders moved on or did not answer).
        vouch_s: how long holders whose state passed a probe are not probed again.
        stale_after_s: records older than this are ignored.
    """

    settle_s: float = 10.0
    every_s: float = 30.0
    retry_s: float = 5.0
    vouch_s: float = 600.0
    stale_after_s: float = 30.0


def _live_trainers(
    my_peer_id: str, records: Iterable[PeerRecord], banned: frozenset[str], now: float, stale_after_s: float
) -> list[PeerRecord]:
    return [
        r
        for r in records
        if r.role == "trainer"
        and r.peer_id != my_peer_id
        and r.state_hash
        and not r.left_reason
        and r.peer_id not in banned
        and now - r.updated_at <= stale_after_s
    ]


def contradicts(record: PeerRecord, my_epoch: int, history: Mapping[int, str], exact_average: bool) -> bool:
    """Whether ``record`` claims what we do not hold: an epoch ahead of ours, or (exact averaging) another hash at an
    epoch whose state we held (``history``: epoch -> our sha256 there)."""
    if record.epoch > my_epoch:
        return True
    return exact_average and record.epoch in history and record.state_hash != history[record.epoch]


def note_ahead(
    ahead_since: dict[str, float],
    my_peer_id: str,
    my_epoch: int,
    records: Iterable[PeerRecord],
    now: float,
    stale_after_s: float,
    history: Mapping[int, str] | None = None,
    exact_average: bool = True,
) -> None:
    """Update ``ahead_since`` in place: live trainers at or ahead of ``my_epoch``, or claiming a state we did not hold
    (``contradicts``), keep their first-seen time (DHT seconds) or get ``now``; any other peer is dropped (it starts
    again when it is back). "At or ahead", not "ahead": right after our commit a peer that claims one epoch past its
    own is at ours until its next record, every epoch. "Or contradicting": on a loaded machine such a liar's own epoch
    lags ours by more, so its claim falls behind us at times (a 20-epoch run beside 2 hogs probed it only at epoch
    19); its claim still names a hash we did not hold there."""
    live = _live_trainers(my_peer_id, records, frozenset(), now, stale_after_s)
    known = history or {}
    level = {r.peer_id for r in live if r.epoch >= my_epoch or contradicts(r, my_epoch, known, exact_average)}
    keep_first_seen(ahead_since, level, now)


def probe_target(
    my_peer_id: str,
    my_epoch: int,
    my_hash: str,
    records: Iterable[PeerRecord],
    view: ProbeView,
    now: float,
    policy: ProbePolicy = ProbePolicy(),
    exact_average: bool = True,
) -> SyncDecision | None:
    """The claim to probe now, as a "download" decision for ``StateAdopter.adopt`` (whose state the caller checks and
    does not adopt), or None. Call it only when ``decide_sync`` said "train": no claim is followed then (a quorum that
    backs one without our vote, as ``published_hashes`` counts, does not with it).

    A claim is a live trainer's (epoch, hash) ahead of ``my_epoch``, or with exact (butterfly) averaging at an epoch we
    held (``view.history``, ours included as ``my_hash``) with another hash: a peer claiming one epoch past its own
    is at ours, with its lie, from our commit until its next record, and behind us while its own epoch lags. The
    newest epoch claimed is taken; of several hashes there the most held (ties to
    the larger hash). It is probed when it was not probed before, no holder is vouched for, every holder has been at
    or ahead of our epoch for ``policy.settle_s`` (``note_ahead``), and our last probe is ``policy.every_s`` old.
    """
    if now - view.last_probe < policy.every_s:
        return None
    history = {**view.history, my_epoch: my_hash}
    claims = [
        r
        for r in _live_trainers(my_peer_id, records, view.banned, now, policy.stale_after_s)
        if contradicts(r, my_epoch, history, exact_average)
    ]
    if not claims:
        return None
    newest = max(r.epoch for r in claims)
    counts = Counter(r.state_hash for r in claims if r.epoch == newest)
    state_hash, _ = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
    if (newest, state_hash) in view.probed:
        return None
    holders = tuple(sorted(r.peer_id for r in claims if r.epoch == newest and r.state_hash == state_hash))
    if any(now - view.vouched.get(p, float("-inf")) < policy.vouch_s for p in holders):
        return None
    if any(now - view.ahead_since.get(p, now) < policy.settle_s for p in holders):
        return None
    where = f"ahead of our epoch {my_epoch}" if newest > my_epoch else f"where we held {history[newest][:12]}"
    why = (
        f"probe: {len(holders)} trainer(s) claim epoch {newest} ({state_hash[:12]}) {where}, not followed for "
        f"{policy.settle_s:.0f}s or more: checking what they serve"
    )
    return SyncDecision("download", newest, holders, why, state_hash=state_hash, probe=True)


@dataclass(frozen=True)
class ProbeResult:
    """One probe: ``decision`` names the claim; ``adoption`` is what ``StateAdopter.adopt`` made of it (its ``bans``
    are the caller's to apply; its state, if it passed, is not adopted)."""

    decision: SyncDecision
    adoption: Adoption

    @property
    def passed(self) -> bool:
        return self.adoption.state is not None


class Prober:
    """Keeps what ``probe_target`` needs between calls and runs the probe it names (module docstring).

    Args:
        my_peer_id: ours (our own record is never probed).
        adopter: downloads and checks the claimed state as an adoption would.
        policy: the probe's timing.
        exact_average: butterfly averaging (claims of another hash at an epoch we held are probed too).
    """

    def __init__(self, my_peer_id: str, adopter: StateAdopter, policy: ProbePolicy, exact_average: bool = True):
        self.my_peer_id, self.adopter, self.policy = my_peer_id, adopter, policy
        self.exact_average = exact_average
        self._ahead_since: dict[str, float] = {}
        self._vouched: dict[str, float] = {}
        self._probed: set[tuple[int, str]] = set()
        self._refuted: dict[tuple[int, str], str] = {}  # (epoch, sha256) a probe refused -> why
        self._last_probe = float("-inf")

    def maybe_probe(
        self,
        records: list[PeerRecord],
        ours: TrainingState,
        ours_hash: str,
        banned: frozenset[str],
        now: float,
        history: Mapping[int, str] | None = None,
    ) -> ProbeResult | None:
        """Probe the claim ``probe_target`` names now, if any (a download and an evaluation: seconds for a big model).

        Args:
            records: the swarm's records, as read for a ``decide_sync`` that said "train".
            ours: our state (the step check's reference and the layout of the download); ``ours_hash`` its sha256.
            banned: peers we ignore.
            now: DHT time, seconds.
            history: epoch -> the sha256 of the state we held there (``TrainerStats.state_hashes``).

        Returns:
            None if nothing is to be probed; else the result, whose bans the caller applies. Never raises for a
            holder's fault (a failed download is a result without a state, and its claim is not probed again). A
            live trainer claiming a state a probe refused is banned without a download (a result without a state).
        """
        known = {**(history or {}), ours.epoch: ours_hash}
        note_ahead(self._ahead_since, self.my_peer_id, ours.epoch, records, now, self.policy.stale_after_s, known,
                   self.exact_average)  # fmt: skip
        oldest = min(known, default=ours.epoch)
        self._probed = {p for p in self._probed if p[0] >= oldest}
        self._refuted = {p: why for p, why in self._refuted.items() if p[0] >= oldest}
        caught = self._holders_of_refuted(records, banned, now)
        if caught is not None:
            return caught
        self._vouched = {p: t for p, t in self._vouched.items() if now - t < self.policy.vouch_s}
        view = ProbeView(
            history=known,
            banned=banned,
            ahead_since=self._ahead_since,
            vouched=self._vouched,
            probed=frozenset(self._probed),
            last_probe=self._last_probe,
        )
        decision = probe_target(
            self.my_peer_id, ours.epoch, ours_hash, records, view, now, self.policy, self.exact_average
        )
        if decision is None:
            return None
        self._last_probe = now
        self._probed.add((decision.target_epoch, decision.state_hash))
        adoption = self.adopter.adopt(decision, records, ours, {self.my_peer_id, *decision.donors, *banned})
        if adoption.state is not None:
            self._vouched.update(dict.fromkeys(decision.donors, now))
        else:  # a liar caught (its colluders may claim the next epoch by now) or no evidence: the next claim sooner
            self._last_probe = now - self.policy.every_s + self.policy.retry_s
            if any(set(peers) & set(decision.donors) for peers, _ in adoption.bans):  # refused, not just unavailable
                self._refuted[(decision.target_epoch, decision.state_hash)] = adoption.failure
        return ProbeResult(decision, adoption)

    def _holders_of_refuted(self, records: list[PeerRecord], banned: frozenset[str], now: float) -> ProbeResult | None:
        """Live trainers, not banned yet, that claim a state a probe of ours refused: a sha256 names its bytes, so the
        claim is the evidence (a colluder whose record was not live when its partner was probed, chaos
        ahead-liars-2v2 on an idle machine). Banned without a download."""
        claims = [
            r
            for r in _live_trainers(self.my_peer_id, records, banned, now, self.policy.stale_after_s)
            if (r.epoch, r.state_hash) in self._refuted
        ]
        if not claims:
            return None
        epoch, state_hash = claims[0].epoch, claims[0].state_hash
        why = self._refuted[(epoch, state_hash)]
        holders = tuple(sorted(r.peer_id for r in claims if (r.epoch, r.state_hash) == (epoch, state_hash)))
        reason = f"claims the state of epoch {epoch} ({state_hash[:12]}) a probe refused: {why}"
        decision = SyncDecision(
            "download", epoch, holders, f"probe: {len(holders)} trainer(s) {reason}", state_hash=state_hash, probe=True
        )
        return ProbeResult(decision, Adoption(None, reason, ((holders, reason),)))
