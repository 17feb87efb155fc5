"""Decisions of a state download, as pure functions of their inputs and ``now_s``: which manifest to try first, which
chunk a donor fetches next, and when a chunk in flight is given up on.

A download is cut into chunks that are fetched from every donor that offers the expected state, each chunk judged on
its own: a chunk that makes no progress for ``stall_timeout_s``, or averages less than ``min_rate_bytes_per_s`` once
it has run ``rate_grace_s``, is re-requested from another donor at once and the slow donor is dropped. Once nothing
is left to hand out, an idle donor also re-requests a chunk in flight that it would finish sooner than the donor
holding it (endgame mode of BitTorrent: Cohen 2003, "Incentives Build Robustness in BitTorrent", section 2.4 "Piece
Selection"; hedged requests: Dean & Barroso 2013, "The Tail at Scale", CACM 56(2)); the first copy to arrive wins.
So one slow or dripping donor costs the download at most about one chunk's time at an honest donor's rate.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from hivetrain.diloco.state_wire import Manifest


@dataclass(frozen=True)
class FetchConfig:
    """Deadlines and limits of a state download (per chunk, not per download).

    Attributes:
        stall_timeout_s: a chunk in flight with no new byte for this long is re-requested elsewhere, seconds.
        min_rate_bytes_per_s: a chunk averaging less than this since its request is re-requested elsewhere ...
        rate_grace_s: ... once it has run this long, seconds (a dripping donor is cut off after this).
        header_timeout_s: a chunk's reply header (a few bytes) must arrive within this, seconds.
        meta_grace_s: once one donor has answered, the others get at most this long, or as long again as that
            first answer took if longer, seconds (a donor that drips its reply cannot hold the download up for a
            whole network timeout).
        max_copies: a chunk is fetched from at most this many donors at once (>= 1; 1 disables re-requests of
            chunks in flight).
        hedge_margin_s: an idle donor re-requests a chunk in flight only if it would finish it at least this much
            sooner, seconds.
        poll_s: how often a transfer in progress is judged, seconds (<= stall_timeout_s).
    """

    stall_timeout_s: float = 5.0
    min_rate_bytes_per_s: float = 16 * 2**10
    rate_grace_s: float = 3.0
    header_timeout_s: float = 5.0
    meta_grace_s: float = 2.0
    max_copies: int = 2
    hedge_margin_s: float = 0.5
    poll_s: float = 0.1

    def __post_init__(self) -> None:
        if min(self.stall_timeout_s, self.rate_grace_s, self.header_timeout_s, self.poll_s) <= 0:
            raise ValueError("stall_timeout_s, rate_grace_s, header_timeout_s and poll_s must be > 0")
        if self.min_rate_bytes_per_s < 0 or self.meta_grace_s < 0 or self.hedge_margin_s < 0:
            raise ValueError("min_rate_bytes_per_s, meta_grace_s and hedge_margin_s must be >= 0")
        if self.max_copies < 1:
            raise ValueError(f"max_copies must be >= 1, got {self.max_copies}")
        if self.poll_s > self.stall_timeout_s:
            raise ValueError("poll_s must not exceed stall_timeout_s")


@dataclass
class Attempt:
    """One request of one chunk from one donor, updated as bytes arrive (times in seconds of the download's clock)."""

    donor: str
    index: int
    num_bytes: int
    started_s: float
    last_progress_s: float
    received_bytes: int = 0


@dataclass(frozen=True)
class Verdict:
    """What to do with a chunk in flight; ``reason`` is for people (logs, reports)."""

    action: Literal["continue", "stalled", "too_slow"]
    reason: str


def judge_transfer(attempt: Attempt, now_s: float, config: FetchConfig) -> Verdict:
    """Keep waiting for a chunk, or give up on it because it stalled or crawls below the rate floor."""
    idle_s = now_s - attempt.last_progress_s
    if idle_s >= config.stall_timeout_s:
        return Verdict("stalled", f"no byte of chunk {attempt.index} for {idle_s:.1f} s")
    elapsed_s = now_s - attempt.started_s
    if elapsed_s >= config.rate_grace_s:
        rate = attempt.received_bytes / elapsed_s
        if rate < config.min_rate_bytes_per_s:
            return Verdict(
                "too_slow",
                f"chunk {attempt.index} at {rate:.0f} B/s after {elapsed_s:.1f} s "
                f"(floor {config.min_rate_bytes_per_s:.0f} B/s)",
            )
    return Verdict("continue", "")


def eta_s(attempt: Attempt, now_s: float, fresh_eta_s: float) -> float:
    """Seconds until ``attempt`` completes at its average rate so far; with no byte yet, ``fresh_eta_s`` (what a new
    request would take) plus the time it has already waited."""
    elapsed_s = max(now_s - attempt.started_s, 0.0)
    if attempt.received_bytes <= 0:
        return fresh_eta_s + elapsed_s
    rate = attempt.received_bytes / max(elapsed_s, 1e-9)
    return (attempt.num_bytes - attempt.received_bytes) / rate


@dataclass(frozen=True)
class Pick:
    """The chunk a donor should fetch next (None: nothing worth fetching now) and why."""

    index: int | None
    reason: str


def pick_chunk(
    donor: str,
    now_s: float,
    pending: Sequence[int],
    in_flight: Mapping[int, Sequence[Attempt]],
    rate_bytes_per_s: float | None,
    config: FetchConfig,
) -> Pick:
    """Next chunk for an idle ``donor``: the first pending one; with none pending, the chunk in flight elsewhere that
    this donor would finish soonest relative to its current holders (a re-request), if it beats them by
    ``hedge_margin_s``.

    Args:
        pending: chunk indices nobody is fetching, in the order to fetch them.
        in_flight: chunk index -> its attempts in progress.
        rate_bytes_per_s: this donor's measured rate (None: unknown, assumed as fast as needed).
    """
    if pending:
        return Pick(pending[0], "next pending chunk")
    best: tuple[float, int] | None = None
    for index, attempts in in_flight.items():
        if not attempts or len(attempts) >= config.max_copies or any(a.donor == donor for a in attempts):
            continue
        mine_s = attempts[0].num_bytes / rate_bytes_per_s if rate_bytes_per_s else 0.0
        theirs_s = min(eta_s(a, now_s, mine_s) for a in attempts)
        gain_s = theirs_s - mine_s
        if gain_s >= config.hedge_margin_s and (best is None or gain_s > best[0]):
            best = (gain_s, index)
    if best is None:
        return Pick(None, "nothing pending; no chunk in flight worth re-requesting")
    gain = "forever" if math.isinf(best[0]) else f"{best[0]:.1f} s"
    return Pick(best[1], f"re-request chunk {best[1]} in flight elsewhere (saves {gain})")


@dataclass(frozen=True)
class Offer:
    """A donor's manifest for a state whose (epoch, hash) peers published."""

    donor: str
    manifest: Manifest


@dataclass(frozen=True)
class Candidate:
    """One manifest and every donor that offered it."""

    manifest: Manifest
    donors: tuple[str, ...] = field(default=())


def rank_candidates(offers: Sequence[Offer], expected: Mapping[int, str], rng: random.Random) -> list[Candidate]:
    """Manifests to try in order: newest published epoch first; within an epoch, the manifest most donors offered
    first (honest donors of one state all compute the same one), ties in random order, never by peer ID (an attacker
    can choose an ID that sorts first). Offers whose (epoch, hash) is not in ``expected`` are left out.

    Donors of a candidate are shuffled too, so no donor position is predictable.
    """
    groups: dict[Manifest, list[str]] = {}
    for offer in offers:
        if expected.get(offer.manifest.epoch) == offer.manifest.state_hash and offer.donor not in groups.get(
            offer.manifest, ()
        ):
            groups.setdefault(offer.manifest, []).append(offer.donor)
    candidates = []
    for manifest, donors in groups.items():
        rng.shuffle(donors)
        candidates.append(Candidate(manifest, tuple(donors)))
    rng.shuffle(candidates)
    candidates.sort(key=lambda c: (-c.manifest.epoch, -len(c.donors)))  # stable: ties keep the random order
    return candidates
