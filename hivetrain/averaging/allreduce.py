"""One all-or-nothing butterfly all-reduce among an agreed group, over authenticated TCP links.

Algorithm (butterfly all-reduce = reduce-scatter + all-gather; Moshpit SGD, Ryabinin et al. 2021, Sec. 3.1; the
same cut as hivemind's ``AllReduceRunner``), for the ``k`` active members sorted by peer id:

1. Scatter: the flat fp32 vector (n,) is cut into k contiguous slices (``groups.butterfly_partition``); member i
   sends slice j, encoded by the round's codec, with its weight to member j (frame PART).
2. Reduce: member j validates every contribution to its slice (exact size and codec, finite values, weight finite in
   [0, max_samples_per_round]), drops the bad ones, aggregates the rest in peer-id order (``weighted_mean_into``,
   in place into the result, or ``bucketing.robust_aggregate``) and encodes the reduced slice *once*.
3. Gather: member j sends those same bytes to every member (frame RESULT, with the weights it used and whom it
   excluded); everyone, j included, decodes the same bytes, so the results are bit-identical. Receivers hash what they
   receive (BLAKE3, while it arrives).
4. If any member was excluded (bad data, or different weights to different reducers), every member sees it in the
   RESULT frames; the round restarts from step 1 without them (a "subround"; the excluded members fail with
   RoundFailed("excluded")), at most ``max_subrounds`` times.
5. Commit: every member that holds the full result before the round's deadline sends a vote (frame VOTE) with the
   hash of the full result, MACed with the pair key, to every member, and returns the result only if all votes
   arrived within ``commit_timeout_s`` past that deadline (a member whose link closes or stalls fails the round at
   once), match its own hash, and its own votes left by then. So a round may return up to ``commit_timeout_s``
   after its deadline. Before voting, a member asks the caller's ``accept`` check about the full result (DiLoCo's
   bound on the outer step, ``diloco.update_bound``); a member that refuses sends a vote that matches nobody's (a
   hash of "refused" and the result's hash, MACed as usual), lets it leave, and raises RoundFailed("refused"), so
   every other member fails with "aborted" (votes differ) and nobody commits, whatever the others' own checks said.
   A member that aborts on differing votes lets its own votes leave before it closes its links, so no member is left
   waiting on a closed link (which would fail it "peer_failed" holding a ``voted`` result nobody committed).

Failure handling: any failure (a link closes, no byte for ``part_timeout_s``, a protocol violation, a deadline)
makes the member close all its links and raise RoundFailed, so the others, blocked on it, fail at once too; a member
merely waiting on a slow third peer sends heartbeats (``transport``). Inputs are never modified.

The two-phase-commit gap: a member that has voted and then misses a vote (the voter died after voting, a link broke,
or the deadline came) fails while the others, who got every vote, commit. Such a failure carries the result we voted
for (``RoundFailed.voted``); DiLoCo applies it once a member's record shows the epoch it committed with the state
hash that result gives (``diloco.round_policy.committed_without_us``), so the gap costs a few seconds instead of a
fork. Failing that, peers publish their state hash per epoch and a peer whose hash disagrees with the majority
downloads the state.

Layout: this file holds the round logic (scatter, reduce, gather, subrounds, commit); by composition it uses a
``transport.RoundTransport`` (links, threads, send queues, inbox, its lock, waiting on members) and a
``receive.RoundReceiver`` (what each received frame means; plans and receive buffers); ``reduce`` the arithmetic.

Fault hooks (``FaultInjector``), context ``epoch``, ``peer`` (our peer id), ``round_id``, ``subround``:
    averaging.before_send    before sending parts; also ``flat`` (our fp32 vector) and ``frames`` (peer id ->
                             [meta dict, payload buffers]) that a "call" fault may corrupt (tests of bad peers)
    averaging.mid_transfer   once per subround, when the first part is half sent (from a sender thread)
    averaging.after_reduce   after reducing our slice, before sending it; also ``reduced`` (the fp32 slice)
    averaging.before_commit  holding the full result, before voting
    averaging.vote           before sending our vote to member ``to``; a "raise" fault drops that one vote (the
                             two-phase-commit gap in tests: the others commit, ``to`` fails with ``voted`` set)
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

import blake3
import msgpack
import torch

from hivetrain.averaging import codecs
from hivetrain.averaging.base import RoundFailed, RoundResult
from hivetrain.averaging.bucketing import aggregation_seed, robust_aggregate, robust_options
from hivetrain.averaging.config import AveragingConfig
from hivetrain.averaging.dataplane import DataPlaneServer
from hivetrain.averaging.groups import butterfly_partition
from hivetrain.averaging.receive import RoundReceiver
from hivetrain.averaging.reduce import (
    BufferPool,
    Member,
    Plan,
    RoundOutcome,
    all_finite,
    tensor_view,
    weighted_mean_into,
)
from hivetrain.averaging.robust import NoValidContribution
from hivetrain.averaging.transport import PeerFailed, RoundTransport
from hivetrain.averaging.wire import FrameType, mac
from hivetrain.faults import FaultInjected, FaultInjector, HookPoint
from hivetrain.peers.bans import BanList

__all__ = ["BufferPool", "ButterflyRound", "Member", "RoundOutcome", "all_finite", "weighted_mean_into"]

logger = logging.getLogger(__name__)


class ButterflyRound:
    """Runs one round; create one per round, call ``run`` once from the round thread.

    ``order``: the members' order (the slice cut and the order contributions are summed in); default sorted by peer
    id. ``seed_tag``: what the robust aggregation's bucketing seed derives from instead of the subround's tag. The
    columns of the two-stage all-reduce (``groups.hierarchy``) pass both, so that every column, whatever its
    members' ids, computes the same bytes from the same row means.
    """

    def __init__(
        self,
        *,
        round_id: str,
        members: Sequence[Member],
        me: str,
        secret,
        server: DataPlaneServer,
        config: AveragingConfig,
        faults: FaultInjector,
        epoch: int,
        bans: BanList,
        banned: frozenset[str] = frozenset(),
        max_weight: float | None = None,
        pool: BufferPool | None = None,
        fallback=None,
        accept: Callable[[torch.Tensor], str] | None = None,
        order: Sequence[str] | None = None,
        seed_tag: bytes | None = None,
    ):
        self.round_id, self.me = round_id, me
        self.members = {m.peer_id: m for m in sorted(members, key=lambda m: m.peer_id)}
        if order is not None:
            if sorted(order) != list(self.members):
                raise ValueError("order must list every member exactly once")
            self.members = {p: self.members[p] for p in order}
        self.seed_tag = seed_tag
        if me not in self.members:
            raise ValueError("we are not a member of this round")
        self.config, self.faults, self.epoch, self.bans, self.banned = config, faults, epoch, bans, banned
        self.accept = accept  # ``base.Averager.average``: checks the full result before we vote
        self._votes_left = False  # we failed after our votes left (``_commit``): close gracefully behind them
        max_weight = float(max_weight if max_weight is not None else config.max_samples_per_round)
        self.codec_config = codecs.CodecConfig(
            config.compression, config.codec_block_size if config.compression in ("int8", "int4") else 64
        )
        self.codec = codecs.make_codec(self.codec_config) if config.compression != "none" else None
        self.receiver = RoundReceiver(me=me, round_id=round_id, codec_config=self.codec_config, codec=self.codec,
                                      max_weight=max_weight, pool=pool or BufferPool(),
                                      plan_wait_s=config.part_timeout_s)  # fmt: skip
        self.transport = RoundTransport(round_id=round_id, me=me, members=self.members, secret=secret, server=server,
                                        config=config, on_frame=self.receiver.on_frame, fallback=fallback)  # fmt: skip
        self.receiver.transport = self.transport
        self._out: torch.Tensor | None = None
        self._residual_out: torch.Tensor | None = None  # error feedback: what the codec drops from what we send
        self._mid_fired: set[int] = set()
        self._hook_lock = threading.Lock()
        self.timings: dict[str, float] = {}  # phase -> seconds it took (for logs and benchmarks)
        self._last_mark = time.monotonic()

    # ---- public -------------------------------------------------------------------------------------------------
    def run(
        self,
        flat: torch.Tensor,
        weight: float,
        deadline: float,
        out: torch.Tensor | None = None,
        residual_out: torch.Tensor | None = None,
    ) -> RoundOutcome:
        """Average ``flat`` (fp32, shape (n,), finite; not modified) with weight ``weight`` (samples).

        Args:
            flat: our contribution, the same size on every member.
            weight: our weight, finite, in [0, max_samples_per_round].
            deadline: ``time.monotonic()`` by which the round must be over.
            out: where the result goes, fp32 (n,) (e.g. allocated and pre-faulted during matchmaking); None = new.
            residual_out: fp32 (n,) or None; with a codec, receives ``x - decode(encode(x))`` of every slice ``x``
                of ``flat`` that we encode (error feedback, ``codecs.ErrorFeedback``); written even if the round
                then fails (the caller discards it).

        Returns:
            The committed outcome.

        Raises:
            RoundFailed: "peer_failed" (a member closed, reset or stalled), "timeout", "aborted" (members disagree,
                votes differ, too few honest members left), "excluded" (others found our data bad), "refused" (our
                ``accept`` check refused the result: we voted against it).
        """
        self._out = torch.empty_like(flat) if out is None else out
        self._residual_out = residual_out if self.codec is not None else None
        committed = False
        try:
            self._mark("start")
            self.transport.open(deadline)
            self._mark("connect")
            outcome = self._run_subrounds(flat, weight, deadline)
            self._mark("commit")
            committed = True
            logger.debug("round %s phases (s): %s", self.round_id[:8], self.timings)
            return outcome
        except RoundFailed as exc:
            if exc.reason == "excluded":  # the others go on without us: let what we queued (results) reach them
                self.transport.flush(time.monotonic() + min(1.0, self.config.commit_timeout_s))
                committed = True  # close gracefully
            elif self._votes_left:  # "refused", or "aborted" on votes that differ: our votes must reach the others
                committed = True  # before our links close (a reset would discard them unread, and a member still
                # waiting for our vote would fail "peer_failed" holding a ``voted`` result instead of "aborted")
            raise
        except Exception as exc:
            logger.exception("averaging round %s crashed", self.round_id[:8])
            # what we queued (our RESULT frames) reaches the others before our links end, so that every member that
            # holds the full result votes and fails on our missing vote holding ``voted``, on a loaded machine too (a
            # reset dropped our queued results: a member then failed "waiting for results" without one)
            self.transport.flush(time.monotonic() + min(1.0, self.config.commit_timeout_s))
            committed = True  # close gracefully: FIN after the queued frames, no reset
            raise RoundFailed("aborted", f"local error: {type(exc).__name__}: {exc}") from exc
        finally:
            self.transport.close(graceful=committed)
            self.receiver.close()

    def _mark(self, phase: str) -> None:
        now = time.monotonic()
        self.timings[phase] = self.timings.get(phase, 0.0) + now - self._last_mark
        self._last_mark = now

    def _wait(self, ready, watched, deadline: float, what: str) -> None:
        """``transport.wait``; a member failing while a reducer's RESULT names us among the bad explains the failure:
        the others finished without us (RoundFailed "excluded")."""
        try:
            self.transport.wait(ready, watched, deadline, what)
        except PeerFailed as exc:
            if self._claimed_bad_by_someone():
                raise RoundFailed("excluded", f"a reducer found our data bad; then {exc.detail}") from None
            raise

    def _claimed_bad_by_someone(self) -> bool:
        def claims(inbox) -> bool:
            metas = [meta for ok, _, _, meta, _ in inbox.results.values() if ok and isinstance(meta, dict)]
            return any(isinstance(m.get("excluded"), list) and self.me in m["excluded"] for m in metas)

        return bool(self.transport.read(claims))

    def _send(self, peer_id: str, ftype: FrameType, sub: int, meta: dict, payload=()) -> None:
        progress = self._mid_transfer_hook(sub) if ftype == FrameType.PART else None
        self.transport.send(peer_id, ftype, sub, meta, payload, on_progress=progress)

    def _mid_transfer_hook(self, sub: int):
        def on_progress(sent: int, total: int) -> None:
            with self._hook_lock:
                if 2 * sent < total or sub in self._mid_fired:
                    return
                self._mid_fired.add(sub)
            self._hook(HookPoint.AVERAGING_MID_TRANSFER, sub)

        return on_progress

    # ---- the round ----------------------------------------------------------------------------------------------
    def _hook(self, point: HookPoint, sub: int, **extra) -> None:
        self.faults.check(point, epoch=self.epoch, peer=self.me, round_id=self.round_id, subround=sub, **extra)

    def _encode(self, x: torch.Tensor, residual_at: int | None = None) -> list:
        """Wire buffers of ``x``; with error feedback and ``residual_at`` (the offset of ``x`` in our contribution),
        also write what the codec dropped into the residual."""
        if self.codec is None:
            return [tensor_view(x)]
        part = self.codec.encode(x)
        if self._residual_out is not None and residual_at is not None:
            torch.sub(x, self.codec.decode(part), out=self._residual_out[residual_at : residual_at + x.numel()])
        return codecs.to_buffers(part)

    def _run_subrounds(self, flat: torch.Tensor, weight: float, deadline: float) -> RoundOutcome:
        active = tuple(self.members)
        excluded: set[str] = set()
        for sub in range(self.config.max_subrounds):
            tag = blake3.blake3(msgpack.packb([self.round_id, sub, list(active)])).digest()[:16]
            plan = Plan(active, butterfly_partition(flat.numel(), active), tag)
            self.receiver.start_subround(sub, plan, self._out if sub == 0 else torch.empty_like(flat))
            bad, result_meta, digests = self._subround(sub, plan, flat, weight, deadline)
            if not bad:
                return self._commit(sub, plan, result_meta, digests, sorted(excluded), deadline)
            excluded |= bad
            if self.me in bad:
                raise RoundFailed("excluded", f"reducers found our data bad in subround {sub}")
            active = tuple(p for p in active if p not in bad)
            logger.warning("round %s: excluding %s, restarting without them", self.round_id[:8], sorted(bad))
            if len(active) < max(self.config.min_group_size, 1):
                raise RoundFailed("aborted", f"{len(active)} honest members left after excluding {sorted(excluded)}")
        raise RoundFailed("aborted", f"members kept being excluded after {self.config.max_subrounds} subrounds")

    def _subround(self, sub: int, plan: Plan, flat: torch.Tensor, weight: float, deadline: float):
        """Scatter, reduce, gather. Returns (bad members, RESULT metas by reducer, result digests in slice order)."""
        others = [p for p in plan.active if p != self.me]
        frames = {}
        for p in others:
            start, end = plan.slice_of(p)
            meta = {"w": weight, "codec": self.codec_config.name, "tag": plan.tag}
            frames[p] = [meta, self._encode(flat[start:end], start)]
        self._hook(HookPoint.AVERAGING_BEFORE_SEND, sub, flat=flat, frames=frames)
        for p in others:
            self._send(p, FrameType.PART, sub, frames[p][0], frames[p][1])

        # reduce our slice
        inbox = self.transport.inbox
        # Watch only the members whose frames we still lack: one that sent us everything and then left (a bad member
        # excluded by another reducer closes at once) has not failed us (CI, 2026-11-25: an honest member aborted
        # on the close of an excluded one whose result it already had).
        lacking_parts = lambda: [p for p in others if (sub, p) not in inbox.parts]  # noqa: E731
        self._wait(lambda: not lacking_parts(), lacking_parts, deadline, "waiting for parts")
        self._mark("parts")
        start, end = plan.slice_of(self.me)
        mine = flat[start:end]
        if self.codec is not None:  # our own contribution goes through the codec like everyone else's
            decoded = self.codec.decode(self.codec.encode(mine))
            if self._residual_out is not None:
                torch.sub(mine, decoded, out=self._residual_out[start:end])
            mine = decoded
        contributions = {self.me: (mine, weight, "")}
        contributions.update({p: inbox.parts[(sub, p)] for p in others})
        bad_here = {p for p, (_, _, why) in contributions.items() if why} | (set(plan.active) & self.banned)
        now = time.time()
        for p in sorted(bad_here - {self.me} - self.banned):
            logger.warning("round %s: %s sent bad data: %s", self.round_id[:8], p, contributions[p][2])
            if self.config.ban_time_s > 0:
                self.bans.ban(p, now, self.config.ban_time_s, reason=contributions[p][2])
        kept = [p for p in plan.active if p not in bad_here]
        dest = self.receiver.out(sub)[start:end]  # without a codec we reduce straight into the result: no copy
        reduced = dest if self.codec is None else self.receiver.take(end - start)
        seed_tag = plan.tag if self.seed_tag is None else self.seed_tag  # the same on every member: see bucketing
        seed = aggregation_seed(seed_tag, plan.active.index(self.me))
        self._aggregate([contributions[p][0] for p in kept], [contributions[p][1] for p in kept], reduced, seed)
        self._mark("reduce")
        self._hook(HookPoint.AVERAGING_AFTER_REDUCE, sub, reduced=reduced)
        payload = self._encode(reduced)
        if self.codec is not None:  # everyone, us included, uses the decoded bytes
            dest.copy_(codecs.decode(codecs.from_bytes(b"".join(bytes(b) for b in payload), end - start)))
        own_meta = {"excluded": sorted(bad_here), "weights": {p: contributions[p][1] for p in kept}}
        for p in others:  # queued first: the senders start while we hash (read-only, both)
            self._send(p, FrameType.RESULT, sub, own_meta, payload)
        hasher = blake3.blake3()
        for buf in payload:
            hasher.update(buf)
        own_digest = hasher.digest()

        # gather everyone's slice
        # We wait for no result from a member known to be bad (we read nothing more from one that sent us a bad
        # part; one that another reducer excluded may have failed already without sending us its result).
        def suspects() -> set[str]:
            found, metas_so_far = set(bad_here), {self.me: own_meta}
            for p in others:
                got = inbox.results.get((sub, p))
                if got is not None and got[0]:
                    found |= self._claims(p, got[3], plan)
                    metas_so_far[p] = got[3]
            return found | self._weight_equivocators(metas_so_far)

        def awaited() -> list[str]:
            return [p for p in others if p not in suspects() and (sub, p) not in inbox.results]

        self._wait(lambda: not awaited(), awaited, deadline, "waiting for results")
        self._mark("results")
        metas, digests, bad = {self.me: own_meta}, [], set(bad_here)
        for p in plan.active:
            if p == self.me:
                digests.append(own_digest)
                continue
            if (sub, p) not in inbox.results:
                continue  # a suspect: its slice is recomputed in the next subround
            ok, why, digest, meta, _ = inbox.results[(sub, p)]
            if not ok:
                logger.warning("round %s: reducer %s: %s", self.round_id[:8], p, why)
                bad.add(p)
                if self.config.ban_time_s > 0:
                    self.bans.ban(p, now, self.config.ban_time_s, reason=why)
                continue
            metas[p] = meta
            digests.append(digest)
            bad |= self._claims(p, meta, plan)
        bad |= self._weight_equivocators(metas)
        bad &= set(plan.active)
        return bad, metas, digests

    def _claims(self, reducer: str, meta: dict, plan: Plan) -> set[str]:
        claimed = meta.get("excluded")
        weights = meta.get("weights")
        if not isinstance(claimed, list) or not isinstance(weights, dict):
            return {reducer}
        return {p for p in claimed if isinstance(p, str) and p in plan.active}

    @staticmethod
    def _weight_equivocators(metas: dict[str, dict]) -> set[str]:
        seen: dict[str, set] = {}
        for meta in metas.values():
            weights = meta.get("weights") if isinstance(meta, dict) else None
            for p, w in weights.items() if isinstance(weights, dict) else ():
                if isinstance(p, str) and isinstance(w, int | float):
                    seen.setdefault(p, set()).add(float(w))
        return {p for p, ws in seen.items() if len(ws) > 1}

    def _aggregate(self, parts: list[torch.Tensor], weights: list[float], out: torch.Tensor, seed: int) -> None:
        """Aggregate ``parts`` (fp32 (m,) each, in peer-id order) into ``out`` (fp32 (m,)); ``seed``: buckets."""
        if not parts:
            raise RoundFailed("aborted", "no valid contribution to our slice")
        if not math.fsum(weights) > 0:
            weights = [1.0] * len(weights)
        if self.config.aggregation == "centered_clip" and len(parts) > 2:
            try:
                out.copy_(robust_aggregate(parts, weights, seed=seed, **robust_options(self.config)).value)
            except NoValidContribution as exc:
                raise RoundFailed("aborted", str(exc)) from None
            return
        weighted_mean_into(out, parts, weights)

    def _commit(self, sub: int, plan: Plan, metas: dict, digests: list[bytes], excluded: list[str], deadline: float):
        others = [p for p in plan.active if p != self.me]
        weights = metas[self.me]["weights"]
        summary = msgpack.packb([self.round_id, sub, list(plan.active), sorted(weights.items()), digests])
        full_hash = blake3.blake3(summary).digest()
        self._hook(HookPoint.AVERAGING_BEFORE_COMMIT, sub)
        # One rule for every member, so that all commit or none does: vote only before our deadline; then wait for
        # every vote until the deadline plus a grace of commit_timeout_s (members' deadlines differ by their
        # matchmaking skew, and a vote queued behind RESULT frames on a home uplink takes seconds to arrive); commit
        # if all votes match and ours have left. A fixed wait after our own vote made an early voter abort while a
        # late one, which had every vote, committed: a fork (utilization bench, 2.5 Mbit/s links, 2026-11-25). A
        # member that dies or stalls meanwhile is detected by its link (closed, or no byte for part_timeout_s).
        refusal = self.accept(self.receiver.out(sub)) if self.accept is not None else ""
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
            self._flush_votes(votes_deadline)
            logger.warning("round %s: we refused the result: %s", self.round_id[:8], refusal)
            raise RoundFailed("refused", refusal)
        inbox = self.transport.inbox
        awaited = lambda: [p for p in others if p not in inbox.votes]  # noqa: E731 - a voter may close after voting
        try:
            self._wait(lambda: not awaited(), awaited, votes_deadline, "waiting for votes")
        except RoundFailed as exc:  # members that got every vote may commit: hand the caller what we voted for
            # and let our own votes leave first: closing our links abruptly behind a queued vote made a member that
            # had every other vote fail too (chaos lost-vote: 2 members recovering instead of the one that missed)
            self._flush_votes(min(votes_deadline, time.monotonic() + min(1.0, self.config.commit_timeout_s)))
            raise self._voted(exc, sub, weights) from None
        disagree = [p for p in others if inbox.votes[p] != (sub, full_hash)]
        if disagree:  # nobody can commit: every member needs every vote to match its own hash; ours still must
            self._flush_votes(votes_deadline)  # reach the others, so that they abort on them too
            raise RoundFailed("aborted", f"commit votes of {disagree} differ from ours")
        self.transport.flush(votes_deadline)
        unsent = [p for p in others if p not in lost and not self.transport.has_sent(p, FrameType.VOTE)]
        if unsent:  # still queued behind our RESULT frames: it reaches them after they gave up
            exc = RoundFailed("timeout", f"our vote to {unsent} did not leave before the votes deadline")
            raise self._voted(exc, sub, weights)
        bytes_sent, bytes_received = self.transport.byte_counts()
        return RoundOutcome(
            flat=self.receiver.out(sub),
            contributors=tuple(sorted(weights)),
            excluded=tuple(excluded),
            total_weight=math.fsum(weights.values()),
            bytes_sent=bytes_sent,
            bytes_received=bytes_received,
        )

    def _flush_votes(self, deadline: float) -> None:
        """We fail after voting, and nobody can commit: let our queued votes leave (until ``deadline``,
        ``time.monotonic()``) and have ``run`` close our links gracefully behind them."""
        self.transport.flush(deadline)
        self._votes_left = True

    def _voted(self, exc: RoundFailed, sub: int, weights: dict[str, float]) -> RoundFailed:
        """``exc`` with ``voted`` set to (a copy of) the result we voted for: fp32 (n,) as the single tensor."""
        if exc.reason != "excluded":
            exc.voted = RoundResult(
                tensors=[self.receiver.out(sub).clone()],
                group=tuple(sorted(weights)),
                total_weight=math.fsum(weights.values()),
                round_id=self.round_id,
            )
        return exc
