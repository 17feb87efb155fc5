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

    Download when a live peer is at a newer epoch (we are behind), or when peers at our epoch published a different
    majority hash than ours (our last outer step diverged: e.g. we were paused through a commit).

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
    theirs = hashes.get(my_epoch)
    if exact_average and theirs is not None and theirs != my_hash:
        donors = tuple(r.peer_id for r in live if r.epoch == my_epoch and r.state_hash == theirs)
        return SyncDecision(
            "download",
            my_epoch,
            donors,
            f"forked: peers hold state {theirs[:12]} at epoch {my_epoch}, we hold {my_hash[:12]}",
        )
    return SyncDecision("train", my_epoch, (), "in sync")


def may_commit_alone(
    my_peer_id: str, my_epoch: int, records: Iterable[PeerRecord], now: float, stale_after_s: float
) -> tuple[bool, str]:
    """A round of one peer may be applied only if no other live trainer is at our epoch or later.

    Otherwise applying it would fork the run: the others will average without us, and we must wait or resync.
    """
    others = [
        r
        for r in records
        if r.peer_id != my_peer_id
        and r.role == "trainer"
        and now - r.updated_at <= stale_after_s
        and r.epoch >= my_epoch
    ]
    if others:
        return False, f"{len(others)} other live trainer(s) at epoch >= {my_epoch}; a solo step would fork the run"
    return True, "no other live trainer"
