"""What the members of a butterfly round agree on: who contributes (step 2, HAVE) and whether to commit (step 5, VOTE).

``agree_contributors`` is the pure rule every member applies to the same HAVE frames, ``quorate`` the rule for how
many may go on without the others. ``CommitVote`` is the commit of
one attempt of an ``allreduce.ButterflyRound`` (which creates it and owns the transport it uses): check the full
result with the caller's ``accept``, vote, wait for every vote, commit only if all match ours and ours left. The
algorithm and its failure handling are in the ``allreduce`` module docstring; why it never forks is here.

Why no member ever commits two different results: an attempt commits only with every vote of its members; a member
goes on to a new attempt only (a) before it voted in this one (then its vote is missing everywhere), or (b) after it
voted, on seeing a member still counted name a removed set ours does not contain: that member went on before voting
(by induction someone did), so nobody can commit this attempt. A member whose vote went out and then misses a vote
because a voter failed cannot tell whether that voter's vote reached the others: it fails holding the result it voted
for (the two-phase-commit gap below). Members that disagree on C0 (a HAVE that reached some and not others) or on the
removed set produce different vote hashes and nobody commits. An attempt needs at least max(2, ``min_group_size``)
members and a strict majority of the members the round was declared with: the two sides of a network partition each
go on without the other, and only one of them may commit.

The two-phase-commit gap: a member that has voted and then misses a vote (the voter died after voting, a link broke,
or the deadline came) fails while the others, who got every vote, commit. Such a failure carries the result we voted
for (``RoundFailed.voted``); DiLoCo applies it once a member's record shows the epoch it committed with the state
hash that result gives (``diloco.round_policy.committed_without_us``), so the gap costs a few seconds instead of a
fork. Failing that, peers publish their state hash per epoch and a peer whose hash disagrees with the majority
downloads the state.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Sequence

import blake3
import msgpack
import torch

from hivetrain.averaging.base import RoundFailed, RoundResult
from hivetrain.averaging.config import AveragingConfig
from hivetrain.averaging.receive import RoundReceiver
from hivetrain.averaging.reduce import Plan, RoundOutcome
from hivetrain.averaging.transport import RoundTransport
from hivetrain.averaging.wire import FrameType, mac
from hivetrain.faults import FaultInjected, HookPoint

logger = logging.getLogger(__name__)


class CommitVote:
    """The commit vote of one round's attempts (one per ``ButterflyRound``; see the module docstring).

    Args:
        round_id, me, config: the round's.
        transport: the round's links (votes are sent and awaited on it).
        receiver: holds the result buffers (``receiver.out(removed)``).
        accept: the caller's check of the full result before we vote (``base.Averager.average``); None = accept.
        hook: fires a fault hook: hook(point, attempt, **context).
        send: queues a frame: send(peer id, frame type, attempt, meta).
        changed: changed(contributors, removed) -> ``removed`` plus what members still counted say they removed.
    """

    def __init__(
        self,
        *,
        round_id: str,
        me: str,
        config: AveragingConfig,
        transport: RoundTransport,
        receiver: RoundReceiver,
        accept: Callable[[torch.Tensor, tuple[str, ...]], str] | None,
        hook: Callable[..., None],
        send: Callable[[str, FrameType, int, dict], None],
        changed: Callable[[frozenset[str], frozenset[str]], frozenset[str]],
    ):
        self.round_id, self.me, self.config = round_id, me, config
        self.transport, self.receiver, self.accept = transport, receiver, accept
        self._hook, self._send, self._changed = hook, send, changed
        self.votes_left = False  # we failed after our votes left: the round closes its links gracefully behind them

    def commit(
        self, sub: int, plan: Plan, members: list[str], removed: frozenset[str], weights: dict[str, float],
        digests: list[bytes], contributors: frozenset[str], deadline: float, out: torch.Tensor,
    ) -> RoundOutcome | frozenset[str]:  # fmt: skip
        """Vote on attempt ``sub`` among ``members`` and commit it, or say why not.

        Args:
            sub: the attempt (the number of members removed so far); plan: the round's slice cut.
            members: the attempt's members in the round's order; removed: the members it goes on without.
            weights: member -> weight (samples) of the attempt's contributors.
            digests: BLAKE3 of every reduced slice's bytes, in slice order.
            contributors: the round's contributors C0 (step 2).
            deadline: ``time.monotonic()`` by which we must vote; votes are awaited ``commit_timeout_s`` longer.
            out: the caller's result buffer, fp32 (n,): a result committed after a repair is copied into it.

        Returns:
            The committed outcome, or the larger removed set to go on with when a member still counted went on
            without someone before voting (nobody can commit this attempt).

        Raises:
            RoundFailed: "timeout" (the deadline came before we could vote, or our vote did not leave in time:
                ``voted`` set), "refused" (our ``accept`` refused: we voted against it), "aborted" (votes differ),
                "peer_failed" (a voter failed or the others went on without us: ``voted`` set where we had voted).
        """
        others = [p for p in members if p != self.me]
        summary = msgpack.packb([self.round_id, sub, sorted(removed), members, sorted(weights.items()), digests])
        full_hash = blake3.blake3(summary).digest()
        result = self.receiver.out(removed)
        self._hook(HookPoint.AVERAGING_BEFORE_COMMIT, sub)
        # One rule for every member, so that all commit or none does: vote only before our deadline; then wait for
        # every vote until the deadline plus a grace of commit_timeout_s (members' deadlines differ by their
        # matchmaking skew, and a vote queued behind RESULT frames on a home uplink takes seconds to arrive); commit
        # if all votes match and ours have left. A fixed wait after our own vote made an early voter abort while a
        # late one, which had every vote, committed: a fork (utilization bench, 2.5 Mbit/s links, 2026-11-25). A
        # member that dies or stalls meanwhile is detected by its link (closed, or no byte for part_timeout_s).
        refusal = self.accept(result, tuple(sorted(weights))) if self.accept is not None else ""
        if time.monotonic() >= deadline:
            raise RoundFailed("timeout", "the round deadline came before we could vote")
        if refusal:  # a vote nobody's matches: every member aborts, nobody commits (and nobody holds a ``voted``)
            full_hash = blake3.blake3(b"refused" + full_hash).digest()
        lost: set[str] = set()
        for p in others:
            try:
                self._hook(HookPoint.AVERAGING_VOTE, sub, to=p)
            except FaultInjected:  # tests of the two-phase-commit gap: this vote is lost on the way
                lost.add(p)
                continue
            vote_mac = mac(self.transport.key(p), b"vote", self.round_id.encode(), sub.to_bytes(2, "little"), full_hash)
            self._send(p, FrameType.VOTE, sub, {"hash": full_hash, "mac": vote_mac})
        votes_deadline = deadline + self.config.commit_timeout_s
        if refusal:  # let our votes leave before the links close (gracefully: ``run``), so the others abort at once
            self.flush_votes(votes_deadline)
            logger.warning("round %s: we refused the result: %s", self.round_id[:8], refusal)
            raise RoundFailed("refused", refusal)
        inbox = self.transport.inbox
        awaited = lambda: [p for p in others if inbox.votes.get(p, (-1, b""))[0] != sub]  # noqa: E731
        moved = lambda: self._changed(contributors, removed) != removed  # noqa: E731
        try:
            self.transport.wait(lambda: not awaited() or moved(), awaited, votes_deadline, "waiting for votes")
        except RoundFailed as exc:  # members that got every vote may commit: hand the caller what we voted for
            # and let our own votes leave first: closing our links abruptly behind a queued vote made a member that
            # had every other vote fail too (chaos lost-vote: 2 members recovering instead of the one that missed)
            linger = min(votes_deadline, time.monotonic() + min(1.0, self.config.commit_timeout_s))
            self.flush_votes(linger)
            # and keep our links open until the votes still on their way to us have arrived: closing behind one
            # made its sender, which had every vote, fail its "our vote left" check and recover too (chaos
            # lost-vote, 1 run of 3 idle: the member that missed the vote failed at once on the voter's FIN)
            late = lambda: not [p for p in awaited() if p not in inbox.errors]  # noqa: E731
            try:
                self.transport.wait(late, (), linger, "late votes")
            except RoundFailed:
                pass
            raise self.voted(exc, removed, weights) from None
        grown = self.transport.read(lambda ib: self._changed(contributors, removed))
        if grown != removed and awaited():
            # A member still counted went on without someone before voting here (a member that voted never starts
            # that), so its vote for this attempt never comes and nobody can commit it: go on with the others.
            if self.me in grown:
                raise RoundFailed("peer_failed", "the other members went on without us")
            return grown
        disagree = [p for p in others if inbox.votes[p] != (sub, full_hash)]
        if disagree:  # nobody can commit: every member needs every vote to match its own hash; ours still must
            self.flush_votes(votes_deadline)  # reach the others, so that they abort on them too
            raise RoundFailed("aborted", f"commit votes of {disagree} differ from ours")
        self.transport.flush(votes_deadline)
        unsent = [p for p in others if p not in lost and not self.transport.has_sent(p, FrameType.VOTE)]
        if unsent:  # still queued behind our RESULT frames: it reaches them after they gave up
            exc = RoundFailed("timeout", f"our vote to {unsent} did not leave before the votes deadline")
            raise self.voted(exc, removed, weights)
        if result is not out:  # committed after a repair: the caller's ``out`` gets the result too
            out.copy_(result)
            result = out
        bytes_sent, bytes_received = self.transport.byte_counts()
        return RoundOutcome(
            flat=result,
            contributors=tuple(sorted(weights)),
            excluded=tuple(sorted(set(plan.order) - set(weights))),
            total_weight=math.fsum(weights.values()),
            bytes_sent=bytes_sent,
            bytes_received=bytes_received,
            send_busy_s=self.transport.send_busy_s(),
            weights=tuple(sorted(weights.items())),
        )

    def flush_votes(self, deadline: float) -> None:
        """We fail after voting, and nobody can commit: let our queued votes leave (until ``deadline``,
        ``time.monotonic()``) and have the round close our links gracefully behind them."""
        self.transport.flush(deadline)
        self.votes_left = True

    def voted(self, exc: RoundFailed, removed: frozenset[str], weights: dict[str, float]) -> RoundFailed:
        """``exc`` with ``voted`` set to (a copy of) the result we voted for: fp32 (n,) as the single tensor."""
        if exc.reason != "excluded":
            exc.voted = RoundResult(
                tensors=[self.receiver.out(removed).clone()],
                group=tuple(sorted(weights)),
                total_weight=math.fsum(weights.values()),
                round_id=self.round_id,
            )
        return exc


def quorate(left: int, declared: int, min_group_size: int) -> bool:
    """Whether ``left`` members may commit a round declared with ``declared``: at least max(2, ``min_group_size``),
    and a strict majority, so that the two sides of a network partition, each going on without the other, never both
    commit."""
    return left >= max(2, min_group_size) and 2 * left > declared


def agree_contributors(
    haves: dict[str, object], order: Sequence[str], silent: Collection[str] = ()
) -> tuple[frozenset[str], dict[str, float]]:
    """The contributors every member computes alike from the HAVE frames, and their weights (samples).

    A member counts if every HAVE holds its part and all of them give it one weight, and it sent a well-formed HAVE
    or is ``silent``: a member whose part a reducer found bad (or never got, its link having failed) is out, and so
    is one that claimed different weights to different reducers, or sent a malformed HAVE. ``haves``: member -> its
    HAVE metadata, ours included. ``silent``: the members we dropped before their HAVE reached us (they failed).
    A member that dies while its HAVE frames leave reaches some members and not others; counting it when silent
    gives every member the same set (those without its HAVE remove it at once, the others when they learn it is
    gone: ``allreduce``), where leaving it out made two survivors expect different contributors in a slice and
    abort the round (``test_engine_faults`` at ``averaging.after_reduce`` on a loaded machine, 2026-12-02). Its own
    HAVE only says which parts of its own slice it held, and that slice is reduced again without it."""
    valid: dict[str, dict[str, float]] = {}
    for p, meta in haves.items():
        have = meta.get("have") if isinstance(meta, dict) else None
        if isinstance(have, dict) and all(
            isinstance(q, str) and q in order and isinstance(w, int | float) and math.isfinite(w) and w >= 0
            for q, w in have.items()
        ):
            valid[p] = {q: float(w) for q, w in have.items()}
    senders = set(valid) | (set(silent) - set(haves))  # a malformed HAVE is not silence
    held = senders.intersection(*(set(h) for h in valid.values())) if valid else set()
    claimed: dict[str, set[float]] = {}
    for h in valid.values():
        for q, w in h.items():
            claimed.setdefault(q, set()).add(w)
    contributors = frozenset(q for q in held if len(claimed[q]) == 1)
    return contributors, {q: next(iter(claimed[q])) for q in contributors}


def bad_claims(haves: dict[str, object], me: str) -> str:
    """What the HAVE frames say about our part, for the error message."""
    said = []
    for p, meta in sorted(haves.items()):
        bad = meta.get("bad") if isinstance(meta, dict) else None
        if isinstance(bad, dict) and me in bad:
            said.append(f"{p}: {bad[me]}")
    return "; ".join(said) or "a reducer did not hold our part"
