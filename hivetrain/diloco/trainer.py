"""A DiLoCo training peer: the train loop as named phases (state sync, inner steps, outer step, evaluation).

DiLoCo (Douillard et al. 2023, Algorithm 1): from the shared θ every peer runs H inner AdamW steps on its own data,
sends the pseudo-gradient Δ = θ − θ_local to a sample-weighted average with the peers of its epoch, and applies outer
Nesterov SGD. Peers that fall behind, or whose state hash disagrees with the swarm's, download state first.

With ``averaging.strategy`` "moshpit" or "gossip" the group averages θ after each peer's own outer step instead
(``rounds.RoundRunner``, which says why).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import torch
from hivemind.utils import get_dht_time

from hivetrain.averaging.base import Averager
from hivetrain.config import RunConfig
from hivetrain.data import Corpus
from hivetrain.diloco.background import BackgroundRound
from hivetrain.diloco.credit import witnesses_for
from hivetrain.diloco.drift import sketch_to_text
from hivetrain.diloco.duty import DutyCycle
from hivetrain.diloco.eval_worker import Evaluations
from hivetrain.diloco.evidence import Evidence
from hivetrain.diloco.local_copy import LocalCopy
from hivetrain.diloco.options import TrainerOptions, TrainerStats
from hivetrain.diloco.peer_report import PeerReport
from hivetrain.diloco.phase import PhaseInterrupted, PhaseRunner
from hivetrain.diloco.round_wait import RoundWait
from hivetrain.diloco.rounds import Contribution, RoundOutcome, RoundRunner, carry
from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_exchange import StateExchange
from hivetrain.diloco.swarm_view import DhtLost, SwarmView
from hivetrain.diloco.sync_policy import SyncTrust
from hivetrain.faults import NO_FAULTS, FaultInjector
from hivetrain.model import evaluate
from hivetrain.peers.loop import LoopThread
from hivetrain.peers.membership import MemberRoster
from hivetrain.peers.node import PeerNode
from hivetrain.peers.records import live_records

logger = logging.getLogger(__name__)

EVAL_CLOSE_TIMEOUT_S = 120.0  # a background evaluation still running when the peer stops: at most this long


class DilocoTrainer:
    """Runs one DiLoCo peer until ``stop()`` or the configured number of outer steps.

    The train loop reads on one screen (``run``): state sync, inner phase, outer step. With ``diloco.overlap`` the
    epoch's round runs in the background (``BackgroundRound``) while the next inner phase runs: when it commits it
    replaces ``self.state`` at once (the phase in progress runs from its own start point and never reads it) and the
    train loop settles it (statistics, evaluation, or carrying its contribution) when that phase ends.

    Built by ``diloco.builder.build_peer`` (which makes the model, the averager and the inner ``phases``); the
    trainer wires the swarm's view, the evidence rules, state sync (``state_exchange.StateExchange``: our state
    server, downloads, θ sketches and step norms), our record and events (``peer_report.PeerReport``) and the
    averaging rounds to them.
    """

    def __init__(
        self,
        node: PeerNode,
        loop: LoopThread,
        config: RunConfig,
        model: torch.nn.Module,
        corpus: Corpus,
        averager: Averager,
        fingerprint: str,
        phases: PhaseRunner,
        options: TrainerOptions = TrainerOptions(),
        faults: FaultInjector = NO_FAULTS,
        on_event: Callable[[dict], None] | None = None,
        duty: DutyCycle | None = None,
        membership: MemberRoster | None = None,
        evaluate_model: Callable[[torch.nn.Module, torch.Tensor], float] | None = None,
        eval_in_background: bool = False,
    ):
        self.node, self.loop, self.config, self.model = node, loop, config, model
        self.corpus, self.averager, self.fingerprint = corpus, averager, fingerprint
        self.options, self.faults = options, faults
        self.duty = duty if duty is not None else DutyCycle(options.duty_cycle, pause_file=options.pause_file)
        self.state = TrainingState.from_model(model)
        logger.info(
            "θ, the outer momentum and the pseudo-gradient live in host memory (fp32, %.2f GiB each)",
            self.state.num_bytes() / 2 / 2**30,
        )
        self.stats = TrainerStats(compile_s=getattr(getattr(phases, "inner", None), "compile_s", 0.0))
        self._hash_cache: tuple[TrainingState, str] = (self.state, self.state.state_hash())
        self._stop = threading.Event()
        self._committed_epoch = -1  # the epoch our last own commit brought us to (its round's members expect us next)
        self._exact_average = config.averaging.exact_average
        self._overlap = config.diloco.overlap if self._exact_average else "off"
        self.phases = phases  # inner steps on our data stream (a multi-rank node's: ``builder.build_phases``)
        self._pending: Contribution | None = None  # computed, not yet committed: sent with the next round
        self._committed_at = float("-inf")  # time.monotonic() of our last committed outer step
        self.report = PeerReport(
            node,
            config,
            fingerprint,
            options,
            self.stats,
            phases,
            self.duty,
            faults,
            on_event or (lambda event: None),
            state=lambda: self.state,
            state_hash=lambda: self.state_hash,
            records=lambda: self.view.records,
            shard_bits=lambda: self.view.shard_bits,
        )
        self.evals = Evaluations(  # on this thread, or after outer steps in the background (``eval_worker``)
            model,
            evaluate_model or evaluate,
            corpus.eval_windows(config.data.seq_len, config.data.num_eval_windows),
            self.stats,
            self.report.emit,
            eval_in_background,  # ``builder.eval_in_background``
        )
        # what the swarm's records are weighed with (sync_policy): the quorum rule, the run's coordinator, our bans
        self.evidence = Evidence(
            node.peer_id,
            options.coordinator_id,
            run_started_at=options.run_started_at,
            exact_average=self._exact_average,
            stale_after_s=options.record_ttl_s,
            now=get_dht_time,
            on_ban=self._banned,
        )
        self.view = SwarmView(
            node,
            loop,
            config.run_id,
            fingerprint,
            self.report.record,
            record_ttl_s=options.record_ttl_s,
            # read the swarm several times per lost-DHT timeout, whatever the record interval
            record_interval_s=min(options.record_interval_s, options.dht_lost_after_s / 4),
            next_interval_s=lambda: self.phases.refresh_hint_s(),
            members=membership,
            coordinator_id=options.coordinator_id,
            ignored=lambda: self._round_trust().banned,
        )
        if faults is not NO_FAULTS:  # every fault that fires becomes a metrics event (the chaos harness reads them)
            faults.on_fire = self.report.fault_fired
        self.exchange = StateExchange(
            node,
            loop,
            config,
            fingerprint,
            options,
            self.view,
            self.evidence,
            faults,
            membership,
            state=lambda: self.state,
            evaluate=lambda state=None: self.evals.loss(self.state, state),
            stop=self._stop,
            emit=self.report.emit,
        )
        if membership is not None:  # invite-only: members are learned from the (guarded) records we read; a peer not
            # known yet is looked up again at once (cheap: a token is parsed once), not only at the view's next read
            membership.follow(lambda: self.view.records)
        self.rounds = RoundRunner(
            node.peer_id,
            averager,
            self.view,
            config,
            faults,
            self.report.emit,
            self._stop,
            stale_after_s=options.record_ttl_s,
            dht_lost_after_s=options.dht_lost_after_s,
            trust=self._round_trust,
            voted_wait_s=config.averaging.commit_timeout_s + options.record_interval_s,
            # a joiner behind us downloads our state (one state timeout) and joins the next round (one round timeout)
            catch_up_wait_s=options.state_timeout_s + config.averaging.round_timeout_s,
            note_closed_without_us=self.evidence.note_closed_without_us,
        )
        self.round_wait = RoundWait(
            node.peer_id,
            self.view,
            phases,
            record_ttl_s=options.record_ttl_s,
            round_timeout_s=config.averaging.round_timeout_s,
            min_group_size=config.averaging.min_group_size,
            stop=self._stop,
            emit=self.report.emit,
            check_dht=lambda: self.view.check_alive(options.dht_lost_after_s),
        )
        diloco = config.diloco
        self.background = BackgroundRound(
            self.rounds, self._overlap, diloco.outer_lr, diloco.outer_momentum, self._install
        )
        self.local = LocalCopy.for_run(model, self.state, diloco)  # whole-model rounds, or fragments (Streaming DiLoCo)
        self.rounds.plan = self.local.plan
        self._note_state()

    def _banned(self, peers: list[str], reason: str) -> None:
        """A peer whose records we now ignore (it lied: a poisoned state, an impossible epoch) never joins our
        groups either (issue 28: banned liars were still grouped with)."""
        self.averager.ban(peers, reason)
        self.report.emit("peers_banned", peers=peers, reason=reason)

    def _round_trust(self) -> SyncTrust:
        """The evidence rules after a round: our bans, and the peers our averager leaves out of our groups (caught
        sending bad data). Those never average with us, so they neither make a solo step a fork nor are waited for
        (``may_commit_alone``); a NaN peer beside one honest peer would otherwise hold it at its epoch."""
        trust, left_out = self.evidence.trust, self.averager.banned()
        return trust if left_out <= trust.banned else dataclasses.replace(trust, banned=trust.banned | left_out)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    @property
    def target_epoch(self) -> int:
        return self.options.max_outer_steps or self.config.diloco.outer_steps

    @property
    def state_hash(self) -> str:
        """sha256 of the current state, computed once per state object (hashing a large model takes seconds)."""
        cached = self._hash_cache
        if cached[0] is not self.state:
            cached = self._hash_cache = (self.state, self.state.state_hash())
        return cached[1]

    def _note_state(self, state_hash: str | None = None) -> None:
        """Remember the new state's hash (and its θ sketch, computed in the background: 17 s for 154M parameters)."""
        state = self.state
        if state_hash is not None:
            self._hash_cache = (state, state_hash)
        self.stats.state_hashes[state.epoch] = self.state_hash

        def sketched(encoded: bytes) -> None:
            self.stats.param_sketches[state.epoch] = encoded
            if self.state is state:
                self.report.sketch_text = (state.epoch, sketch_to_text(encoded))
                self.view.request_publish()

        self.exchange.sketch(state, sketched)

    def stop(self) -> None:
        self._stop.set()

    def announce_leaving(self, reason: str) -> None:
        """Stop, and publish a last record saying why we leave (shown by the coordinator; ``reason`` <= 200 chars)."""
        self.report.left_reason = reason[:200] or "left"
        self._stop.set()
        self.view.publish()

    def run(self) -> TrainerStats:
        """Train until stopped or ``target_epoch`` is reached; returns the counters.

        Raises:
            DhtLost: the swarm could not be read for ``dht_lost_after_s`` seconds (our daemon or network is gone).
        """
        p2p = self.loop.run(self.node.dht.replicate_p2p(), timeout_s=30)
        self.exchange.start(p2p)
        self.view.start(p2p)
        self.report.emit("start", eval_loss=self.evals.loss(self.state), data_address=self.averager.data_address)
        self.evals.start()
        try:
            while not self._stop.is_set() and not self._done():
                self.view.check_alive(self.options.dht_lost_after_s)
                if self._wait_out_round():
                    continue  # a download now would fetch the state the round under way replaces
                if not self.background.in_flight and not self.sync_state():
                    continue
                if self._done():  # the download reached the run's last epoch: train no epoch past it
                    break
                if self._wait_out_round():
                    continue  # then download its result
                phase = self.inner_phase()
                if phase is None:
                    continue
                if self.background.in_flight:
                    if self._apply(*self.background.settle()) == "resync":
                        continue  # others moved on: download their state first; our contributions stay pending
                elif self.phases.progress[0] > self.state.epoch:
                    # overlap, just in step with the swarm: its round for our phase needs the state it is reaching
                    if self._catch_up(self.phases.progress[0]):
                        self.outer_phase()
                    continue
                if self._overlap != "off" and not self._last_epoch():
                    contribution, self._pending = self._pending, None
                    self.background.launch(self.state, self.state_hash, contribution)
                else:
                    self.outer_phase()
            if self._done():
                self.exchange.resync.linger(
                    self.state.epoch, lambda: self._round_trust().banned, self.rounds.catch_up_wait_s
                )
        finally:
            outcome, contribution = self.background.abandon()  # stopping: do not wait (it ends within its timeouts)
            if outcome is not None and contribution is not None:
                self._apply(outcome, contribution)
            elif contribution is not None:
                self.report.discard(contribution.counted, "the peer stopped during a background round")
            if self._pending is not None:
                self.report.discard(self._pending.counted, "the peer stopped before sending them")
                self._pending = None
            self.exchange.close(cancel=self._stop.is_set())
        self.evals.close(timeout_s=EVAL_CLOSE_TIMEOUT_S)
        self.report.emit("finish", eval_loss=self.evals.loss(self.state))
        self._stop.set()
        self.view.stop()
        self.view.publish()
        return self.stats

    def _done(self) -> bool:
        return bool(self.target_epoch and self.state.epoch >= self.target_epoch)

    def _last_epoch(self) -> bool:
        return bool(self.target_epoch and self.state.epoch + 1 >= self.target_epoch)

    # ---- phases --------------------------------------------------------------------------------------------------
    def sync_state(self) -> bool:
        """Download state if we are behind or forked, else probe a claim we do not follow (``diloco.resync``).
        Returns False if a needed download failed or waits (retry later)."""
        synced = self.exchange.resync.run(
            self.state, self.state_hash, self._committed_at, probe=not self._done(), history=self.stats.state_hashes
        )
        state = synced.state
        if state is None:
            return synced.ok
        self.state = state
        self.exchange.steps.add(synced.step)
        self.evidence.anchor(state.epoch)
        self.background.forget()
        self.report.discard(self.local.reset(), "the download replaced the local copy (fragments' progress not sent)")
        self.stats.state_downloads += 1
        self.stats.state_bytes_downloaded += state.num_bytes()
        self._note_state()
        self.report.emit("state_downloaded", reason=synced.reason)
        self.view.request_publish()
        return True

    def inner_phase(self) -> Contribution | None:
        """Inner steps from our start point until the schedule ends the phase (``diloco.schedule``); the result,
        with anything carried from earlier, becomes ``self._pending``. Returns it, or None if interrupted/diverged.

        The start point is θ, or with a round in flight (overlap) ``BackgroundRound.start_state``.
        """
        start = self.state if self.local.fragments else self.background.start_state(self.state)
        self.stats.timed("load", self.local.load, start, self.state)
        h, epoch = self.config.diloco.phase_steps, self.state.epoch
        phase_epoch = self._phase_epoch()  # the round our pseudo-gradient goes to
        self.phases.begin(phase_epoch)
        self.view.request_publish()  # others count us in this epoch's schedule from now on

        def on_step(i: int, loss: float) -> None:
            self.stats.last_loss = loss
            step = phase_epoch * h + i + 1
            self.report.write({"event": "inner_step", "epoch": epoch, "inner_step": step, "loss": loss})
            self.view.check_alive(self.options.dht_lost_after_s)

        try:
            phase = self.phases.run(lambda: self.view.records, self._stop, on_step, coverage=lambda: self.view.coverage)
        except PhaseInterrupted:
            return None
        except FloatingPointError as exc:
            logger.error("inner phase diverged, discarding it: %s", exc)
            self.report.emit("inner_diverged", reason=str(exc))
            return None
        self.view.request_publish()  # others stop counting on our progress for this round
        result, samples = phase.inner, phase.inner.num_samples
        self.stats.compute_s += phase.compute_s
        self.stats.samples_computed += samples
        self.stats.throughput = self.phases.last_rate
        self.report.emit(
            "inner_phase",
            loss=result.mean_loss if result.num_steps else None,
            steps=result.num_steps,
            samples=samples,
            compute_s=phase.compute_s,
            wall_s=phase.wall_s,
            round_key=phase_epoch,
            tokens_per_s=result.num_tokens / max(phase.compute_s, 1e-9),
            skipped_steps=result.num_skipped_steps,  # fp16: steps the gradient scaler skipped
            ended=phase.ended,  # the schedule's reason
        )
        if samples == 0 and self._pending is not None and self._pending.epoch >= phase_epoch:
            return self._pending  # a phase of no step adds nothing to what we still carry for this round
        delta, weight = self.stats.timed("pseudo_gradient", self.local.pseudo_gradient, start, phase_epoch, samples)
        fresh = Contribution(delta, weight, phase_epoch, new_samples=samples)
        self._pending = fresh if self.local.fragments else self._carry(self._pending, fresh)  # Δ_p holds all of p
        return self._pending

    def outer_phase(self) -> str:
        """Average our pending contribution with the epoch's group and apply the outer step (on this thread).
        Returns the policy's action ("apply" if a round committed; otherwise the contribution stays pending)."""
        contribution, self._pending = self._pending, None
        assert contribution is not None
        outcome = self.rounds.run(self.state, self.state_hash, contribution)
        return self._apply(outcome, contribution)

    def _install(self, outcome: RoundOutcome) -> None:
        """A round committed: its state is ours from now on, published at once (peers see our epoch, joiners can
        download it). With overlap the background round calls this when it commits; the phase in progress runs from
        its own start point and never reads it."""
        assert outcome.state is not None
        self.exchange.note_step(self.state, outcome.state)
        self.state = outcome.state
        self._note_state(outcome.state_hash)
        self.view.request_publish()

    def _apply(self, outcome: RoundOutcome, contribution: Contribution) -> str:
        """Apply a committed round, or keep its contribution pending (resync/carry). Returns the policy's action."""
        policy = outcome.policy
        self.stats.rounds_failed = self.rounds.rounds_failed
        self.stats.last_failure = self.rounds.last_failure
        if policy.action == "lost":
            raise DhtLost(f"lost the DHT: {policy.reason}")
        if policy.action != "apply":
            if policy.action == "stop":
                self.report.discard(contribution.counted, "the peer stopped during the round")
            elif not self.local.fragments:  # resync / carry: merged into our next pseudo-gradient (their mean)
                self._pending = self._carry(contribution, self._pending, 1) if self._pending else contribution
            elif policy.action == "carry" and self._overlap != "off":  # fragments: our epoch's round, Δ_p anew
                delta, weight = self.local.pseudo_gradient(self.state, self.state.epoch, 0)
                self._pending = Contribution(delta, weight, self.state.epoch, new_samples=0)
            if policy.action != "stop":  # fragments: what Δ_p held stays in the local copy for p's next round
                self.report.emit("contribution_carried", reason=policy.reason, samples=contribution.samples)
            return policy.action
        result = outcome.result
        assert result is not None and outcome.state is not None
        if self.state is not outcome.state:  # a background round already applied it
            self._install(outcome)
        self.background.remember(outcome, contribution)
        self.evidence.note_round(result.group)  # the peers we train with: their votes weigh more than strangers'
        self._committed_at = time.monotonic()
        self._committed_epoch = self.state.epoch
        self.stats.rounds_committed += 1
        self.stats.last_round_s, self.stats.last_group_size = result.duration_s, len(result.group)
        self.report.witnessed = (self.state.epoch, witnesses_for(result.round_id, result.weights, self.node.peer_id))
        self.stats.samples_total += contribution.counted
        self.stats.bytes_sent += result.bytes_sent
        self.stats.bytes_received += result.bytes_received
        eval_every = self.config.diloco.eval_every
        eval_loss = self.evals.after_outer_step(self.state, bool(eval_every and self.state.epoch % eval_every == 0))
        for part, seconds in outcome.timings_s.items():
            self.stats.add_overhead(part, seconds)
        self.report.emit(
            "outer_step",
            group_size=len(result.group),
            round_s=result.duration_s,
            bytes_sent=result.bytes_sent,
            eval_loss=eval_loss,
            excluded=list(result.excluded),
            samples=contribution.counted,  # each computed sample once (fragments: ``weight`` spans F phases)
            weight=contribution.samples,
            attempts=outcome.attempts,
            update_norm=outcome.update_norm,  # ‖Δ̄‖₂ applied (moshpit/gossip: ‖θ_new − θ_old‖₂; update_bound)
            witnessed=[list(entry) for entry in self.report.witnessed[1]],  # others' samples we vouch for (credit)
            overhead_s=self.stats.step_overhead(outcome.timings_s, evaluated=eval_loss is not None),
        )
        return policy.action

    # ---- helpers -------------------------------------------------------------------------------------------------
    def _phase_epoch(self) -> int:
        """The round our next phase computes for: our epoch, +1 with a round in flight. With overlap, a peer that
        just downloaded state (no round in flight) is one round behind the swarm, whose phases are for epoch + 1:
        it joins their phase (at most one ahead of its state, whatever records claim) and catches up after it."""
        if self.background.in_flight:
            return self.background.base_epoch + 1
        epoch = self.state.epoch
        if self._overlap == "off":
            return epoch
        live = live_records(self.view.records, get_dht_time(), self.options.record_ttl_s, exclude={self.node.peer_id})
        ahead = [r.phase_epoch for r in live if r.epoch == epoch and r.phase_epoch == epoch + 1]
        return epoch + 1 if ahead else epoch

    def _wait_out_round(self) -> bool:
        """Without overlap and with nothing pending or in flight: wait out a round under way without us
        (``round_wait.RoundWait``). Returns whether we waited: the loop then downloads the round's result."""
        if self._overlap != "off" or self._pending is not None or self.background.in_flight:
            return False
        return self.round_wait.wait_out(self.state.epoch, self._committed_epoch)

    def _catch_up(self, epoch: int) -> bool:
        """Wait (at most the matchmaking window plus a record interval) until peers publish ``epoch``, then download
        it. Returns whether we now hold ``epoch``; if not, our contribution stays pending for the next round."""
        wait_until = time.monotonic() + self.config.averaging.matchmaking_time_s + self.options.record_interval_s
        while not self._stop.is_set() and time.monotonic() < wait_until:
            if any(e >= epoch for e in self.evidence.published_hashes(self.view.refresh())):  # a quorum holds it
                break
            self._stop.wait(0.2)
        self.sync_state()
        return self.state.epoch == epoch

    def _carry(self, older: Contribution | None, newer: Contribution, max_staleness: int = 0) -> Contribution:
        """``rounds.carry``: the carried phases ``keep_carried`` drops are counted as discarded."""
        phases, samples = self.config.diloco.max_carried_phases, self.config.averaging.max_samples_per_round
        merged, dropped, why = carry(older, newer, max_phases=phases, max_samples=samples, max_staleness=max_staleness)
        self.report.discard(dropped, why)
        return merged
