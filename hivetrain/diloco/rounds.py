"""One outer step's averaging round with its retries: what a peer sends, and what it does when a round fails.

``RoundRunner.run`` averages one ``Contribution`` at the current epoch: it calls the averager, asks the pure policy
``round_policy.decide_after_round`` what to do after each attempt (apply, retry after a backoff, resync, carry, lost),
and returns a ``RoundOutcome`` without touching the trainer's state, so it can run on the train loop's thread or in
the background while the next inner phase runs (``diloco.overlap``).

All-or-nothing (``averaging.base``): a round either commits bit-identical results on every member or applies nothing
anywhere. A contribution that did not commit is never silently dropped: "resync" and "carry" hand it back to the
trainer, which sends it with its next pseudo-gradient if that is computed against the same state, and otherwise
counts it as discarded (``round_policy.keep_carried``). Phases carried at one epoch all start from the same θ, so each
Δ is an estimate of the same update: a carried contribution is their sample-weighted mean, sent with their summed
samples as its weight (``Contribution.merged``), never their sum (issue 22: six phases' Δ summed and applied with
outer lr 1 took the eval loss from 5.54 to 55), and holds at most ``diloco.max_carried_phases`` phases.

Every outer step is bounded (``diloco.update_bound``): the runner keeps the norms of its last committed updates and
hands the averager an ``accept`` check that refuses a result whose norm exceeds ``averaging.max_update_ratio`` x their
median. With butterfly the check runs inside the round's two-phase commit on every member, so a refused round
aborts everywhere and is a failed round like any other ("refused" for us, "aborted" for the others).

With ``averaging.strategy`` "moshpit" or "gossip" a round averages within small groups only, so peers hold different
θ. Averaging Δ there would leave those differences in place for ever (θ drift then grows like a random walk: 50% of
‖θ̄‖ after 40 outer steps in ``scripts/bench/moshpit_drift.py``). Instead each peer applies the outer step with its
own Δ and the group averages the new θ (Moshpit SGD, Ryabinin et al. 2021, Alg. 1: average the parameters);
momentum stays local. The same bytes per round; drift stays bounded (0.9% of ‖θ̄‖ after 40 steps in that bench).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from hivemind.utils import get_dht_time

from hivetrain.averaging.base import Averager, ExpectedPeers, RoundFailed, RoundResult
from hivetrain.averaging.matchmaking import EpochGroups
from hivetrain.config import RunConfig
from hivetrain.diloco.fragments import FragmentPlan, fragment_outer_step
from hivetrain.diloco.outer import outer_step
from hivetrain.diloco.round_policy import (
    RoundPolicy,
    RoundView,
    backoff_jitter,
    committed_without_us,
    decide_after_round,
    group_holds_the_epoch,
    keep_carried,
    went_ahead,
)
from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.swarm_view import SwarmView
from hivetrain.diloco.sync_policy import CatchUp, SyncTrust, note_behind
from hivetrain.diloco.update_bound import UpdateNorms, l2_norm, update_bound
from hivetrain.faults import FaultInjector, HookPoint
from hivetrain.peers.records import PeerRecord, live_records

logger = logging.getLogger(__name__)

# The most of the round timeout a group spends waiting for a slow expected peer (``patience_for``): the rest is left to
# the round itself.
PATIENCE_SHARE = 0.25
VIEW_REFRESH_AFTER_S = 10.0  # a view older than this (two record heartbeats) is read afresh before matchmaking, s
VOTED_POLL_S = 0.5  # how often the records are read while waiting for evidence that a voted round committed, seconds


@dataclass
class Contribution:
    """What a peer sends to one round: its pseudo-gradient(s) and their weight.

    Attributes:
        delta: Δ per parameter, fp32 CPU, ``state.params`` order; for a carried contribution the sample-weighted mean
            of its phases' Δ (``merged``).
        samples: samples behind ``delta``, all its phases together (the round's weight).
        epoch: the epoch whose state the oldest part of ``delta`` was computed from.
        parts: the single-phase contributions it merges, oldest first; empty = it is one phase itself. Kept so that
            the oldest can be dropped (``without_oldest``): a carried contribution holds one fp32 copy of the
            parameters per phase, at most ``diloco.max_carried_phases``.
        new_samples: the samples of the phase that computed it, when ``samples`` (the weight) holds more than that
            phase (fragments); None = ``samples``.
    """

    delta: list[torch.Tensor]
    samples: int
    epoch: int
    parts: tuple[Contribution, ...] = ()
    new_samples: int | None = None

    @property
    def counted(self) -> int:
        """Samples this contribution counts for the first time (``new_samples``, else ``samples``): with fragments
        a round's weight holds the last F phases (``local_copy``), each counted once, with its own round."""
        return self.samples if self.new_samples is None else self.new_samples

    @property
    def phases(self) -> tuple[Contribution, ...]:
        """The single-phase contributions in this one, oldest first."""
        return self.parts or (self,)

    def merged(self, older: Contribution | None) -> Contribution:
        """This contribution with an older carried one: their phases' sample-weighted mean Δ.

        DiLoCo's pseudo-gradient (Douillard et al. 2023, Algorithm 1) is one estimate of the update from θ. Phases
        carried at one epoch all start from the same θ, so their Δ are independent estimates of one update, and the
        averaging weights each by its samples: merged, Δ = Σ w_i Δ_i / Σ w_i with weight Σ w_i, exactly what the
        round would compute had each phase been a peer of its own. (Their sum would apply k phases' worth of
        update from one θ: issue 22.) The older epoch is kept.
        """
        if older is None:
            return self
        return _mean_of((*older.phases, *self.phases))

    def without_oldest(self, num_phases: int) -> Contribution | None:
        """This contribution without its ``num_phases`` oldest phases (the mean of the rest); None if none is left."""
        kept = self.phases[num_phases:]
        if not kept:
            return None
        return kept[0] if len(kept) == 1 else _mean_of(kept)


def carry(
    older: Contribution | None, newer: Contribution, *, max_phases: int, max_samples: int, max_staleness: int = 0
) -> tuple[Contribution, int, str]:
    """``newer`` with what ``keep_carried`` keeps of the carried ``older`` (``Contribution.merged``).

    Args:
        max_phases: ``diloco.max_carried_phases``; max_samples: ``averaging.max_samples_per_round``;
        max_staleness: passed to ``keep_carried`` (epochs).

    Returns:
        (the contribution to send, samples of the carried phases dropped, why they were dropped: "" if none).
    """
    if older is None:
        return newer, 0, ""
    decision = keep_carried(
        older.epoch,
        newer.epoch,
        [p.samples for p in older.phases],
        newer.samples,
        max_samples=max_samples,
        max_phases=max_phases,
        new_phases=len(newer.phases),
        max_staleness=max_staleness,
    )
    dropped = sum(p.samples for p in older.phases[: decision.drop])
    return newer.merged(older.without_oldest(decision.drop)), dropped, decision.reason if decision.drop else ""


def _mean_of(parts: tuple[Contribution, ...]) -> Contribution:
    """One contribution of several single-phase ones: Δ their sample-weighted mean (fp32), samples their sum."""
    total = sum(p.samples for p in parts)
    shares = [p.samples / total for p in parts] if total > 0 else [1.0 / len(parts)] * len(parts)
    delta = [torch.mul(t, shares[0]) for t in parts[0].delta]
    for part, share in zip(parts[1:], shares[1:], strict=True):
        for acc, t in zip(delta, part.delta, strict=True):
            acc.add_(t, alpha=share)
    return Contribution(delta, total, min(p.epoch for p in parts), parts)


@dataclass(frozen=True)
class RoundOutcome:
    """How a round ended. ``policy.action`` "apply": ``state`` (epoch + 1, its hash in ``state_hash``), ``result`` and
    ``update_norm`` (‖Δ̄‖₂ of the applied averaged pseudo-gradient; moshpit/gossip: ‖θ_new − θ_old‖₂) are set; any
    other action: nothing was applied and the contribution is the caller's to carry or discard."""

    policy: RoundPolicy
    attempts: int
    state: TrainingState | None = None
    state_hash: str = ""
    result: RoundResult | None = None
    sent: list[torch.Tensor] | None = None
    update_norm: float = 0.0
    timings_s: dict[str, float] = field(default_factory=dict)  # "outer_step", "state_hash": seconds of the commit


def expected_peers(records: list[PeerRecord], my_peer_id: str, epoch: int, now: float, stale_after_s: float):
    """Peer ids of the live trainers that will average at ``epoch``: a group closes once all have announced.

    A record one epoch behind counts too: a peer that just committed ``epoch - 1`` may not have published it yet
    (records lag by up to a heartbeat), and leaving it out would close the group without it. A peer that really is
    one epoch behind only makes the group wait for its window, as before expected peers existed."""
    # a paused peer will not come: do not wait for it (a peer whose throughput is not measured yet will)
    return frozenset(
        r.peer_id
        for r in live_records(records, now, stale_after_s, exclude={my_peer_id}, paused=False)
        if r.epoch in (epoch - 1, epoch) or r.phase_epoch == epoch
    )


def patience_for(
    records: list[PeerRecord], expected: frozenset[str], epoch: int, samples_per_step: int, round_timeout_s: float
) -> float:
    """How long past the matchmaking window a group waits for an expected peer that is not ready yet, seconds: one
    inner step (``samples_per_step`` / its published throughput) of the slowest of ``expected`` whose record does not
    show its phase for ``epoch`` ended, at most ``PATIENCE_SHARE`` of ``round_timeout_s``.

    The swarm's schedule ends every peer's phase at about the same time, but a peer learns it only after the step it
    is in: a starved volunteer's step can outlast the window and the DHT grace (chaos cpu-starve on a loaded CI
    machine: the 20%-CPU peer reached matchmaking ~6 s after each group closed and missed 3 of 6 epochs, each one a
    state download). Waiting one of its steps costs the others that much idle time once per epoch; missing it costs
    it the epoch's samples and a download of the whole state. A throughput is a claim: the cap bounds what a peer
    that never comes can cost (a peer not measured yet, throughput 0, adds nothing)."""
    steps = [
        samples_per_step / r.throughput
        for r in records
        if r.peer_id in expected and r.throughput > 0 and not (r.done_epoch == epoch and r.done_samples > 0)
    ]
    return min(max(steps, default=0.0), round_timeout_s * PATIENCE_SHARE)


class RoundRunner:
    """Runs rounds for one trainer (see the module docstring). ``run`` from one thread at a time.

    Args:
        peer_id: ours.
        averager: the averaging engine.
        view: the swarm view (records, liveness).
        config: the run config (``averaging``, ``diloco``).
        faults: fault hooks (``HookPoint.DILOCO_BEFORE_OUTER_STEP``, then ``DILOCO_ROUND_INPUT``, whose "call" fault
            may replace what we average: a byzantine peer of the fault harness).
        emit: trainer event callback(event, **fields).
        stop: set when the trainer stops (ends the retries).
        stale_after_s: records older than this are ignored; dht_lost_after_s: see ``decide_after_round``.
        trust: returns the evidence rules the trainer holds now (quorum, coordinator, bans), read at every attempt.
        voted_wait_s: after a round failed once we had voted (the two-phase-commit gap), how long to look for a
            member's record showing that the group committed it before retrying, seconds (the run's
            ``commit_timeout_s`` plus a record heartbeat: members commit up to that much later than we fail, then
            publish at once). 0 = look once.
        catch_up_wait_s: how long a live trainer behind our epoch (a joiner, a restarted peer) holds our solo steps,
            seconds (``sync_policy.CatchUp``); 0 = solo steps go on past it.
        note_closed_without_us: called with (epoch, peer IDs) when matchmaking finds the epoch's group closed without
            us (``RoundFailed.closed_without_us``) or our ``accept`` refuses a round that peers ahead outweigh or
            another declaration outranks, so that the trainer's downloads follow their result
            (``Evidence.note_closed_without_us``).
    """

    def __init__(
        self,
        peer_id: str,
        averager: Averager,
        view: SwarmView,
        config: RunConfig,
        faults: FaultInjector,
        emit: Callable[..., None],
        stop: threading.Event,
        *,
        stale_after_s: float,
        dht_lost_after_s: float,
        trust: Callable[[], SyncTrust] = SyncTrust,
        voted_wait_s: float = 0.0,
        catch_up_wait_s: float = 0.0,
        note_closed_without_us: Callable[[int, frozenset[str]], None] = lambda epoch, members: None,
    ):
        self.peer_id, self.averager, self.view, self.config = peer_id, averager, view, config
        if hasattr(averager, "record_levels"):  # ``GroupAverager``: our matchmaking entries in the swarm's shards
            averager.record_levels = lambda: view.shard_levels
        self.faults, self.emit, self.stop = faults, emit, stop
        self.stale_after_s, self.dht_lost_after_s = stale_after_s, dht_lost_after_s
        self.trust, self.voted_wait_s = trust, voted_wait_s
        self.exact_average = config.averaging.exact_average
        # norms of our last committed updates (``update_bound``); a state download keeps them: the run's scale stays
        self.norms = UpdateNorms(config.averaging.update_norm_window)
        self._checked_norm: float | None = None  # the norm ``_accept`` computed for the round in progress
        self._epoch = -1  # the epoch of the round in progress (``_accept``)
        self._went_ahead: frozenset[str] = frozenset()  # who outweighed the round ``_accept`` refused (``went_ahead``)
        self.rounds_failed = 0
        self.last_failure = ""
        self.catch_up_wait_s = catch_up_wait_s
        self.behind_since: dict[str, float] = {}  # live trainers behind our epoch -> first seen so (``CatchUp``)
        self.note_closed_without_us = note_closed_without_us
        self._plan: FragmentPlan | None = None

    @property
    def plan(self) -> FragmentPlan | None:
        """The run's fragments (``diloco.fragments`` > 1; set by the trainer), or None: whole-model rounds. Each
        fragment's rounds keep their own error-feedback residual (``GroupAverager.feedback_slots``)."""
        return self._plan

    @plan.setter
    def plan(self, plan: FragmentPlan | None) -> None:
        self._plan = plan
        if hasattr(self.averager, "feedback_slots"):
            self.averager.feedback_slots = plan.num_fragments if plan is not None else 1

    def outer(self, state: TrainingState, averaged: Sequence[torch.Tensor]) -> TrainingState:
        """The outer step of ``state.epoch`` with Δ̄ ``averaged``: the whole model's (``outer.outer_step``), or with
        fragments that of the epoch's fragment (``fragments.fragment_outer_step``)."""
        lr, momentum = self.config.diloco.outer_lr, self.config.diloco.outer_momentum
        if self.plan is None:
            return outer_step(state, averaged, lr, momentum)
        return fragment_outer_step(state, self.plan.names(state.epoch), averaged, lr, momentum)

    def run(self, state: TrainingState, state_hash: str, contribution: Contribution) -> RoundOutcome:
        """Average ``contribution`` at ``state.epoch`` and build the next shared state; never modifies ``state``.

        butterfly: average Δ, then every member takes the same outer step. moshpit/gossip: take the outer step with our
        own Δ first, then average θ (Moshpit SGD; momentum stays local).

        Raises:
            ValueError: non-finite local input (a diverged pseudo-gradient must not be sent).
        """
        cfg, diloco = self.config.averaging, self.config.diloco
        epoch = state.epoch
        deadline = time.monotonic() + cfg.round_timeout_s
        local = None
        if not self.exact_average:
            local = outer_step(state, contribution.delta, diloco.outer_lr, diloco.outer_momentum)
        averaged = contribution.delta if local is None else list(local.params.values())
        attempt = 0
        while True:
            attempt += 1
            self.faults.check(HookPoint.DILOCO_BEFORE_OUTER_STEP, epoch=epoch, peer=self.peer_id)
            given = self.faults.check(
                HookPoint.DILOCO_ROUND_INPUT,
                epoch=epoch,
                peer=self.peer_id,
                tensors=averaged,
                weight=float(contribution.samples),
            )
            sent, weight = given["tensors"], float(given["weight"])
            result, failure, closed_without_us = None, "", frozenset[str]()
            expected: ExpectedPeers = frozenset()
            patience = 0.0
            if self.view.coverage >= 1.0:  # a sample of a sharded swarm names too few: groups close by their window
                # after a stall (a SIGSTOP, a laptop lid) the view is from before it: peers it shows at our epoch may
                # have moved on long ago, and waiting for them held a woken peer in matchmaking for a whole round
                # timeout while the others committed 10 epochs (chaos pause-twice, idle). So the view is read afresh,
                # and who is expected is asked again at every matchmaking decision from the view the heartbeat keeps
                # fresh: a refresh right after the stall can fail and keep the old view (pause-twice beside 2 hogs,
                # 1 in 20 runs: 30 s waited for two peers 6 epochs ahead).
                records = self.view.refresh() if self.view.view_age_s > VIEW_REFRESH_AFTER_S else self.view.records
                expected = partial(self._expected_now, epoch)
                per_step = diloco.samples_per_inner_step(self.config.data.batch_size)
                patience = patience_for(records, expected(), epoch, per_step, cfg.round_timeout_s)
            self._checked_norm, self._epoch, self._went_ahead = None, epoch, frozenset()
            accept = self._accept if local is None else None  # moshpit/gossip: our own step, checked below
            try:
                result = self.averager.average(
                    sent, weight, epoch, cfg.round_timeout_s, expected_peers=expected, accept=accept,
                    patience_s=patience,
                )  # fmt: skip
            except RoundFailed as exc:
                failure = exc.reason + (f" ({exc.detail})" if exc.detail else "")
                # the epoch's group that closed without us, or the peers ahead whose round outweighed ours
                closed_without_us = exc.closed_without_us or self._went_ahead
                self.note_closed_without_us(epoch, closed_without_us)
                if exc.voted is not None and local is None:
                    adopted = self._committed_without_us(state, exc.voted, failure)
                    if adopted is not None:
                        norm = self._remember_norm(exc.voted.tensors)
                        return RoundOutcome(adopted[2], attempt, adopted[0], adopted[1], exc.voted, list(sent), norm)
            if result is not None and local is not None:  # moshpit/gossip: bound our own step θ_new − θ_old
                refusal = self._refuse_step(state, result.tensors)
                if refusal:
                    result, failure = None, f"refused ({refusal})"
            solo = result is not None and len(result.group) == 1
            records = self.view.refresh() if result is None or solo else self.view.records
            view = RoundView(
                epoch=epoch,
                my_hash=state_hash,
                attempt=attempt,
                committed=result is not None,
                group_size=len(result.group) if result is not None else 0,
                failure=failure,
                view_ok=self.view.view_ok,
                view_age_s=self.view.view_age_s,
                time_left_s=deadline - time.monotonic(),
                stopping=self.stop.is_set(),
                closed_without_us=closed_without_us,
            )
            policy = decide_after_round(
                self.peer_id,
                view,
                records,
                get_dht_time(),
                max_retries=cfg.max_retries,
                stale_after_s=self.stale_after_s,
                dht_lost_after_s=self.dht_lost_after_s,
                exact_average=self.exact_average,
                trust=self.trust(),
                catch_up=self._catch_up(epoch, records),
                backoff_floor_s=getattr(self.averager, "dht_latency_s", 0.0),
                unbacked=True,
            )
            if policy.action == "apply":
                assert result is not None
                started = time.perf_counter()
                if local is None:
                    new_state = self.outer(state, result.tensors)
                else:
                    theta = {name: t.clone() for name, t in zip(local.params, result.tensors, strict=True)}
                    new_state = TrainingState(epoch=local.epoch, params=theta, momentum=local.momentum)
                applied = time.perf_counter()
                new_hash = new_state.state_hash()
                timings = {"outer_step": applied - started, "state_hash": time.perf_counter() - applied}
                norm = self._remember_norm(result.tensors)
                return RoundOutcome(policy, attempt, new_state, new_hash, result, list(sent), norm, timings)
            if result is not None or failure:  # a failed attempt, or a round of one we may not apply
                self.rounds_failed += 1
                reason = failure or policy.reason
                self.last_failure = f"epoch {epoch}: {reason}"
                logger.warning("epoch %d round attempt %d failed: %s (%s)", epoch, attempt, reason, policy.action)
                short = reason.split(" ", 1)[0].rstrip(":")
                self.emit("round_failed", reason=short, detail=reason, attempt=attempt, next=policy.action)
            if policy.action != "retry":
                return RoundOutcome(policy, attempt)
            # back off (failures must not spin), stretched per peer so that peers that failed together do not retry
            # in lockstep
            self.stop.wait(policy.backoff_s * (1.0 + 0.5 * backoff_jitter(self.peer_id, epoch, attempt)))

    def _expected_now(self, epoch: int) -> frozenset[str]:
        """The live trainers expected at ``epoch`` in the view as it is now (``expected_peers``)."""
        return expected_peers(self.view.records, self.peer_id, epoch, get_dht_time(), self.stale_after_s)

    def _accept(
        self, flat: torch.Tensor, contributors: tuple[str, ...], epoch_groups: EpochGroups | None = None
    ) -> str:
        """``Averager.average``'s ``accept`` (butterfly): "" or why the round's averaged Δ̄ (fp32 (n,)) from
        ``contributors`` is refused: beyond the bound on the outer step (``update_bound``), or from a group that does
        not outweigh the live trainers of our epoch left out of it (``round_policy.group_holds_the_epoch``; the
        trainers one epoch ahead among them are then the round we follow: ``round_policy.went_ahead``), ranked against
        our epoch's other declarations when the averager passes them (``epoch_groups``)."""
        norm = self._checked_norm = l2_norm([flat])
        cfg = self.config.averaging
        ok, why = update_bound(norm, self.norms.history, cfg.max_update_ratio, cfg.update_norm_min_history)
        if not ok:
            return why
        if len(contributors) > 1:  # a round of one: ``may_commit_alone`` decides after the call
            records, now, trust = self.view.records, get_dht_time(), self.trust()
            ok, why = group_holds_the_epoch(
                self.peer_id, self._epoch, contributors, records, now, self.stale_after_s, trust,
                coverage=self.view.coverage, epoch_groups=epoch_groups,
            )  # fmt: skip
            if not ok:  # whose result we follow: the trainers ahead, and the declarations that outrank ours
                ahead = epoch_groups.ahead() if epoch_groups is not None else ()
                self._went_ahead = went_ahead(self._epoch, contributors, records, now, self.stale_after_s, trust)
                self._went_ahead = self._went_ahead.union(*ahead)
        return "" if ok else why

    def _refuse_step(self, state: TrainingState, theta: list[torch.Tensor]) -> str:
        """Moshpit/gossip: "" or why our step from ``state`` to the averaged ``theta`` is refused. Each peer decides
        for itself: the groups end with different θ by design, so one peer keeping its θ forks nothing (the next
        rounds mix it back in)."""
        step = [torch.sub(new, old) for new, old in zip(theta, state.params.values(), strict=True)]
        norm = self._checked_norm = l2_norm(step)
        cfg = self.config.averaging
        ok, why = update_bound(norm, self.norms.history, cfg.max_update_ratio, cfg.update_norm_min_history)
        return "" if ok else why

    def _remember_norm(self, applied: list[torch.Tensor]) -> float:
        """A round committed: keep its norm in the history (the one the check computed; else computed now)."""
        norm = self._checked_norm if self._checked_norm is not None else l2_norm(applied)
        self.norms.add(norm)
        return norm

    def _catch_up(self, epoch: int, records: list[PeerRecord]) -> CatchUp:
        """The peers behind ``epoch`` we still hold solo steps for (``round_policy.may_commit_alone``)."""
        note_behind(self.behind_since, self.peer_id, epoch, records, get_dht_time())
        return CatchUp(dict(self.behind_since), self.catch_up_wait_s)

    def _committed_without_us(
        self, state: TrainingState, voted: RoundResult, failure: str
    ) -> tuple[TrainingState, str, RoundPolicy] | None:
        """The round failed after we voted: build the state its result gives and wait (at most ``voted_wait_s``)
        for a member's record showing it committed that state (``round_policy.committed_without_us``). Returns
        (state, hash, "apply" policy) on that evidence, else None (the usual retry / resync policy decides)."""
        candidate = self.outer(state, voted.tensors)
        candidate_hash = candidate.state_hash()
        give_up_at = time.monotonic() + self.voted_wait_s
        while True:
            committed, why = committed_without_us(
                self.peer_id,
                state.epoch,
                voted.group,
                candidate_hash,
                self.view.refresh(),
                get_dht_time(),
                self.stale_after_s,
                self.trust(),
            )
            if committed:
                logger.warning(
                    "epoch %d round failed after our vote (%s), but %s: applied it", state.epoch, failure, why
                )
                self.emit("round_recovered", reason=failure.split(" ", 1)[0], detail=f"{failure}; {why}")
                return candidate, candidate_hash, RoundPolicy("apply", f"committed without our last vote: {why}")
            if self.stop.is_set() or time.monotonic() >= give_up_at:
                logger.info("epoch %d: %s (after %s)", state.epoch, why, failure)
                return None
            self.stop.wait(VOTED_POLL_S)
