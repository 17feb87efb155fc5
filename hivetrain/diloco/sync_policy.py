"""Pure decisions about a peer's place in the swarm: is it behind, is its state forked, may it average alone?

Functions of the records peers published and ``now``; no I/O. The trainer calls them between phases.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from hivetrain.peers.records import PeerRecord

Action = Literal["train", "download"]


@dataclass(frozen=True)
class SyncDecision:
    action: Action
    target_epoch: int
    donors: tuple[str, ...]
    reason: str


def published_hashes(records: Iterable[PeerRecord]) -> dict[int, str]:
    """epoch -> the state hash most peers published for it (ties broken by the hash string, deterministically).

    The coordinator's hash, when present, wins its epoch: it follows every committed step and trains nothing.
    """
    votes: dict[int, Counter[str]] = {}
    authority: dict[int, str] = {}
    for record in records:
        if not record.state_hash:
            continue
        if record.role == "coordinator":
            authority[record.epoch] = record.state_hash
        votes.setdefault(record.epoch, Counter())[record.state_hash] += 1
    result = {epoch: max(counter.items(), key=lambda kv: (kv[1], kv[0]))[0] for epoch, counter in votes.items()}
    result.update(authority)
    return result


def decide_sync(
    my_peer_id: str,
    my_epoch: int,
    my_hash: str,
    records: Iterable[PeerRecord],
    now: float,
    stale_after_s: float,
    exact_average: bool = True,
) -> SyncDecision:
    """Decide whether to keep training or download state first.

    Download when a live peer is at a newer epoch (we are behind), or when the majority hash of our epoch, counting
    our own, is not ours (our last outer step diverged: e.g. we were paused through a commit). Every peer counts the
    same population, so both sides of a fork agree on which one downloads.

    Args:
        records: peer records of the run (ours included or not).
        exact_average: peers of an epoch hold the same state (butterfly averaging). With moshpit or gossip groups
            they differ by design, so only "behind" triggers a download, never a differing hash.
        now: current time (unix seconds, DHT time).
        stale_after_s: records not updated for this long are ignored.
    """
    live = [r for r in records if r.peer_id != my_peer_id and now - r.updated_at <= stale_after_s]
    hashes = published_hashes(live)
    newest = max((r.epoch for r in live if r.state_hash), default=-1)
    if newest > my_epoch:
        donors = tuple(r.peer_id for r in live if r.epoch == newest and r.state_hash == hashes.get(newest))
        return SyncDecision("download", newest, donors, f"behind: peers are at epoch {newest}, we are at {my_epoch}")
    theirs = _majority_with_us(my_hash, my_epoch, live)
    if exact_average and theirs is not None and theirs != my_hash:
        donors = tuple(r.peer_id for r in live if r.epoch == my_epoch and r.state_hash == theirs)
        return SyncDecision(
            "download",
            my_epoch,
            donors,
            f"forked: peers hold state {theirs[:12]} at epoch {my_epoch}, we hold {my_hash[:12]}",
        )
    return SyncDecision("train", my_epoch, (), "in sync")


def _majority_with_us(my_hash: str, my_epoch: int, live: list[PeerRecord]) -> str | None:
    """The hash most holders of ``my_epoch`` published, ourselves included (ties broken by the hash string, so every
    peer with the same view picks the same one); a coordinator's hash wins. None: nobody else is at our epoch.

    Without our own vote, a member of the 2-peer side of a 2-1 fork saw a 1-1 tie among the others and downloaded
    the lone peer's state while the lone peer downloaded theirs (utilization bench, 2026-11-25)."""
    at_epoch = [r for r in live if r.epoch == my_epoch and r.state_hash]
    if not at_epoch:
        return None
    authority = [r.state_hash for r in at_epoch if r.role == "coordinator"]
    if authority:
        return authority[0]
    counts = Counter(r.state_hash for r in at_epoch)
    counts[my_hash] += 1
    return max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]


def may_commit_alone(
    my_peer_id: str, my_epoch: int, records: Iterable[PeerRecord], now: float, stale_after_s: float
) -> tuple[bool, str]:
    """A round of one peer may be applied only if no other live trainer is at our epoch or later, or computing a
    pseudo-gradient for it (``phase_epoch``: with overlap a peer's state lags the round its phase is for).

    Otherwise applying it would fork the run: the others will average without us, and we must wait or resync.
    """
    others = [
        r
        for r in records
        if r.peer_id != my_peer_id
        and r.role == "trainer"
        and not r.left_reason
        and now - r.updated_at <= stale_after_s
        and (r.epoch >= my_epoch or r.phase_epoch >= my_epoch)
    ]
    if others:
        return False, f"{len(others)} other live trainer(s) at epoch >= {my_epoch}; a solo step would fork the run"
    return True, "no other live trainer"


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
) -> RoundPolicy:
    """The retry / solo-commit / resync / lost-DHT policy of the train loop, after one averaging attempt.

    Rules, in order: stopping stops; a swarm unreadable for over ``dht_lost_after_s`` is "lost"; a committed group of
    two or more is applied; a group of one is applied only on a real view of the swarm with no other live trainer at
    our epoch or later (``may_commit_alone``: else it would fork the run); after a failure, peers at a newer epoch or a
    different hash of ours mean "resync"; otherwise retry with exponential backoff (0.25 s doubling, at most 4 s),
    past ``max_retries`` only while live peers of our epoch may still come and the round's deadline is not reached;
    then "carry". Nothing a peer computed is thrown away here: "resync" and "carry" keep the contribution.

    Args:
        records: the swarm's peer records (ours included or not); now: DHT time, seconds.
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
            ok, why = may_commit_alone(my_peer_id, view.epoch, records, now, stale_after_s)
            if ok:
                return RoundPolicy("apply", f"alone: {why}")
            failure = f"alone: {why}"
    sync = decide_sync(my_peer_id, view.epoch, view.my_hash, records, now, stale_after_s, exact_average)
    if sync.action == "download":
        return RoundPolicy("resync", f"{failure}; {sync.reason}")
    waiting_for_peers = not may_commit_alone(my_peer_id, view.epoch, records, now, stale_after_s)[0]
    if view.attempt > max_retries and not (waiting_for_peers and view.time_left_s > 0):
        why = "round deadline reached" if waiting_for_peers else "no other live peer at our epoch"
        return RoundPolicy("carry", f"{failure}; {why} after {view.attempt} attempts: train on, send both later")
    return RoundPolicy("retry", failure, backoff_s=min(0.25 * 2 ** (view.attempt - 1), 4.0))


def keep_carried(
    carried_epoch: int, new_epoch: int, carried_samples: int, max_samples: int, max_staleness: int = 0
) -> tuple[bool, str]:
    """May a pseudo-gradient computed against the state of ``carried_epoch`` go into the round of ``new_epoch``?

    A contribution whose round failed while nobody moved on is sent again with the next one (same state: nothing is
    stale). Past ``max_staleness`` epochs it is dropped, as is a contribution whose weight would exceed
    ``max_samples`` (``averaging.max_samples_per_round``, what other peers accept). The trainer uses 0: in the
    utilization bench a pseudo-gradient carried across a state download (one epoch stale) with the weight of two
    phases took the eval loss from 2.72 to 4.39 for one epoch (dev/LOG.md, 2026-11-25), while the swarm's schedule
    kept every sample without it.
    """
    if new_epoch - carried_epoch > max_staleness:
        return False, f"computed at epoch {carried_epoch}, {new_epoch - carried_epoch} epochs stale"
    if carried_samples > max_samples:
        return False, f"{carried_samples} samples exceed averaging.max_samples_per_round ({max_samples})"
    return True, "kept"
