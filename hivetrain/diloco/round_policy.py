"""Pure decisions after an averaging attempt: apply, retry, resync, carry, or stop (``decide_after_round``); whether a
round of one may be applied (``may_commit_alone``), or a group's result (``group_holds_the_epoch``); whether a group
committed without us (``committed_without_us``);
which carried phases join the next round (``keep_carried``).

Functions of the records peers published, our own view of the round and ``now``; no I/O. The trainer's round loop
(``diloco.rounds``) calls them after each attempt, and the simulator (``sim.rounds``) with the same inputs. The
evidence rules (what counts as a newer or another state) are ``sync_policy``'s: a resync needs the same evidence as
a download.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from hivetrain.averaging.matchmaking import EpochGroups
from hivetrain.diloco.sync_policy import CatchUp, SyncTrust, decide_sync
from hivetrain.peers.quorum import seniority_weights
from hivetrain.peers.records import PeerRecord, live_records


def may_commit_alone(
    my_peer_id: str,
    my_epoch: int,
    records: Iterable[PeerRecord],
    now: float,
    stale_after_s: float,
    trust: SyncTrust = SyncTrust(),
    catch_up: CatchUp = CatchUp(),
) -> tuple[bool, str]:
    """A round of one peer may be applied only if no other live trainer is at our epoch or later, or computing a
    pseudo-gradient for it (``phase_epoch``: with overlap a peer's state lags the round its phase is for), and none
    behind us is still within its ``catch_up`` wait.

    Otherwise applying it would fork the run (the others average without us: we must wait or resync), or run ahead
    of a peer that is catching up: a joiner that downloads our epoch while we commit solo steps arrives one epoch
    behind every time, and the two never average (issue 22: 35-60 solo steps while a joiner failed every round).
    Banned peers (``trust.banned``) do not count.
    """
    live = live_records(records, now, stale_after_s, banned=trust.banned, exclude={my_peer_id})
    others = [r for r in live if r.epoch >= my_epoch or r.phase_epoch >= my_epoch]
    if others:
        return False, f"{len(others)} other live trainer(s) at epoch >= {my_epoch}; a solo step would fork the run"
    waited = catch_up.behind_since
    catching_up = [r for r in live if now - waited.get(r.peer_id, now) < catch_up.wait_s]
    if catching_up:
        return False, (
            f"{len(catching_up)} live trainer(s) behind us catching up (waited for up to {catch_up.wait_s:g}s); "
            "a solo step would leave them behind again"
        )
    return True, "no other live trainer"


def group_holds_the_epoch(
    my_peer_id: str,
    my_epoch: int,
    group: Iterable[str],
    records: Iterable[PeerRecord],
    now: float,
    stale_after_s: float,
    trust: SyncTrust = SyncTrust(),
    coverage: float = 1.0,
    epoch_groups: EpochGroups | None = None,
) -> tuple[bool, str]:
    """Whether a round's result may be applied: its contributors (``group``, us included) weigh at least as much as the
    live trainers at our epoch (or computing for it) that are not in it.

    Weights are ``quorum.seniority_weights`` (1 + the outer steps we committed in one group with a peer, capped; ours
    as our most senior partner's); a peer we never committed a round with weighs 0 once we have committed with anyone,
    1 while we have not (a joiner counts heads). Why: identities are free in an open run, and two that average
    honestly but claim an epoch ahead formed a group with one honest peer whose partner and joiner were a second
    late; the honest peer committed with them, the others formed a group of their own, and the two honest lineages
    stayed apart for 6 epochs (chaos ``ahead-liars-3v2``, 2026-11-29). Refused, the round fails on every member (the
    averager's ``accept``) and is retried with the peers we train with, or, when trainers one epoch ahead outweighed
    it, their result is followed (``went_ahead``). Without seniority (a new run) the rule is a
    plain majority of heads, which a group of one honest peer and Sybils can still win: admission closes that.
    Trainers whose record shows our epoch + 1 count too: they committed this round without us (the epoch's one
    declaration closed before we arrived), and a late group of our own would end the epoch on a second state (the
    simulator's 1,000 peers: 998 committed epoch 0, then 2 stragglers committed a pair of their own and were forked;
    issue 23 asks one state per epoch). Their weight is their seniority like anyone's, so fresh identities claiming
    one epoch ahead (issue 28's liars) weigh nothing once we have committed with anyone; a joiner counts heads.
    Banned, departed, paused and stale trainers do not count; nor do those behind our epoch (they follow us) or
    further ahead (the resync rules' evidence). ``coverage``: the fraction of
    the swarm ``records`` holds (a sharded swarm's sample, ``peers/record_shards.py``): the mass outside is scaled by
    1 / ``coverage``. ``epoch_groups``: our declaration and the other live declarations of our epoch; the members of
    those ours outranks (``EpochGroups.followers``) will follow our result and do not count outside (unless their
    record shows our epoch + 1: they committed theirs already), and one that outranks ours refuses it (unless its
    members weigh nothing to us: fresh identities)."""
    members = set(group) | {my_peer_id}
    weights = seniority_weights(trust.seniority, my_peer_id)
    weight = (lambda p: weights.get(p, 0.0)) if weights else (lambda p: 1.0)
    # a declaration of peers we never trained with (fresh identities weigh 0) outranks nothing: not a Sybil's lever
    for rival in epoch_groups.ahead() if epoch_groups is not None else ():
        if sum(weight(p) for p in rival - members) > 0:
            return False, (
                f"another declaration of our epoch ({len(rival)} members) outranks ours ({len(epoch_groups.ours)}): "
                "its result is the epoch's, ours would be a second state"
            )
    followers = epoch_groups.followers() if epoch_groups is not None else frozenset()
    # ... but a member of an outranked declaration whose record shows our epoch + 1 committed its round before ours
    # voted: it follows nobody, and ours applied beside it would end the epoch on a second state
    records = list(records)
    followers = followers - {r.peer_id for r in records if r.epoch > my_epoch}
    outside = [
        r.peer_id
        for r in live_records(records, now, stale_after_s, banned=trust.banned, exclude=members | followers,
                              paused=False)
        if r.epoch in (my_epoch, my_epoch + 1) or r.phase_epoch == my_epoch
    ]  # fmt: skip
    inside_mass = sum(weight(p) for p in members)
    outside_mass = sum(weight(p) for p in set(outside)) / max(coverage, 1e-9)
    if inside_mass >= outside_mass:  # a tie commits, as before this rule (refusing it could stall half a swarm)
        return True, ""
    return False, (
        f"the round's {len(members)} contributor(s) weigh {inside_mass:g} against {outside_mass:g} for "
        f"{len(set(outside))} live trainer(s) of epoch {my_epoch} (or past it) outside it (rounds committed together): "
        "applying it could split the peers we train with"
    )


def went_ahead(
    my_epoch: int, group: Iterable[str], records: Iterable[PeerRecord], now: float, stale_after_s: float,
    trust: SyncTrust = SyncTrust(),
) -> frozenset[str]:  # fmt: skip
    """The live trainers outside ``group`` whose records show ``my_epoch`` + 1: when ``group_holds_the_epoch``
    refuses a round, the peers of the epoch's round that went on without it, whose result the refused members follow
    (``sync_policy.decide_sync``'s ``closed_without_us``; its quorum of them holding one state still applies). Banned,
    departed, paused and stale records do not count."""
    members = set(group)
    return frozenset(
        r.peer_id
        for r in live_records(records, now, stale_after_s, banned=trust.banned, exclude=members, paused=False)
        if r.epoch == my_epoch + 1
    )


def committed_without_us(
    my_peer_id: str,
    epoch: int,
    group: Iterable[str],
    candidate_hash: str,
    records: Iterable[PeerRecord],
    now: float,
    stale_after_s: float,
    trust: SyncTrust = SyncTrust(),
) -> tuple[bool, str]:
    """After a round at ``epoch`` failed for us once we had voted (``RoundFailed.voted``): did its group commit?

    The two-phase-commit gap (``averaging.allreduce``): members that received every vote commit; we missed one. A
    member that committed publishes ``epoch + 1`` with the hash of the state the round's result gives, which is
    ``candidate_hash``, the hash of the state we build from the result we voted for. Two sources agree then: our own
    copy of the round's result (every part of it verified as it arrived) and a member's signed record. Nobody
    outside the group can name that hash without the round's data, and a member's claim to hold it can only be
    true: every member's state follows from the same result. Stale records, banned peers and peers outside
    ``group`` do not count.

    Returns:
        (committed, reason): True once at least one other member of ``group`` holds ``candidate_hash`` at
        ``epoch + 1``.
    """
    members = set(group) - {my_peer_id}
    holders = sorted(
        r.peer_id
        for r in live_records(records, now, stale_after_s, banned=trust.banned, departed=True)  # committed, then left
        if r.peer_id in members and r.epoch == epoch + 1 and r.state_hash == candidate_hash
    )
    if holders:
        return True, f"{len(holders)} member(s) of the group committed epoch {epoch + 1} with the result we voted for"
    return False, f"no member of the group shows epoch {epoch + 1} with the result we voted for"


RoundAction = Literal["apply", "retry", "resync", "carry", "lost", "stop"]


@dataclass(frozen=True)
class RoundView:
    """What a peer knows right after one averaging attempt at ``epoch`` (all times in seconds).

    Attributes:
        committed: the round committed (``group_size`` members, us included); False = it failed (``failure``).
        view_ok: our last read of the swarm's records was real (our daemon answered, our own record was there).
        view_age_s: seconds since the last real read of the swarm (the record heartbeat reads it every few seconds).
        time_left_s: seconds left until the round's overall deadline (``averaging.round_timeout_s`` from the first
            attempt); may be negative.
        closed_without_us: peer ids of the members of our epoch's group that closed without us
            (``RoundFailed.closed_without_us``), or of the trainers ahead that outweighed our round (``went_ahead``);
            empty when neither was seen.
    """

    epoch: int
    my_hash: str
    attempt: int
    committed: bool
    group_size: int = 0
    failure: str = ""
    view_ok: bool = True
    view_age_s: float = 0.0
    time_left_s: float = 0.0
    stopping: bool = False
    closed_without_us: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RoundPolicy:
    """``action``: "apply" the result; "retry" after ``backoff_s``; "resync" (others moved on or we forked: download
    state, keep our contribution for the next round); "carry" (no round now: keep our contribution, run another inner
    phase at this epoch and send both together); "lost" (the DHT is gone: stop); "stop" (we are shutting down)."""

    action: RoundAction
    reason: str
    backoff_s: float = 0.0


def decide_after_round(
    my_peer_id: str,
    view: RoundView,
    records: Iterable[PeerRecord],
    now: float,
    *,
    max_retries: int,
    stale_after_s: float,
    dht_lost_after_s: float,
    exact_average: bool = True,
    trust: SyncTrust = SyncTrust(),
    catch_up: CatchUp = CatchUp(),
    backoff_floor_s: float = 0.0,
    unbacked: bool = False,
) -> RoundPolicy:
    """The retry / solo-commit / resync / lost-DHT policy of the train loop, after one averaging attempt.

    Rules, in order: stopping stops; a swarm unreadable for over ``dht_lost_after_s`` is "lost"; a committed group of
    two or more is applied; a group of one is applied only on a real view of the swarm with no other live trainer at
    our epoch or later (``may_commit_alone``: else it would fork the run); after a failure, evidence of a newer epoch or
    of another state at ours (``decide_sync``: a quorum, the run's coordinator, or the members of our epoch's group
    that closed without us, ``view.closed_without_us``) means "resync"; otherwise retry
    with exponential backoff (0.25 s doubling, at most 4 s), past ``max_retries`` only while live peers of our epoch
    may still come and the round's deadline is not reached; then "carry". Nothing a peer computed is thrown away
    here: "resync" and "carry" keep the contribution.

    Args:
        records: the swarm's peer records (ours included or not); now: DHT time, seconds.
        trust: passed to ``decide_sync`` and ``may_commit_alone`` (a resync needs the same evidence as a download).
        catch_up: passed to ``may_commit_alone``: peers behind us we still wait for.
        unbacked: passed to ``decide_sync``: with nobody at our epoch, a newer state trainers claim means "resync"
            even without a quorum (the trainer checks it on its own windows before adopting it).
        backoff_floor_s: the shortest backoff, seconds (the caller's measured DHT latency: retrying faster than the
            DHT answers only replaces our entry before anyone read it). The caller stretches it by up to 50%
            (``backoff_jitter``), differently per peer and attempt, so that two peers that failed together do not
            retry in lockstep; the answer itself stays the same for every peer with the same view (the simulator
            shares it between peers).
    """
    records = list(records)
    if view.stopping:
        return RoundPolicy("stop", "stopping")
    if view.view_age_s > dht_lost_after_s:
        return RoundPolicy("lost", f"could not read the swarm for {view.view_age_s:.0f}s (did the p2pd daemon die?)")
    failure = view.failure
    if view.committed and view.group_size > 1:
        return RoundPolicy("apply", f"committed with {view.group_size} peers")
    if view.committed:
        if not view.view_ok:
            failure = "alone: cannot read the swarm's records (DHT unreachable): no solo step"
        else:
            ok, why = may_commit_alone(my_peer_id, view.epoch, records, now, stale_after_s, trust, catch_up)
            if ok:
                return RoundPolicy("apply", f"alone: {why}")
            failure = f"alone: {why}"
    sync = decide_sync(
        my_peer_id, view.epoch, view.my_hash, records, now, stale_after_s, exact_average, trust=trust,
        unbacked=unbacked, closed_without_us=view.closed_without_us,
    )  # fmt: skip
    if sync.action == "download":
        return RoundPolicy("resync", f"{failure}; {sync.reason}")
    waiting_for_peers = not may_commit_alone(my_peer_id, view.epoch, records, now, stale_after_s, trust, catch_up)[0]
    if view.attempt > max_retries and not (waiting_for_peers and view.time_left_s > 0):
        why = "round deadline reached" if waiting_for_peers else "no other live peer at our epoch"
        return RoundPolicy("carry", f"{failure}; {why} after {view.attempt} attempts: train on, send both later")
    backoff = max(min(0.25 * 2 ** (view.attempt - 1), 4.0), backoff_floor_s)
    return RoundPolicy("retry", failure, backoff_s=backoff)


def backoff_jitter(peer_id: str, epoch: int, attempt: int) -> float:
    """A number in [0, 1) fixed by (peer, epoch, attempt): deterministic (tests, the simulator), different per peer."""
    digest = hashlib.sha256(f"{peer_id}|{epoch}|{attempt}".encode()).digest()
    return int.from_bytes(digest[:4], "little") / 2**32


@dataclass(frozen=True)
class CarryDecision:
    """``drop``: how many of the oldest carried phases to drop (0 = keep them all; all of them = start afresh);
    ``reason`` is for people only."""

    drop: int
    reason: str


def keep_carried(
    carried_epoch: int,
    new_epoch: int,
    carried_samples: Sequence[int],
    new_samples: int,
    *,
    max_samples: int,
    max_phases: int,
    new_phases: int = 1,
    max_staleness: int = 0,
) -> CarryDecision:
    """Which carried phases computed against the state of ``carried_epoch`` may go into the round of ``new_epoch``?

    A contribution whose round failed while nobody moved on is sent again with the next one (same state: nothing is
    stale), as the sample-weighted mean of its phases (``diloco.rounds.Contribution.merged``). Past ``max_staleness``
    epochs all of it is dropped. Otherwise its oldest phases are dropped until the contribution holds at most
    ``max_phases`` phases (``diloco.max_carried_phases``) and ``max_samples`` samples
    (``averaging.max_samples_per_round``, what other peers accept). The trainer uses staleness 0: in the utilization
    bench a pseudo-gradient carried across a state download (one epoch stale) with the weight of two phases took the
    eval loss from 2.72 to 4.39 for one epoch (dev/LOG.md, 2026-11-25), while the swarm's schedule kept every sample
    without it. The simulator calls it too (``sim.dataparallel``).

    Args:
        carried_samples: samples of each carried phase, oldest first.
        new_samples: samples of the new contribution (``new_phases`` phases) they would join.
    """
    num = len(carried_samples)
    if num and new_epoch - carried_epoch > max_staleness:
        return CarryDecision(num, f"computed at epoch {carried_epoch}, {new_epoch - carried_epoch} epochs stale")
    drop = 0
    while drop < num and (
        num - drop + new_phases > max_phases or sum(carried_samples[drop:]) + new_samples > max_samples
    ):
        drop += 1
    if not drop:
        return CarryDecision(0, "kept")
    reasons = []
    if num + new_phases > max_phases:
        reasons.append(f"{num + new_phases} phases exceed diloco.max_carried_phases ({max_phases})")
    if sum(carried_samples) + new_samples > max_samples:
        reasons.append(
            f"{sum(carried_samples) + new_samples} samples exceed averaging.max_samples_per_round ({max_samples})"
        )
    return CarryDecision(drop, f"the oldest {drop} of {num} carried phase(s) dropped: " + "; ".join(reasons))
