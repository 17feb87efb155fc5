"""Pure decisions about a peer's place in the swarm: is it behind, is its state forked, may it average alone?

Functions of the records peers published, our own state, a ``SyncTrust`` and ``now``; no I/O. The trainer calls them
between phases, the coordinator's follower to follow the run.

A state is adopted on evidence, not on one claim (issue 12: one signed record claiming epoch 10^9 took over every
honest peer, the coordinator and a joiner in 3.5 s). The evidence is either a quorum of live peers
(``hivetrain.peers.quorum.backed_states``: by default 2 distinct peers and a strict majority) or the signed record of
the run's known coordinator, which follows committed steps under the quorum rule itself and trains nothing. A record
with the coordinator role from any other identity is ignored. Claims past what the run's age allows are dropped and
their senders returned for banning.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from hivetrain.peers.quorum import (
    Backing,
    QuorumConfig,
    Vote,
    backed_states,
    implausible,
    max_plausible_epoch,
    seniority_weights,
)
from hivetrain.peers.records import PeerRecord, live_records

Action = Literal["train", "download"]


@dataclass(frozen=True)
class SyncTrust:
    """What a peer weighs the swarm's records with, besides the records themselves.

    Args:
        quorum: the quorum rule's thresholds (the run's, so every peer applies the same).
        coordinator_id: base58 peer ID of the run's coordinator: the signer of the run config record this peer
            trusts (``RunConfigRecord.coordinator_id``, signed by an ID from the bootstrap addresses). "" = none
            known: records with the coordinator role are then ignored, never trusted.
        run_started_at: DHT time (unix seconds) of the run's epoch 0; None = unknown (no run-age bound). It must
            never be later than the truth (a coordinator restart must not reset it): honest epochs would then look
            implausible, though a claim a quorum backs is never banned.
        banned: peer IDs whose records are ignored.
        seniority: peer ID -> outer steps we committed in one group with it. The quorum weighs votes by it
            (``quorum.seniority_weights``): identities are free in an open run, rounds committed with us are not, so
            fresh identities claiming an epoch ahead cannot outvote the peers we train with (issue 28: 2 identities
            took over 2 honest peers). Empty (a joiner, the coordinator): every vote weighs 1.
    """

    quorum: QuorumConfig = QuorumConfig()
    coordinator_id: str = ""
    run_started_at: float | None = None
    banned: frozenset[str] = frozenset()
    seniority: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class SyncDecision:
    """``action``: "train" or "download" the state of ``target_epoch`` (sha256 ``state_hash``) from ``donors``;
    ``ban``: peers whose claims the run's age rules out (the caller bans them); ``reason`` is for people only;
    ``vouched``: who vouches for the target state beyond a count of identities ("" = nobody: see ``vouched_by``).

    A trainer adopts a downloaded state nobody vouches for only if its eval loss on the trainer's own held-out windows
    passes ``loss_check`` (and bans its donors otherwise): a plain quorum counts identities, which are free in an
    open run (issue 28), and the "behind, unbacked" rule and probes have no quorum at all. A vouched state needs the
    step bound or the loss check (``adoption``): the swarm's loss may really rise while we are away, and refusing
    it banned the honest peers and forked us (session 13, chaos ``pause-twice``). ``download_hashes`` gives the
    hashes its download may accept."""

    action: Action
    target_epoch: int
    donors: tuple[str, ...]
    reason: str
    ban: tuple[str, ...] = field(default=())
    state_hash: str = ""
    forked: bool = False  # the "forked" rule: another state at our own epoch
    probe: bool = False  # a probe of an unfollowed claim (``diloco.probe``): only its own hash is accepted
    vouched: str = ""  # who vouches for (target_epoch, state_hash) beyond a count of identities (``vouched_by``)


def download_hashes(
    published: Mapping[int, str], decision: SyncDecision, claims: Mapping[int, str] | None = None
) -> dict[int, str]:
    """epoch -> state hash a download for ``decision`` may accept: the ``published`` ones (a quorum's, the
    coordinator's: read afresh during the download, as donors may commit meanwhile) and the decision's own target,
    unless a quorum now backs another state at that epoch. Without the target, a "behind, unbacked" download (no
    quorum for it, by definition) was served the donor's retained older state that the coordinator had verified,
    our own epoch: a joiner downloaded epoch 7 while its donor held 8, every 4 s for minutes (CI, issue 22).

    A probe (``decision.probe``) accepts what its holders claim: ``claims``, their current signed records' (epoch ->
    hash, read afresh: a liar claiming one epoch past its own moves its claim at each of its commits), and the
    claim probed. The evidence is about what they serve under their own signature, not about the swarm's state."""
    if decision.probe:
        return {**(claims or {}), decision.target_epoch: decision.state_hash}
    hashes = dict(published)
    if decision.action == "download" and decision.state_hash:
        hashes.setdefault(decision.target_epoch, decision.state_hash)
    return hashes


def download_short(decision: SyncDecision, got_epoch: int, my_epoch: int) -> str:
    """Why a downloaded state at ``got_epoch`` is no use to a peer at ``my_epoch`` ("" = it is): short of the
    decision's target and no newer than what we hold, adopting it would leave us where we were, and the next
    decision would download it again (donors that moved on may serve a newer state; a retained older one only where
    it still takes us forward)."""
    if got_epoch < decision.target_epoch and got_epoch <= my_epoch:
        return (
            f"the donors served epoch {got_epoch}, short of the epoch {decision.target_epoch} we wanted and no newer "
            f"than ours ({my_epoch})"
        )
    return ""


LOSS_TOLERANCE = 0.1  # an unbacked state may be this fraction worse than ours on our windows (issue 28: +10%)


def loss_check(candidate_loss: float, own_loss: float, tolerance: float = LOSS_TOLERANCE) -> tuple[bool, str]:
    """Whether a state nobody else can vouch for is good enough to adopt: its eval loss on our own held-out windows
    (nats per token) is finite and at most ``(1 + tolerance)`` x ours. A state a peer trained from the run's is as
    good as ours or better (it holds more outer steps); a poisoned or random one is far worse (random weights x5 on
    the tiny model: loss 641 against 2.7). What it cannot catch: a state worse by less than the tolerance."""
    if not candidate_loss == candidate_loss or candidate_loss == float("inf"):  # NaN or inf
        return False, f"its eval loss on our windows is {candidate_loss}"
    bound = own_loss * (1.0 + tolerance)
    if candidate_loss > bound:
        return False, f"its eval loss on our windows is {candidate_loss:.3f}, ours {own_loss:.3f} (bound {bound:.3f})"
    return True, f"its eval loss on our windows is {candidate_loss:.3f}, ours {own_loss:.3f}"


@dataclass(frozen=True)
class _Evidence:
    claims: list[PeerRecord]  # live, plausible, not banned, not the coordinator; ours excluded
    coordinator: PeerRecord | None  # the run's known coordinator's live record with a state
    backed: dict[int, Backing]  # the quorum's states, our own vote included when we hold a state
    ban: tuple[str, ...]
    notes: tuple[str, ...]
    votes: tuple[PeerRecord | Vote, ...] = ()  # the claims the quorum weighed, ours included
    weights: Mapping[str, float] | None = None  # seniority weights (None: every vote weighs 1)


def _weigh(
    my_peer_id: str,
    records: Iterable[PeerRecord],
    mine: Vote | None,
    now: float | None,
    stale_after_s: float | None,
    trust: SyncTrust,
    exact_average: bool,
) -> _Evidence:
    live = [
        r
        for r in live_records(records, now, stale_after_s, role=None, banned=trust.banned, exclude={my_peer_id})
        if r.state_hash
    ]
    coordinator = next((r for r in live if r.role == "coordinator" and r.peer_id == trust.coordinator_id), None)
    claims = [r for r in live if r.role != "coordinator"]
    notes = []
    impostors = sorted({r.peer_id for r in live if r.role == "coordinator" and r.peer_id != trust.coordinator_id})
    if impostors:
        notes.append(f"ignored coordinator record(s) of {', '.join(p[:12] for p in impostors)}: not the run's")
    votes = claims + ([mine] if mine is not None else [])
    weights = seniority_weights(trust.seniority, my_peer_id) if trust.seniority else None
    bound = None if now is None else max_plausible_epoch(trust.run_started_at, now, trust.quorum)
    ban: tuple[str, ...] = ()
    suspects = implausible(claims, bound)
    if suspects:
        # a claim past the bound is spared only where at least 2 distinct peers hold that state: a quorum that takes
        # a lone holder (the coordinator's follower) must not let the bound wave a lone liar through
        backed = backed_states(votes, trust.quorum, exact_average, weights)
        ban = tuple(
            p
            for p in suspects
            if not any(
                p in b.holders and len(b.holders) >= 2 for e, b in backed.items() if bound is not None and e > bound
            )
        )
        if ban:
            notes.append(f"epoch past the run-age bound {bound} claimed by {', '.join(p[:12] for p in ban)}: banned")
        claims = [r for r in claims if r.peer_id not in ban]
        votes = claims + ([mine] if mine is not None else [])
    backed = backed_states(votes, trust.quorum, exact_average, weights)
    return _Evidence(claims, coordinator, backed, ban, tuple(notes), tuple(votes), weights)


def vouched_by(ev: _Evidence, epoch: int, state_hash: str, trust: SyncTrust) -> str:
    """Who vouches for (``epoch``, ``state_hash``) beyond a count of identities; "" = nobody.

    - the run's coordinator, whose live record holds exactly that state: it follows committed steps under the quorum
      rule and the same adoption checks, and attackers cannot sign its records;
    - our seniors: peers we committed rounds with (``SyncTrust.seniority``) hold it, and its holders' seniority
      weight is a strict majority of every distinct voter's, ours included (``quorum.seniority_weights``). Rounds
      committed with us are what fresh identities cannot fake; a joiner, with no seniority, has no seniors.
    """
    coord = ev.coordinator
    if coord is not None and coord.epoch == epoch and coord.state_hash == state_hash:
        return "the run's coordinator"
    if not ev.weights:
        return ""
    voters = {v.peer_id: v for v in ev.votes}  # distinct: one record per peer
    holders = [p for p, v in voters.items() if v.epoch == epoch and v.state_hash == state_hash]
    if not any(trust.seniority.get(p, 0) > 0 for p in holders):
        return ""
    weight = ev.weights.get
    held = sum(weight(p, 1.0) for p in holders)
    if held > sum(weight(p, 1.0) for p in voters) - held:
        return f"peers we committed rounds with ({len(holders)} of {len(voters)}, a seniority-weighted majority)"
    return ""


def published_hashes(
    records: Iterable[PeerRecord],
    *,
    trust: SyncTrust = SyncTrust(),
    exact_average: bool = True,
    now: float | None = None,
    stale_after_s: float | None = None,
) -> dict[int, str]:
    """epoch -> the state hash a download may accept for it: the state a quorum of ``records`` backs
    (``hivetrain.peers.quorum.backed_states``), or at its epoch the run's known coordinator's.

    An epoch only one peer (or a minority) claims is absent, so a liar's own hash is never "the majority" of an epoch
    only it claims. ``now`` and ``stale_after_s`` (seconds) drop stale records and apply the run-age bound; without
    them every record given counts (e.g. a fresh DHT read, whose records are unexpired).
    """
    evidence = _weigh("", records, None, now, stale_after_s, trust, exact_average)
    result = {epoch: b.state_hash for epoch, b in evidence.backed.items()}
    if evidence.coordinator is not None:
        result[evidence.coordinator.epoch] = evidence.coordinator.state_hash
    return result


def decide_sync(
    my_peer_id: str,
    my_epoch: int,
    my_hash: str,
    records: Iterable[PeerRecord],
    now: float,
    stale_after_s: float,
    exact_average: bool = True,
    *,
    trust: SyncTrust = SyncTrust(),
    my_vote: bool = True,
    unbacked: bool = False,
    closed_without_us: frozenset[str] = frozenset(),
) -> SyncDecision:
    """Decide whether to keep training or download state first, on evidence only.

    Rules, in order:

    - **behind**: the run's known coordinator verified a newer state than ours (and no quorum backs a newer one
      still), or a quorum backs a newer epoch: download the newest such state from its holders.
    - **forked** (``exact_average`` only): at our epoch, the coordinator's state or the state a quorum backs,
      counting our own vote, is not ours. Every peer counts the same population, its own hash included, so both sides
      of a fork agree on who downloads (a 2-1 fork: the lone peer; a 1-1 tie: nobody, as nothing tells the honest
      side from a liar; with ``min_fraction < 0.5`` ties go to the larger hash string on both sides).
    - **behind, the epoch's round went on without us** (exact averaging): ``closed_without_us`` names the members
      of our epoch's group that closed without us (matchmaking's "late": it closed before we were ready), or the
      trainers one epoch ahead whose weight refused our own round of the epoch (``round_policy.went_ahead``), and at
      least ``quorum.min_peers`` of them hold one state at our epoch + 1 that is the most held there, by more than
      ``quorum.min_fraction`` of the weight of every voter at that epoch. That group was the epoch's one round (its
      members' ``accept`` checked that they outweigh the epoch's other trainers), so its result is the state the
      swarm goes on from, even while as many peers as it held are still behind with us: the quorum's rule 3 (the
      voters at an epoch or later must be half the population) would hold every late peer back, and they would form
      a second round of the same epoch that its first group's result outweighs (the simulator's 1,000 peers with
      1 h sessions: a group of 446 committed epoch 5 while 450 finished later; for 10,000 simulated seconds the late
      peers' rounds were refused and the committed ones waited for them, dev/LOG.md 2026-12-01). The same adoption
      checks apply as for any download (``vouched``: fresh identities that declare a group and claim its result
      vouch for nothing).
    - **behind, unbacked** (``unbacked`` only, exact averaging): no other live trainer is at our epoch, so we can
      average with nobody, and trainers claim newer epochs that no quorum can back (a run of two peers, one of them
      ahead: issue 22's late joiner and restarted peer, stuck for minutes while the other committed solo steps). We
      download the newest such state: the caller adopts it only if ``loss_check`` passes on its own windows,
      evidence a liar cannot fake with random weights, and bans its donors otherwise.
    - otherwise **train**: claims without a quorum are ignored (the reason names them).

    Args:
        my_hash: sha256 of our state ("" = none yet).
        records: peer records of the run (ours included or not).
        now: current time (unix seconds, DHT time).
        stale_after_s: records not updated for this long are ignored.
        exact_average: peers of an epoch hold the same state (butterfly averaging). With moshpit or gossip groups
            they differ by design, so only "behind" triggers a download, never a differing hash.
        trust: the quorum's thresholds, the run's coordinator, the run's start, the banned peers.
        my_vote: our state counts as a vote (trainers); False for the coordinator, which trains nothing.
        unbacked: allow the "behind, unbacked" rule (trainers, which can evaluate a state on their own windows).
        closed_without_us: peer ids of the members of our epoch's group that closed without us
            (``RoundFailed.closed_without_us``), or of the trainers ahead that outweighed our round
            (``round_policy.went_ahead``); empty = none seen: the "went on without us" rule.

    Returns:
        The decision; ``ban`` lists the peers whose epochs the run's age rules out.
    """
    mine = Vote(my_peer_id, my_epoch, my_hash) if my_vote and my_hash else None
    ev = _weigh(my_peer_id, records, mine, now, stale_after_s, trust, exact_average)
    coord = ev.coordinator
    notes = "".join(f"; {n}" for n in ev.notes)

    def holding(epoch: int, state_hash: str) -> tuple[str, ...]:
        donors = [r.peer_id for r in ev.claims if r.epoch == epoch and r.state_hash == state_hash]
        if coord is not None and coord.epoch == epoch and coord.state_hash == state_hash:
            donors.append(coord.peer_id)  # the coordinator serves the state it verified
        return tuple(donors)

    newest = max((e for e in ev.backed if e > my_epoch), default=-1)
    if coord is not None and coord.epoch > my_epoch and coord.epoch >= newest:
        why = f"behind: the run's coordinator verified epoch {coord.epoch}, we are at {my_epoch}"
        return SyncDecision(
            "download",
            coord.epoch,
            holding(coord.epoch, coord.state_hash),
            why + notes,
            ev.ban,
            coord.state_hash,
            vouched=vouched_by(ev, coord.epoch, coord.state_hash, trust),
        )
    if newest > my_epoch:
        b = ev.backed[newest]
        why = f"behind: {b.describe()}, we are at {my_epoch}"
        return SyncDecision(
            "download",
            newest,
            holding(newest, b.state_hash),
            why + notes,
            ev.ban,
            b.state_hash,
            vouched=vouched_by(ev, newest, b.state_hash, trust),
        )
    followed = _closed_without_us(ev, my_epoch, closed_without_us, trust.quorum) if exact_average else None
    if followed is not None:
        state_hash, why = followed
        return SyncDecision(
            "download",
            my_epoch + 1,
            holding(my_epoch + 1, state_hash),
            why + notes,
            ev.ban,
            state_hash,
            vouched=vouched_by(ev, my_epoch + 1, state_hash, trust),
        )
    if exact_average:
        if coord is not None and coord.epoch == my_epoch:
            theirs, by = coord.state_hash, "the run's coordinator verified"
        elif my_epoch in ev.backed:
            theirs, by = ev.backed[my_epoch].state_hash, f"{len(ev.backed[my_epoch].holders)} peer(s) hold"
        else:
            theirs, by = my_hash, ""
        if my_hash and theirs != my_hash:
            why = f"forked: {by} state {theirs[:12]} at epoch {my_epoch}, we hold {my_hash[:12]}"
            return SyncDecision(
                "download",
                my_epoch,
                holding(my_epoch, theirs),
                why + notes,
                ev.ban,
                theirs,
                forked=True,
                vouched=vouched_by(ev, my_epoch, theirs, trust),
            )
        if unbacked:
            lone = _lone_behind(ev, my_epoch)
            if lone is not None:
                epoch, state_hash, why = lone
                return SyncDecision("download", epoch, holding(epoch, state_hash), why + notes, ev.ban, state_hash)
    return SyncDecision("train", my_epoch, (), "in sync" + _unbacked(ev, my_epoch) + notes, ev.ban)


def _closed_without_us(
    ev: _Evidence, my_epoch: int, members: frozenset[str], quorum: QuorumConfig
) -> tuple[str, str] | None:
    """(hash, reason) of the state the members of our epoch's group that closed without us hold at ``my_epoch`` + 1,
    if it passes the "went on without us" rule of ``decide_sync``; else None."""
    if not members:
        return None
    weight = (lambda p: 1.0) if ev.weights is None else (lambda p: ev.weights.get(p, 1.0))
    voters = {v.peer_id: v for v in ev.votes if v.epoch == my_epoch + 1}  # distinct: one record per peer
    held: dict[str, float] = defaultdict(float)
    for p, v in voters.items():
        held[v.state_hash] += weight(p)
    if not held:
        return None
    state_hash, mass = max(held.items(), key=lambda kv: (kv[1], kv[0]))
    ours = sorted(p for p, v in voters.items() if p in members and v.state_hash == state_hash)
    if not state_hash or len(ours) < quorum.min_peers or mass <= quorum.min_fraction * sum(held.values()):
        return None
    why = (
        f"behind: our epoch's round went on without us ({len(ours)} of its {len(members)} members hold epoch "
        f"{my_epoch + 1}, {state_hash[:12]}), we are at {my_epoch}"
    )
    return state_hash, why


def _lone_behind(ev: _Evidence, my_epoch: int) -> tuple[int, str, str] | None:
    """(epoch, hash, reason) of the newest state trainers claim ahead of us when nobody else is at our epoch, else
    None. Of several hashes at that epoch the most held wins, ties to the larger hash string (after a refused download
    its donors are banned and the next one is tried)."""
    trainers = [r for r in ev.claims if r.role == "trainer"]
    if any(r.epoch == my_epoch for r in trainers):
        return None  # someone to average with: the quorum rule alone moves us
    ahead = [r for r in trainers if r.epoch > my_epoch]
    if not ahead:
        return None
    newest = max(r.epoch for r in ahead)
    counts = Counter(r.state_hash for r in ahead if r.epoch == newest)
    state_hash, holders = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
    why = (
        f"behind, unbacked: {holders} trainer(s) hold epoch {newest} ({state_hash[:12]}), we are at {my_epoch} with "
        "nobody to average with: adopt it if its loss on our windows passes"
    )
    return newest, state_hash, why


def _unbacked(ev: _Evidence, my_epoch: int) -> str:
    """Names newer claims that lack a quorum (why a peer does not follow them), for logs and the dashboard."""
    ahead = sorted({r.epoch for r in ev.claims if r.epoch > my_epoch and r.epoch not in ev.backed})
    if not ahead:
        return ""
    shown = ", ".join(str(e) for e in ahead[:3]) + (" ..." if len(ahead) > 3 else "")
    return f"; no quorum for epoch(s) {shown} claimed by {sum(r.epoch > my_epoch for r in ev.claims)} peer(s)"


@dataclass(frozen=True)
class CatchUp:
    """How long a peer holds its solo steps for live trainers behind it (a joiner downloading, a peer that restarted
    or fell one epoch behind), so that they can reach its epoch and average with it.

    Attributes:
        behind_since: peer id -> DHT time (seconds) we first saw it behind our epoch this time (the caller keeps it:
            ``note_behind``).
        wait_s: how long each is waited for, seconds (0 = never: solo steps go on past peers behind us).
    """

    behind_since: Mapping[str, float] = field(default_factory=dict)
    wait_s: float = 0.0


def note_behind(
    behind_since: dict[str, float], my_peer_id: str, my_epoch: int, records: Iterable[PeerRecord], now: float
) -> None:
    """Update ``behind_since`` (``CatchUp``): live trainers behind ``my_epoch`` keep their first time seen behind;
    those no longer behind are forgotten (a peer that catches up and falls behind again is waited for again)."""
    behind = {
        r.peer_id
        for r in records
        if r.peer_id != my_peer_id and r.role == "trainer" and not r.left_reason and r.epoch < my_epoch
    }
    keep_first_seen(behind_since, behind, now)


def keep_first_seen(since: dict[str, float], current: set[str], now: float) -> None:
    """Update ``since`` in place to peer id -> when it was first seen in ``current`` this time (DHT seconds): peers
    still in ``current`` keep their time, new ones get ``now``, the others are dropped (``note_behind``,
    ``probe.note_ahead``)."""
    for peer in list(since):
        if peer not in current:
            del since[peer]
    for peer in current:
        since.setdefault(peer, now)
