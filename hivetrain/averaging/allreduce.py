"""One all-or-nothing butterfly all-reduce among an agreed group, over authenticated TCP links, that goes on without
members that die, stall or misbehave mid-round.

Algorithm (butterfly all-reduce = reduce-scatter + all-gather; Moshpit SGD, Ryabinin et al. 2021, Sec. 3.1; the
same cut as hivemind's ``AllReduceRunner``), for the ``k`` members in the agreed order (sorted by peer id unless
``order`` says otherwise):

1. Scatter: the flat fp32 vector (n,) is cut into k contiguous slices, one per member (``groups.butterfly_partition``;
   the cut never changes during the round). With ``averaging.bandwidth_slices`` each slice follows its member's
   claimed upload rate (``groups.slice_bandwidths``: bounded to 4x the median claim), so a slow link reduces less
   and no longer sets the round's time (hivemind's load balancing); no member reduces more than ``MAX_SLICE_SHARES``
   equal shares (a claim is not proven, and a slice's reducer decides what everyone reads of it); equal slices while
   nobody claims a rate.
   Member i sends slice j, encoded by the round's codec, with its weight to member j (frame PART), and keeps the
   encoded bytes.
2. HAVE: member j validates every contribution to its slice (exact size and codec, finite values, weight finite in
   [0, max_samples_per_round]) and tells every member whose valid parts it holds, with their weights (frame HAVE,
   no payload). Every member computes the contributors C0 alike from the same HAVE frames
   (``agree_contributors``): the members whose part every reducer holds with one weight. A member whose part a
   reducer found bad, whose link to a reducer failed, or that claimed two weights is out (RoundFailed("excluded")
   on that member when it finds itself out).
3. Reduce: slice i is reduced by member i while it counts, else by the next member after it that does (``Plan.owner``):
   the members resend their kept part of a reassigned slice to its new reducer (n/k each). A slice is reduced once
   by its owner (below: an attempt after a removal reduces only reassigned slices). Each reducer aggregates
   its slices' contributions in the agreed order (``reduce.aggregate_into``: ``weighted_mean_into``, in place into the
   result, or ``bucketing.robust_aggregate``) and encodes each reduced slice *once*.
4. Gather: the reducer sends those same bytes to every member (frame RESULT, naming the members removed and the
   weights used); everyone, the reducer included, decodes the same bytes, so the results are bit-identical.
   Receivers hash what they receive (BLAKE3, while it arrives).
5. Commit: every member that holds the full result before the round's deadline sends a vote (frame VOTE) with the
   hash of the full result and the contributor set, MACed with the pair key, to every member, and returns the result
   only if all votes arrived within ``commit_timeout_s`` past that deadline (a member whose link closes or stalls
   fails the round at once), match its own hash, and its own votes left by then. So a round may return up to
   ``commit_timeout_s`` after its deadline. Before voting, a member asks the caller's ``accept`` check about the
   full result (DiLoCo's bound on the outer step, ``diloco.update_bound``); a member that refuses sends a vote that
   matches nobody's (a hash of "refused" and the result's hash, MACed as usual), lets it leave, and raises
   RoundFailed("refused"), so every other member fails with "aborted" (votes differ) and nobody commits, whatever
   the others' own checks said. A member that aborts on differing votes lets its own votes leave before it closes
   its links, so no member is left waiting on a closed link (which would fail it "peer_failed" holding a ``voted``
   result nobody committed).

Members that fail (``drop_failed``: the round's default; ``GroupAverager`` passes ``AveragingConfig.drop_failed``,
on by default; issue 23: before, one failure failed the round for every member, and the engine matched again and
every survivor sent everything again; under churn at 100 volunteers nearly every attempt of a long round lost
someone). A member whose link closes, resets or carries no byte for ``part_timeout_s`` (heartbeats keep a member
merely waiting alive), or that sends a bad reassigned part or result, is *removed*: its link is closed, and the others
go on with C0 minus the removed members in a new *attempt* (steps 3-5; the frames name the removed set, sent at once
in a GONE frame too). Slices are kept across attempts: a slice already reduced by a member still counted stays as
it is (its RESULT was sent once; a receiver keeps a result of an earlier attempt while its reducer still owns the
slice), with the parts it averaged, the removed member's included. Only the removed member's own slices are reduced
again, by their new owners (``Plan.owner``), from the survivors' resent parts: the removed member's part of its own
slice was only ever with it. So a member lost after its part was counted costs the others n/k in and n/k out per
slice it owned (issue 23: a new gather of the whole vector per loss, as before, took a gather's time during which,
under churn at 100 members, others left, and outer steps stretched to 6,000 s in the simulator), and the result
holds its part in some slices (``RoundOutcome.slice_members`` says which; its samples are not counted in
``total_weight``). Each attempt holds one more result buffer (4 bytes per element) until the round ends. A member
that failed before the connect deadline is not in C0; one dropped before its HAVE reached us counts if every HAVE
we got holds its part with one weight, and is removed at once (``agree_contributors``).

Failure handling otherwise: a local failure (a fault, the deadline, a crash) makes the member close all its links and
raise RoundFailed; the others drop it as above. Inputs are never modified.

Layout: this file holds the round logic (scatter, HAVE, reduce, gather, attempts); by composition it uses a
``transport.RoundTransport`` (links, threads, send queues, inbox, its lock, waiting on members), a
``receive.RoundReceiver`` (what each received frame means; plans and receive buffers), an ``agreement.CommitVote``
(step 5; ``agreement`` also holds step 2's contributor rule, why no member commits two results, the quorum rule and
the two-phase-commit gap), a ``round_codec.RoundCodec`` (the wire, error feedback); ``reduce`` the arithmetic.

Fault hooks (``FaultInjector``), context ``epoch``, ``peer`` (our peer id), ``round_id``, ``subround`` (the attempt:
the number of members removed so far):
    averaging.before_send    before sending parts; also ``flat`` (our fp32 vector) and ``frames`` (peer id ->
                             [meta dict, payload buffers]) that a "call" fault may corrupt (tests of bad peers)
    averaging.mid_transfer   once per attempt, when the first part is half sent (from a sender thread)
    averaging.have           before sending our HAVE frame to member ``to``; a "raise" fault drops that one frame
    averaging.after_reduce   after reducing each of our slices, before sending it; also ``reduced`` (the fp32 slice)
    averaging.before_commit  holding the full result, before voting
    averaging.vote           before sending our vote to member ``to``; a "raise" fault drops that one vote (the
                             two-phase-commit gap in tests: the others commit, ``to`` fails with ``voted`` set)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

import blake3
import msgpack
import torch

from hivetrain.averaging.agreement import CommitVote, agree_contributors, bad_claims, quorate
from hivetrain.averaging.base import RoundFailed
from hivetrain.averaging.bucketing import aggregation_seed
from hivetrain.averaging.config import AveragingConfig
from hivetrain.averaging.dataplane import DataPlaneServer
from hivetrain.averaging.groups import MAX_SLICE_SHARES, butterfly_partition, slice_bandwidths
from hivetrain.averaging.receive import RoundReceiver
from hivetrain.averaging.reduce import BufferPool, Member, Plan, RoundOutcome, aggregate_into
from hivetrain.averaging.round_codec import RoundCodec
from hivetrain.averaging.transport import PeerFailed, RoundTransport
from hivetrain.averaging.wire import FrameType
from hivetrain.faults import FaultInjected, FaultInjector, HookPoint
from hivetrain.peers.bans import BanList

logger = logging.getLogger(__name__)


class ButterflyRound:
    """Runs one round; create one per round, call ``run`` once from the round thread.

    ``order``: the members' order (the slice cut and the order contributions are summed in); default sorted by peer
    id. ``seed_tag``: what the robust aggregation's bucketing seed derives from instead of the round's tag. The
    columns of the two-stage all-reduce (``groups.hierarchy``) pass both, so that every column, whatever its
    members' ids, computes the same bytes from the same row means. ``drop_failed``: go on without members that fail
    (the module docstring); False = all-or-nothing, any member lost fails the round for every member: the columns
    of the two-stage all-reduce, where a column without a member's row would compute another mean than the others
    (and a column without a whole late row the same mean as the others, committing without that row). ``stage``: the
    round's place in the averaging call ("group", or "row", "column", "confirm", "fetch" in ``hierarchical``), for
    fault hooks and logs. ``fan_in``: how many members' pseudo-gradients each contribution already averages (the
    column stage: a row's size), which sizes a "topk" part (``reduce.part_codec``). ``join_grace_s``: seconds a
    member may take to learn of the round after us (default ``declare_grace_s``). ``group``: see ``RoundTransport``."""

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
        accept: Callable[[torch.Tensor, tuple[str, ...]], str] | None = None,
        order: Sequence[str] | None = None,
        seed_tag: bytes | None = None,
        drop_failed: bool = True,
        stage: str = "group",
        fan_in: int = 1,
        join_grace_s: float | None = None,
        group: tuple[str, str] = ("", ""),
    ):
        self.round_id, self.me, self.stage = round_id, me, stage
        self.members = {m.peer_id: m for m in sorted(members, key=lambda m: m.peer_id)}
        if order is not None:
            if sorted(order) != list(self.members):
                raise ValueError("order must list every member exactly once")
            self.members = {p: self.members[p] for p in order}
        self.seed_tag, self.drop_failed = seed_tag, drop_failed
        if me not in self.members:
            raise ValueError("we are not a member of this round")
        self.config, self.faults, self.epoch, self.bans, self.banned = config, faults, epoch, bans, banned
        self.accept = accept  # ``base.Averager.average``: checks the full result before we vote
        max_weight = float(max_weight if max_weight is not None else config.max_samples_per_round)
        self.codec = RoundCodec(config, fan_in, len(self.members))  # parts, results, error feedback
        self.receiver = RoundReceiver(me=me, round_id=round_id, codec_config=self.codec.part_config,
                                      codec=self.codec.part, result_config=self.codec.result_config,
                                      max_weight=max_weight, pool=pool or BufferPool(),
                                      plan_wait_s=config.part_timeout_s)  # fmt: skip
        self.transport = RoundTransport(round_id=round_id, me=me, members=self.members, secret=secret, server=server,
                                        config=config, on_frame=self.receiver.on_frame, fallback=fallback,
                                        join_grace_s=join_grace_s, group=group)  # fmt: skip
        self.receiver.transport = self.transport
        self.vote = CommitVote(round_id=round_id, me=me, config=config, transport=self.transport,
                               receiver=self.receiver, accept=accept, hook=self._hook, send=self._send,
                               changed=self._changed)  # fmt: skip
        self._out: torch.Tensor | None = None
        self._mid_fired, self._hook_lock = set[int](), threading.Lock()  # attempts whose mid-transfer hook fired
        self.timings: dict[str, float] = {}  # phase -> seconds it took (for logs and benchmarks)
        self._last_mark = time.monotonic()

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
                of ``flat`` that we encode (error feedback, ``feedback.ErrorFeedback``); written even if the round
                then fails (the caller discards it).

        Returns:
            The committed outcome.

        Raises:
            RoundFailed: "peer_failed" (the others went on without us: our links failed or stalled, or a voter
                failed after our vote: ``voted`` is set), "not_in_group" (``RoundTransport.open``), "timeout",
                "aborted" (members disagree, votes differ, fewer than max(2, ``min_group_size``) members or no
                strict majority of the declared ones left), "excluded" (others found our data bad), "refused" (our
                ``accept`` check refused the result: we voted against it). Members that fail during the call are
                dropped and the others commit without them (module docstring).
        """
        self._out = torch.empty_like(flat) if out is None else out
        self.codec.start(residual_out)
        committed = False
        try:
            self._mark("start")
            outcome = self._run_round(flat, weight, deadline)
            self._mark("commit")
            committed = True
            logger.debug("round %s phases (s): %s", self.round_id[:8], self.timings)
            return outcome
        except RoundFailed as exc:
            if exc.reason == "excluded":  # the others go on without us: let what we queued (results) reach them
                self.transport.flush(time.monotonic() + min(1.0, self.config.commit_timeout_s))
                committed = True  # close gracefully
            elif self.vote.votes_left:  # "refused", or "aborted" on votes that differ: our votes must reach the others
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

    def _hook(self, point: HookPoint, sub: int, **extra) -> None:
        self.faults.check(point, epoch=self.epoch, peer=self.me, round_id=self.round_id, subround=sub, stage=self.stage,
                          **extra)  # fmt: skip

    def _run_round(self, flat: torch.Tensor, weight: float, deadline: float) -> RoundOutcome:
        order = tuple(self.members)
        # the cut follows the members' claimed upload rates (from their signed entries: every member reads the same)
        rates = slice_bandwidths([self.members[p].upload_mbps for p in order]) if self.config.bandwidth_slices else None
        tag = blake3.blake3(msgpack.packb([self.round_id, list(order), rates])).digest()[:16]
        cut = butterfly_partition(
            flat.numel(), order, rates, self.codec.result_ratio(), max_share=MAX_SLICE_SHARES / len(order)
        )
        plan = Plan(order, cut, tag)
        self.receiver.start(plan, self._out)  # type: ignore[arg-type]
        inbox, me = self.transport.inbox, self.me
        others = [p for p in order if p != me]
        gone: set[str] = self.transport.open(deadline)
        self._mark("connect")
        if gone and not self.drop_failed:
            failures = self.transport.read(lambda ib: {p: ib.errors.get(p, "") for p in sorted(gone)})
            raise PeerFailed("peer_failed", f"connecting: {failures}")
        for p in sorted(gone):
            logger.warning("round %s: no link to %s (%s): going on without it", self.round_id[:8], p,
                           self.transport.read(lambda ib, p=p: ib.errors.get(p, "")))  # fmt: skip

        # 1. scatter: our part of every other member's slice (kept, encoded: resent if its slice is reassigned)
        frames: dict[str, list] = {}
        for i, p in enumerate(order):
            if p != me:
                start, end = plan.bounds[i]
                meta = {"w": weight, "codec": self.codec.part_config.name, "tag": tag, "slice": i}
                frames[p] = [meta, self.codec.encode_part(flat[start:end], start)]
        self._hook(HookPoint.AVERAGING_BEFORE_SEND, 0, flat=flat, frames=frames)
        self._sent_parts: set[tuple[int, str]] = set()
        self._reduced: dict[int, tuple[frozenset[str], bytes, tuple[str, ...]]] = {}  # ours: removed set, digest, used
        self._frames = {plan.index(p): f for p, f in frames.items()}
        for p in others:
            if p not in gone:
                self._send(p, FrameType.PART, 0, *frames[p])
                self._sent_parts.add((plan.index(p), p))

        # 2. HAVE: whose parts of our own slice we hold; C0 = the members every reducer holds
        mine_i = plan.index(me)
        lacking = lambda: [p for p in others if p not in gone and (mine_i, p) not in inbox.parts]  # noqa: E731
        self._until(lambda: not lacking(), lacking, gone, deadline, "waiting for parts")
        self._mark("parts")
        have, bad, now = {me: float(weight)}, {}, time.time()
        for p in others:
            got = self.transport.read(lambda ib, p=p: ib.parts.get((mine_i, p)))
            if got is None:
                continue
            if got[2] or p in self.banned:
                bad[p] = got[2] or "banned"
                if got[2] and p not in self.banned:
                    logger.warning("round %s: %s sent bad data: %s", self.round_id[:8], p, got[2])
                    if self.config.ban_time_s > 0:
                        self.bans.ban(p, now, self.config.ban_time_s, reason=got[2])
            else:
                have[p] = got[1]
        have_meta = {"have": have, "bad": bad}
        for p in (p for p in others if p not in gone):
            with contextlib.suppress(FaultInjected):  # a "raise" fault loses this frame (tests)
                self._hook(HookPoint.AVERAGING_HAVE, 0, to=p)
                self._send(p, FrameType.HAVE, 0, have_meta)
        # not from a member whose part we found bad: we read nothing more from it (``StopReading``), and it is out
        no_have = lambda: [p for p in others if p not in gone and p not in bad and p not in inbox.haves]  # noqa: E731
        self._until(lambda: not no_have(), no_have, gone, deadline, "waiting for HAVE frames")
        haves = {me: have_meta, **self.transport.read(lambda ib: dict(ib.haves))}
        contributors, weights = agree_contributors(haves, order, silent=gone - set(haves))
        self.receiver.set_contributors(contributors)
        if me not in contributors:
            raise RoundFailed("excluded", f"reducers found our data bad: {bad_claims(haves, me)}")
        removed = frozenset(gone & contributors)
        if not quorate(len(contributors - removed), len(order), self.config.min_group_size) and gone:
            failures = self.transport.read(lambda ib: {p: ib.errors.get(p, "") for p in sorted(gone)})
            raise RoundFailed("peer_failed", f"no other member left to average with: {failures}")

        # 3. reduce, gather, vote: again with fewer members each time one fails (``_step``)
        while True:
            outcome = self._attempt(plan, flat, contributors, removed, weights, deadline)
            if isinstance(outcome, RoundOutcome):
                return outcome
            removed = outcome

    def _until(self, ready, pending, gone: set[str], deadline: float, what: str) -> None:
        """Wait until ``ready()``; members of ``pending()`` that fail meanwhile are dropped and added to ``gone``
        (in place: ``ready`` and ``pending`` read it)."""
        while True:
            new = self.transport.wait_any(ready, pending, deadline, what)
            if not new:
                return
            for p in new:
                self._drop(p, what)
            gone |= new

    def _drop(self, p: str, what: str) -> None:
        why = self.transport.read(lambda ib: ib.errors.get(p, ""))
        if not self.drop_failed:
            raise PeerFailed("peer_failed", f"{what}: {p}: {why}")
        logger.warning("round %s: %s failed (%s: %s): going on without it", self.round_id[:8], p, what, why)
        self.transport.drop(p, why)

    def _changed(self, contributors: frozenset[str], removed: frozenset[str]) -> frozenset[str]:
        """``removed`` plus what members still counted say they removed (under the transport's lock)."""
        claims = self.transport.inbox.claims
        extra = [c for p, c in claims.items() if p in contributors and p not in removed and not c <= removed]
        return removed.union(*extra) & contributors if extra else removed

    def _step(
        self, ready, pending, contributors: frozenset[str], removed: frozenset[str], deadline: float, what: str
    ) -> frozenset[str]:
        """Wait until ``ready()``; returns ``removed`` then, or a larger set as soon as a member of ``pending()``
        fails or a member still counted names members we still count as removed: the round goes on without them."""
        new = self.transport.wait_any(
            lambda: ready() or self._changed(contributors, removed) != removed, pending, deadline, what
        )
        for p in new:
            self._drop(p, what)
        grown = self.transport.read(lambda ib: self._changed(contributors, removed)) | (new & contributors)
        if self.me in grown:
            raise RoundFailed("peer_failed", f"{what}: the other members went on without us")
        for p in grown - removed - new:  # removed by others: a member we still hear from goes too, at once
            self.transport.drop(p, "the other members went on without it")
        return frozenset(grown)

    def _attempt(
        self, plan: Plan, flat: torch.Tensor, contributors: frozenset[str], removed: frozenset[str],
        weights: dict[str, float], deadline: float,
    ) -> RoundOutcome | frozenset[str]:  # fmt: skip
        """Reduce, gather and vote among ``contributors - removed``. Returns the committed outcome, or the larger
        removed set to go on with (nothing is committed by anyone in the attempt left: see the module docstring)."""
        me, inbox = self.me, self.transport.inbox
        left = contributors - removed
        if not quorate(len(left), len(plan.order), self.config.min_group_size):
            out = sorted(set(plan.order) - left)
            raise RoundFailed(
                "aborted", f"{len(left)} of {len(plan.order)} members left once {out} failed or misbehaved"
            )
        sub, gone = len(removed), sorted(removed)
        self.receiver.set_removed(removed)
        members = [p for p in plan.order if p in left]
        if removed:  # tell everyone at once: a member that still counts them would wait on us (or them) until the
            # deadline, e.g. when only our link to a removed member failed
            logger.warning("round %s: going on without %s", self.round_id[:8], gone)
            for p in members:
                if p != me:
                    self._send(p, FrameType.GONE, sub, {"gone": gone})
        for i, (meta, payload) in sorted(self._frames.items()):  # our parts of reassigned slices, to their reducer
            owner = plan.owner(i, left)
            if owner != me and (i, owner) not in self._sent_parts:
                self._send(owner, FrameType.PART, sub, {**meta, "gone": gone}, payload)
                self._sent_parts.add((i, owner))
        # Slices are kept across attempts: a slice reduced (and sent) by a member still counted stays as it is, with
        # the parts it averaged; only the slices of removed members are reduced again, by their new owners.
        owner_of = {i: plan.owner(i, left) for i in range(len(plan.order))}
        todo = [i for i, o in owner_of.items() if o == me and i not in self._reduced]
        need = lambda: {p for i in todo for p in members if p != me and (i, p) not in inbox.parts}  # noqa: E731
        grown = self._step(lambda: not need(), need, contributors, removed, deadline, "waiting for parts")
        if grown != removed:
            return grown
        now, own_meta = time.time(), {"gone": gone, "weights": {p: weights[p] for p in members}}
        for i in todo:
            start, end = plan.bounds[i]
            parts, bad = [], set()
            for p in members:
                if p == me:  # as the others would read it: through the codec like everyone's
                    sent = self._frames[i][1] if i != plan.index(me) else None
                    parts.append(self.codec.own_part(flat, start, end, sent))
                    continue
                tensor, _, why = self.transport.read(lambda ib, p=p, i=i: ib.parts[(i, p)])
                if why:
                    bad.add(p)
                    if self.config.ban_time_s > 0:
                        self.bans.ban(p, now, self.config.ban_time_s, reason=why)
                parts.append(tensor)
            if bad:  # a reassigned part was bad: the others learn it from our next frames' removed set
                logger.warning("round %s: %s sent a bad part of slice %d", self.round_id[:8], sorted(bad), i)
                return removed | frozenset(bad)
            dest = self.receiver.out(removed)[start:end]  # without a codec we reduce straight into the result
            reduced = dest if self.codec.raw else self.receiver.take(end - start)
            seed = aggregation_seed(plan.tag if self.seed_tag is None else self.seed_tag, i)  # the same everywhere
            aggregate_into(reduced, parts, [weights[p] for p in members], seed, self.config)
            self._hook(HookPoint.AVERAGING_AFTER_REDUCE, sub, reduced=reduced)
            payload = self.codec.encode_result(reduced, dest)  # everyone, us included, uses the decoded bytes
            for p in members:
                if p != me:
                    self._send(p, FrameType.RESULT, sub, {**own_meta, "slice": i}, payload)
            hasher = blake3.blake3()
            for buf in payload:
                hasher.update(buf)
            self._reduced[i] = (removed, hasher.digest(), tuple(members))
        self._mark("reduce")

        # gather every other slice from its reducer: the result it sent in this attempt or an earlier one
        def held() -> dict[int, frozenset[str]]:  # slice -> the removed set of the result we can use (under the lock)
            return {i: r for (r, i), got in inbox.results.items() if r <= removed and got[4] == owner_of[i] != me}

        def missing() -> list[int]:  # held() once per call: it scans every result received
            have = held()
            return [i for i, o in owner_of.items() if o != me and i not in have]

        owners = lambda: {owner_of[i] for i in missing()}  # noqa: E731
        grown = self._step(lambda: not missing(), owners, contributors, removed, deadline, "waiting for results")
        if grown != removed:
            return grown
        self._mark("results")
        results = self.transport.read(lambda ib: {i: (r, ib.results[(r, i)]) for i, r in held().items()})
        result = self.receiver.out(removed)
        digests, slice_members = [], []
        for i in range(len(plan.order)):
            start, end = plan.bounds[i]
            if owner_of[i] == me:
                kept, digest, used = self._reduced[i]
            else:
                kept, (ok, why, digest, meta, reducer) = results[i]
                used = tuple(p for p in plan.order if p in contributors - kept)
                if not ok or not isinstance(meta, dict) or meta.get("weights") != {p: weights[p] for p in used}:
                    why = why or f"its result of slice {i} names other contributors or weights"
                    logger.warning("round %s: reducer %s: %s", self.round_id[:8], reducer, why)
                    if self.config.ban_time_s > 0 and not ok:
                        self.bans.ban(reducer, now, self.config.ban_time_s, reason=why)
                    return removed | {reducer}
            if kept != removed:  # a slice kept from an earlier attempt: into this attempt's buffer
                result[start:end].copy_(self.receiver.out(kept)[start:end])
            digests.append(digest)
            slice_members.append((start, end, used))
        self._slice_members = tuple(slice_members)
        # A member that failed before our vote: nobody can commit this attempt without our vote, so go on without it
        # rather than vote in vain, unless its vote arrived: a member that votes and closes (one that refused the
        # result does) is judged by its vote, so that a refusal still stops the round everywhere.
        failed = self.transport.read(
            lambda ib: {p for p in members if p in ib.errors and ib.votes.get(p, (-1, b""))[0] != sub}
        )
        if failed:
            for p in failed:
                self._drop(p, "before voting")
            return removed | failed
        weights_now = own_meta["weights"]
        outcome = self.vote.commit(sub, plan, members, removed, weights_now, digests, contributors, deadline, self._out)
        if isinstance(outcome, RoundOutcome) and any(len(m) != len(members) for _, _, m in self._slice_members):
            outcome = dataclasses.replace(outcome, slice_members=self._slice_members)
        return outcome
