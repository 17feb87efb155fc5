"""The quorum rule: which (epoch, state hash) the live peers of a run back, and which epochs the run's age rules out.

A peer that adopts a state it did not compute (a joiner, a peer that fell behind or forked, the coordinator, a stage
server joining a stage) must not do so on one peer's word: in issue 12 one signed record claiming epoch 10^9 with the
hash of random weights was downloaded by every honest peer within 3.5 s. ``backed_states`` is the one rule every
such decision uses (``diloco/sync_policy.py`` for trainers and the coordinator, ``swarm/server.py`` for stage
servers): a pure function of the claims and a ``QuorumConfig``.

The rule, for a state (E, h), over distinct peers (``voters``; a peer's own state counts when it holds one):

1. **holders**: at least ``min_peers`` voters publish exactly (E, h);
2. **agreement**: they are more than ``min_fraction`` of the voters at epoch E (any hash), so two hashes can never
   both be backed at one epoch unless ``min_fraction < 0.5``, and then the larger group wins, ties broken by the
   hash string so that every peer with the same view picks the same one;
3. **progress**: the voters at epoch E or later are at least ``min_fraction`` of the population. The population is
   every voter at epoch >= 1: voters behind E count against it, which is what stops a minority that claims an epoch
   far ahead of the rest (2 colluders at E + 5 among 3 honest peers at E: 2 of 5). "At least", not "more than": a
   peer that died leaves its record behind E for the record TTL (30 s), and with a strict majority the 2 survivors of
   a 4-peer swarm that lost one could not be followed by the third, which then committed alone and forked the run
   (chaos kill-one-of-four, 2026-11-25). The price: half of the identities (and at least ``min_peers``) can lead.
   Voters at epoch 0 hold θ₀, which every peer builds from the run seed; they are joiners, who neither back nor
   oppose a trained state, so a crowd of joiners cannot keep each other from catching up. With ``count_untrained``
   (the coordinator's follower, which takes a lone holder) they do count: at a run's start every honest peer is at
   epoch 0, and a lone liar would otherwise be "1 of 1" (chaos lying-epoch-takeover, 2026-11-25).

With ``exact=False`` (moshpit or gossip groups: peers of one epoch hold different states by design) rules 1 and 2
count voters at epoch E whatever their hash; no hash can be checked against others then, and the one published is
the largest hash string among the epoch's holders.

**Weights.** A trainer weighs each voter in rules 2 and 3 by the rounds it committed with it (``seniority_weights``:
1 + that count, capped at ``SENIORITY_CAP``; rule 1 still counts identities): identities are free in an open run,
rounds committed with honest peers are not, so fresh identities one epoch ahead of peers that trained together do
not outvote them (issue 28). A joiner has no rounds with anyone, so to it every voter weighs 1.

What it does not stop: identities are free, so a quorum counts identities, not people (a Sybil attacker with more
identities than the honest peers wins; admission, issue 12 item 6, is the answer), and a colluding majority is the
run.

``max_plausible_epoch`` bounds an epoch by the run's age: epochs cannot come faster than one per ``min_epoch_s``.
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol


class Claim(Protocol):
    """What a peer says about its state (``PeerRecord``, ``StageRecord`` and ``Vote`` all have these fields)."""

    @property
    def peer_id(self) -> str: ...

    @property
    def epoch(self) -> int: ...

    @property
    def state_hash(self) -> str: ...


@dataclass(frozen=True)
class Vote:
    """A claim made of plain values (e.g. our own state, which has no record in the caller's view)."""

    peer_id: str
    epoch: int
    state_hash: str


@dataclass(frozen=True)
class QuorumConfig:
    """How much agreement a state needs before a peer adopts it.

    Args:
        min_peers: distinct peers that must hold exactly the state. 2 (the default): no single identity can make a
            peer adopt a state. A trainer with nobody at its epoch may still adopt a lone peer's newer state, on
            evidence of its own (``sync_policy.decide_sync(unbacked=True)`` and ``loss_check``: its loss on the
            trainer's held-out windows); the coordinator follows with 1 (``FollowerOptions``), since a lone trainer
            defines the run's progress anyway, and checks the size of each step it takes (``step_check``).
        min_fraction: the holders must be more than this fraction of the voters at the state's epoch (0.5: a 1-1
            tie adopts nothing), and the voters at that epoch or later at least this fraction of the population
            (voters at epoch >= 1), so a minority cannot run ahead of the rest (rule 3 of the module docstring).
        min_epoch_s: the fewest seconds one epoch (an inner phase plus its averaging round) can take, for the
            run-age bound. The fastest runs hivetrain has (tiny models on loopback in the e2e tests) take about 1 s
            per epoch; 0.1 s leaves a 10x margin so no honest run is ever judged implausible, and an epoch of 10^6
            still needs a run 28 h old.
        max_clock_skew_s: slack added to the run's age for clocks that differ, seconds (the DHT record guard's).
        count_untrained: voters at epoch 0 count in the population of rule 3 too. Set it where ``min_peers`` is 1:
            a lone trained claim among live peers that still hold θ₀ is then a minority, not "1 of 1".

    Raises:
        ValueError: ``min_peers < 1``, ``min_fraction`` outside [0, 1), ``min_epoch_s <= 0`` or a negative skew.
    """

    min_peers: int = 2
    min_fraction: float = 0.5
    min_epoch_s: float = 0.1
    max_clock_skew_s: float = 60.0
    count_untrained: bool = False

    def __post_init__(self) -> None:
        if self.min_peers < 1:
            raise ValueError(f"QuorumConfig.min_peers must be >= 1, got {self.min_peers}")
        if not 0.0 <= self.min_fraction < 1.0:
            raise ValueError(f"QuorumConfig.min_fraction must be in [0, 1), got {self.min_fraction}")
        if self.min_epoch_s <= 0 or self.max_clock_skew_s < 0:
            raise ValueError("QuorumConfig.min_epoch_s must be > 0 and max_clock_skew_s >= 0")


@dataclass(frozen=True)
class Backing:
    """The support a backed state has (counts of distinct peers).

    Attributes:
        holders: peer IDs publishing exactly (``epoch``, ``state_hash``), sorted.
        at_epoch: voters at ``epoch``, any hash; passed: voters at ``epoch`` or later; population: voters counted.
    """

    epoch: int
    state_hash: str
    holders: tuple[str, ...]
    at_epoch: int
    passed: int
    population: int

    def describe(self) -> str:
        return f"{len(self.holders)} of {self.population} live peer(s) hold epoch {self.epoch} ({self.state_hash[:12]})"


def distinct_voters(claims: Iterable[Claim]) -> list[Claim]:
    """One claim per peer ID (a peer publishes one record per key; of duplicates the newest epoch is kept, then the
    largest hash), claims without a state hash dropped, sorted by peer ID."""
    held = [c for c in claims if c.state_hash]
    best: dict[str, Claim] = {c.peer_id: c for c in held}
    if len(best) < len(held):  # duplicates (rare): keep the newest epoch, then the largest hash
        best = {}
        for claim in held:
            seen = best.get(claim.peer_id)
            if seen is None or (claim.epoch, claim.state_hash) > (seen.epoch, seen.state_hash):
                best[claim.peer_id] = claim
    return [best[p] for p in sorted(best)]


_state_hash = operator.attrgetter("state_hash")


def backed_states(
    claims: Iterable[Claim], config: QuorumConfig, exact: bool = True, weights: Mapping[str, float] | None = None
) -> dict[int, Backing]:
    """epoch -> the state a quorum of ``claims`` backs at that epoch (the rule in the module docstring).

    Args:
        claims: the live claims to weigh, ours included when we hold a state; the caller drops stale, departed,
            banned and implausible ones. Several claims of one peer ID count once.
        exact: peers of an epoch hold identical states (butterfly averaging); False for moshpit/gossip groups.
        weights: peer ID -> weight (> 0) in rules 2 and 3, 1 for a peer not listed; rule 1 counts distinct
            identities. A trainer weighs peers by the rounds it committed with them (``seniority_weights``), so fresh
            identities, free in an open run, cannot outvote the peers it trains with (issue 28). None = all 1.

    Returns:
        Only epochs whose state passes the rule; an epoch nobody backs enough is absent. ``Backing``'s counts are
        identities, whatever the weights.
    """
    voters = distinct_voters(claims)
    weight = (lambda p: 1.0) if weights is None else (lambda p: weights.get(p, 1.0))
    by_epoch: dict[int, list[Claim]] = defaultdict(list)  # one pass: O(voters), not O(voters x epochs)
    for v in voters:
        by_epoch[v.epoch].append(v)  # each list stays sorted by peer ID, as ``voters`` is
    mass = {epoch: sum(weight(v.peer_id) for v in at) for epoch, at in by_epoch.items()}
    trained = sum(m for epoch, m in mass.items() if epoch >= 1)
    trained_count = sum(len(at) for epoch, at in by_epoch.items() if epoch >= 1)
    passed, passed_mass = len(voters), sum(mass.values())  # voters at ``epoch`` or later, epochs ascending
    result: dict[int, Backing] = {}
    for epoch in sorted(by_epoch):
        at = by_epoch[epoch]
        untrained_out = epoch >= 1 and not config.count_untrained
        population = trained if untrained_out else sum(mass.values())
        hashes = list(map(_state_hash, at))
        if exact:
            held: dict[str, float] = defaultdict(float)
            for v, h in zip(at, hashes, strict=True):
                held[h] += weight(v.peer_id)
            state_hash, held_mass = max(held.items(), key=lambda kv: (kv[1], kv[0]))
        else:
            state_hash, held_mass = max(hashes), mass[epoch]
        count = sum(h == state_hash for h in hashes) if exact else len(at)
        if (
            count >= config.min_peers
            and held_mass > config.min_fraction * mass[epoch]
            and passed_mass >= config.min_fraction * population
        ):
            holders = tuple(v.peer_id for v, h in zip(at, hashes, strict=True) if h == state_hash)
            counted = trained_count if untrained_out else len(voters)
            result[epoch] = Backing(epoch, state_hash, holders, len(at), passed, counted)
        passed -= len(at)
        passed_mass -= mass[epoch]
    return result


SENIORITY_CAP = 10
"""Rounds committed together beyond which a peer weighs no more: a peer we trained with for 10+ rounds counts as 11
fresh identities, and no single veteran outweighs the rest of a large swarm."""


def seniority_weights(seniority: Mapping[str, int], me: str) -> dict[str, float]:
    """Vote weights from ``seniority`` (peer ID -> outer steps we committed in one group with it): 1 + that count,
    capped at ``SENIORITY_CAP``; our own vote weighs as much as our most senior partner (we took part in all those
    rounds). A peer with no rounds with us weighs 1, so a joiner, who has none, weighs everyone alike: the plain
    count (it must still be able to join)."""
    weights = {p: 1.0 + min(n, SENIORITY_CAP) for p, n in seniority.items() if n > 0}
    if weights:
        weights[me] = max(weights.values())
    return weights


def max_plausible_epoch(run_started_at: float | None, now: float, config: QuorumConfig) -> int | None:
    """The newest epoch a run that began at ``run_started_at`` can have reached by ``now`` (both DHT time, seconds),
    at one epoch per ``min_epoch_s`` at most, with ``max_clock_skew_s`` of slack; None when the start is unknown."""
    if run_started_at is None:
        return None
    return max(0, math.floor((now - run_started_at + config.max_clock_skew_s) / config.min_epoch_s))


def implausible(claims: Iterable[Claim], max_epoch: int | None) -> tuple[str, ...]:
    """Peer IDs (sorted, distinct) of claims past ``max_epoch``; none when the bound is unknown."""
    if max_epoch is None:
        return ()
    return tuple(sorted({c.peer_id for c in claims if c.epoch > max_epoch}))
