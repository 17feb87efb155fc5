"""A stage server's lifecycle: join a stage, serve it, announce it, rebalance, run the stage's DiLoCo outer steps.

``StageServer.start`` picks a stage (the given one, or the least-served one: ``rebalance.choose_stage``), obtains its
parameters (downloaded from the stage's servers, hash-checked, when there are any; else the seed's θ₀), measures its
throughput, registers its RPC handlers and starts a background thread that every ``announce_interval_s``:

* publishes its signed ``StageRecord`` (and, for the coordinator's dashboard, a generic ``PeerRecord`` and a
  ``RebalanceReport``: its moves and the reason of its last rebalance decision, ``swarm/reports.py``),
* resets its uncommitted gradients if it was stalled longer than ``record_ttl_s`` (trainers presumed it dead and
  replayed them elsewhere),
* after an outer step, downloads the stage state if its stage peers are ahead or hold a different state,
* every ``rebalance_interval_s``, asks ``rebalance.decide_move`` and moves to the bottleneck stage if told to.

Per-stage DiLoCo (Douillard et al. 2023, run per stage as in SWARM's per-stage optimizers): every ``diloco.inner_steps``
inner steps the stage's servers average their pseudo-gradients through an ``Averager`` (``prefix`` per stage) and apply
the outer Nesterov step (``hivetrain.diloco.outer.outer_step``); a round that failed all-or-nothing keeps the phase
open and retries after a backoff (``swarm.phase.StagePhase.kept``), anything else abandons it (trainers replay it).
Downloading, serving and hashing stage states is ``swarm.stage_state.StageStates``. Consistency: servers of one stage
that committed epoch e hold bit-identical θ_e; different stages advance their epochs independently (no lockstep across
stages, as in SWARM), and within a phase a stage's replicas drift apart by their own inner steps. A backward pass is
recomputed with the server's current parameters, so a stage's parameter gradients are exact for its input, while the
output gradient it receives may come from a downstream replica that has taken an inner step since (bounded staleness of
at most one microbatch's round trip). Volunteers run one with ``join-swarm ADDRESS`` (``--role server`` to force it;
``hivetrain.cli.swarm_roles``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

import torch
from transformers import LlamaConfig

from hivetrain import __version__
from hivetrain.averaging.base import Averager
from hivetrain.config import RunConfig
from hivetrain.diloco.outer import outer_step
from hivetrain.diloco.state import TrainingState
from hivetrain.faults import NO_FAULTS, FaultInjector
from hivetrain.peers.loop import LoopThread
from hivetrain.peers.node import PeerNode
from hivetrain.peers.records import publish_record
from hivetrain.preflight import resolve_device
from hivetrain.swarm.announce import ServerState, StageRecord, fetch_stage_records, publish_stage_record
from hivetrain.swarm.config import SwarmConfig
from hivetrain.swarm.handler import StageHandler
from hivetrain.swarm.phase import ServerStatus
from hivetrain.swarm.rebalance import choose_stage, decide_move
from hivetrain.swarm.reports import MAX_MOVES, Move, RebalanceReport, clip_reason, publish_report
from hivetrain.swarm.runtime import StageRuntime
from hivetrain.swarm.stage_state import StageStates
from hivetrain.swarm.stages import StageSpec, plan_stages

logger = logging.getLogger(__name__)

AveragerFactory = Callable[[PeerNode, str], Averager]
"""(node, prefix) -> a started averager for one stage's servers."""


def _phase_key(rt: StageRuntime) -> tuple[int, int]:
    return rt.phase, rt.phase_record.num_failed_outer_steps


def stage_prefix(run_id: str, fingerprint: str, stage: int) -> str:
    return f"{run_id}.{fingerprint[:8]}.stage{stage}"


class StatusRefused(RuntimeError):
    """The server's status does not allow this change now (``phase.next_status`` says why)."""


class StageServer:
    """Serves one stage of the pipeline (and may move to another).

    Args:
        node: this server's DHT node (its identity signs the records).
        run: the run (model, seed, data.seq_len, diloco, averaging).
        swarm: the pipeline settings.
        model_config: the uncut model's config (``build_config`` of the run's preset).
        fingerprint: the uncut model's fingerprint.
        stage: the stage to serve; None = the least-served one.
        averager_factory: builds the stage's averager; required when ``swarm.average_stage``.
    """

    def __init__(
        self,
        node: PeerNode,
        run: RunConfig,
        swarm: SwarmConfig,
        model_config: LlamaConfig,
        fingerprint: str,
        stage: int | None = None,
        faults: FaultInjector = NO_FAULTS,
        averager_factory: AveragerFactory | None = None,
    ):
        if swarm.average_stage and averager_factory is None:
            raise ValueError("swarm.average_stage needs an averager_factory (or set average_stage = false)")
        if stage is not None and not 0 <= stage < swarm.num_stages:
            raise ValueError(f"stage {stage} is outside [0, {swarm.num_stages})")
        self.node, self.run, self.swarm, self.model_config = node, run, swarm, model_config
        self.fingerprint, self.faults, self.averager_factory = fingerprint, faults, averager_factory
        self.specs: list[StageSpec] = plan_stages(
            model_config.num_hidden_layers, swarm.num_stages, swarm.layers_per_stage
        )
        self.requested_stage = stage
        self.device = resolve_device(swarm.device)
        self._status = ServerStatus("joining")
        self._moving_to: int | None = None  # the stage a move in progress goes to (announced as moving_to)
        self.loop: LoopThread | None = None
        self.p2p = None
        self.runtime: StageRuntime | None = None
        self.handler: StageHandler | None = None
        self._averagers: dict[int, Averager] = {}
        self.states = StageStates(node, run, swarm, model_config, self.specs, faults, fetch_records=self._fetch_records)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._last_announce_ok = time.monotonic()
        self._last_rebalance = time.monotonic()
        self._last_move = time.monotonic()
        self._checked_phase = (0, 0)  # (window, failed outer steps) last checked for a resync
        self._busy_at_last_announce = 0.0
        self._announced_at = time.monotonic()
        self.rebalances = 0
        self.rebalance_reasons: list[str] = []
        self.moves: deque[Move] = deque(maxlen=MAX_MOVES)
        self.last_decision, self.last_decision_at = "", 0.0  # decide_move's last reason, unix time (s)
        self._report_sent: tuple[RebalanceReport | None, float] = (None, 0.0)  # (content, monotonic s) last stored
        self.started_at = time.time()
        self.outer_steps: Counter[int] = Counter()

    @property
    def status(self) -> ServerState:
        """What the server announces; changed only through ``ServerStatus.transition`` (one lock, one table)."""
        return self._status.value

    @property
    def state_downloads(self) -> int:
        return self.states.downloads

    @property
    def stage(self) -> int:
        assert self.runtime is not None, "start the server first"
        return self.runtime.spec.index

    # ---- lifecycle -----------------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 60.0) -> None:
        """Join a stage and start serving; returns once the server's record is published.

        Raises:
            TimeoutError: the P2P daemon, a state download or the benchmark did not finish within ``timeout_s``.
            hivetrain.diloco.state_sync.StateDownloadFailed: peers of the stage exist but none served a valid state.
        """
        self.loop = LoopThread(name=f"swarm-server-{self.node.peer_id[-6:]}")
        self.p2p = self.loop.run(self.node.dht.replicate_p2p(), timeout_s)
        self.states.attach(self.loop, self.p2p)
        records = self._fetch_records()
        stage = self.requested_stage
        if stage is None:
            stage, reason = choose_stage(records, self.swarm.num_stages, time.time(), self.swarm.record_ttl_s)
            logger.info("joining %s", reason)
        module, state = self.states.obtain(stage, records, timeout_s)
        self.runtime = StageRuntime(
            module,
            state,
            self.swarm,
            self.run.diloco,
            self.device,
            self.faults,
            on_phase_end=self._outer_step if self.swarm.average_stage else None,
            label=self.node.peer_id[-6:],
            external_phase_end=self.swarm.average_stage,
        )
        shape = (self.swarm.microbatch_size, self.run.data.seq_len)
        self.runtime.call(lambda: self.runtime.benchmark(shape), timeout_s)
        self.handler = StageHandler(
            self.runtime, self.swarm, self.run.data.seq_len, is_accepting=lambda: self.status == "serving"
        )
        self.loop.run(self.handler.register(self.p2p, self.run.run_id), timeout_s)
        self._serve_state(stage, timeout_s)
        self._status.transition("serving")
        self._announce()
        self._last_move = time.monotonic()
        self._threads = [
            threading.Thread(target=self._every_interval, args=(self._tick,), name="swarm-announce", daemon=True),
            threading.Thread(target=self._every_interval, args=(self._maintain,), name="swarm-maintain", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        logger.info(
            "serving stage %d/%d (%.1f microbatches/s)", stage, self.swarm.num_stages, self.runtime.throughput()
        )

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop announcing, unregister handlers, stop the runtime and the loop; idempotent. The node is the caller's."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)
        if self.loop is not None and self.handler is not None and self.p2p is not None:
            try:
                self.loop.run(self.handler.unregister(self.p2p, self.run.run_id), min(timeout_s, 2.0))
            except Exception as exc:  # noqa: BLE001 - the daemon may be gone already
                logger.debug("unregister failed: %r", exc)
        if self.runtime is not None:
            self.runtime.shutdown(timeout_s)
        for averager in self._averagers.values():
            averager.shutdown(timeout_s=min(timeout_s, 5.0))
        self._averagers.clear()
        if self.loop is not None:
            self.loop.stop(timeout_s)

    # ---- stage state ---------------------------------------------------------------------------------------------

    def _fetch_records(self) -> list[StageRecord]:
        return [
            r for r in fetch_stage_records(self.node.dht, self.run.run_id) if r.model_fingerprint == self.fingerprint
        ]

    def _serve_state(self, stage: int, timeout_s: float) -> None:
        """Serve this stage's committed state to joiners while we hold it (not while moving away)."""
        runtime = self.runtime

        def current(stage=stage):
            return runtime.state if runtime.spec.index == stage and self.status != "moving" else None

        self.states.serve(stage, current, timeout_s)

    # ---- announcing and background duties --------------------------------------------------------------------------

    def record(self) -> StageRecord:
        rt = self.runtime
        now = time.monotonic()
        load = min(1.0, max(0.0, (rt.busy_s - self._busy_at_last_announce) / max(now - self._announced_at, 1e-3)))
        self._busy_at_last_announce, self._announced_at = rt.busy_s, now
        return StageRecord(
            peer_id=self.node.peer_id,
            run_id=self.run.run_id,
            model_fingerprint=self.fingerprint,
            stage=rt.spec.index,
            num_stages=self.swarm.num_stages,
            status=self.status,
            throughput=rt.throughput(),
            queue_len=rt.queue_len(),
            load=load,
            epoch=rt.state.epoch,
            state_hash=self.states.hash(rt.state),
            incarnation=rt.incarnation,
            open_window=rt.phase,
            phase_microbatches=rt.phase_microbatches,
            abandoned=tuple(rt.abandoned),
            moving_to=self._moving_to if self.status == "moving" else None,
            served_total=rt.num_backward,
            rebalances=self.rebalances,
            updated_at=time.time(),
        )

    def rebalance_report(self) -> RebalanceReport:
        """Our moves and last rebalance decision, for the coordinator's dashboard (under its own DHT key)."""
        return RebalanceReport(
            peer_id=self.node.peer_id,
            run_id=self.run.run_id,
            model_fingerprint=self.fingerprint,
            stage=self.runtime.spec.index,
            started_at=self.started_at,
            rebalances=self.rebalances,
            moves=tuple(self.moves),
            last_decision=clip_reason(self.last_decision),
            last_decision_at=self.last_decision_at,
            updated_at=time.time(),
        )

    def _announce(self) -> None:
        record = self.record()
        ok = publish_stage_record(self.node.dht, self.node.owner_marker, record, self.swarm.record_ttl_s)
        publish_record(
            self.node.dht,
            self.node.owner_marker,
            record.as_peer_record(__version__, self.swarm.microbatch_size),
            self.swarm.record_ttl_s,
        )
        if ok:
            self._last_announce_ok = time.monotonic()
        report = self.rebalance_report()
        content = report.model_copy(update={"updated_at": 0.0})
        if content == self._report_sent[0] and time.monotonic() - self._report_sent[1] < self.swarm.record_ttl_s / 2:
            return  # unchanged and not near expiry: no second DHT store every announce interval
        try:  # display-only: a failure here must not count against the announcement
            if publish_report(self.node.dht, self.node.owner_marker, report, self.swarm.record_ttl_s):
                self._report_sent = (content, time.monotonic())
        except Exception as exc:  # noqa: BLE001
            logger.debug("could not publish the rebalance report: %r", exc)

    def _every_interval(self, duty) -> None:
        while not self._stop.wait(self.swarm.announce_interval_s):
            try:
                duty()
            except Exception as exc:  # noqa: BLE001 - a failed duty is retried at the next interval
                logger.warning("stage server %s failed: %r", duty.__name__, exc)

    def _tick(self) -> None:
        """Announce thread: quick duties only, so that the record never lapses while the server is healthy."""
        rt = self.runtime
        if time.monotonic() - self._last_announce_ok > self.swarm.record_ttl_s:
            # our record expired (the process was stopped or the DHT unreachable): trainers presumed us dead and
            # replayed what we held, so drop it too
            rt.submit_control(lambda: rt.reincarnate("no announcement reached the DHT within the record TTL"))
            self._last_announce_ok = time.monotonic()
        self._announce()
        if self.swarm.average_stage:
            self._maybe_end_phase()

    def _maintain(self) -> None:
        """Maintenance thread: state downloads after outer steps and rebalancing moves (may take long)."""
        rt = self.runtime
        if _phase_key(rt) != self._checked_phase:  # an outer step ended: committed, kept or abandoned
            self._checked_phase = _phase_key(rt)
            if self.swarm.average_stage:
                self._maybe_resync()
        now = time.monotonic()
        if (
            self.swarm.rebalance_interval_s > 0
            and now - self._last_rebalance >= self.swarm.rebalance_interval_s
            and now - self._last_move >= self.swarm.rebalance_cooldown_s
        ):
            self._last_rebalance = now
            self.maybe_rebalance()

    def _maybe_end_phase(self) -> None:
        """End the phase once the stage's servers at our epoch together accumulated ``inner_steps *
        microbatches_per_inner_step`` microbatches per server (hivemind Optimizer's collaborative target, per stage):
        they all see the total cross the target within about one announce interval and meet in the same round."""
        rt = self.runtime
        if time.monotonic() < rt.phase_record.retry_at(self.swarm.announce_interval_s):
            return  # a kept phase backs off after its failed outer step (StagePhase.retry_at)
        peers = [
            r
            for r in self._fetch_records()
            if r.stage == rt.spec.index
            and r.epoch == rt.state.epoch
            and r.peer_id != self.node.peer_id
            and r.status in ("serving", "syncing")
        ]
        total = rt.phase_microbatches + sum(r.phase_microbatches for r in peers)
        target = self.diloco_phase_microbatches() * (1 + len(peers))
        if total >= target and rt.request_phase_end():
            logger.info(
                "stage %d epoch %d: %d/%d microbatches over %d server(s): outer step",
                rt.spec.index,
                rt.state.epoch,
                total,
                target,
                1 + len(peers),
            )

    def maybe_rebalance(self) -> int | None:
        """Ask ``decide_move`` and move if told to. Returns the new stage, or None (also when the stage is syncing)."""
        records = self._fetch_records()
        target, reason = decide_move(
            records,
            self.stage,
            time.time(),
            self.swarm.rebalance_margin,
            my_peer_id=self.node.peer_id,
            num_stages=self.swarm.num_stages,
            max_age_s=self.swarm.record_ttl_s,
        )
        logger.info("rebalance: %s", reason)
        self.last_decision, self.last_decision_at = reason, time.time()
        if target is None:
            return None
        old = self.stage
        if not self.move_to(target):
            return None
        self.rebalance_reasons.append(reason)
        self.moves.append(Move(at=time.time(), from_stage=old, to_stage=target, reason=clip_reason(reason)))
        return target

    def move_to(self, target: int, timeout_s: float = 60.0) -> bool:
        """Leave the current stage (its open phase is abandoned) and serve ``target`` with downloaded parameters.

        Returns:
            False, without doing anything, when the server is not serving (e.g. its stage is syncing: the move waits
            for a later rebalance); True once it serves ``target``.
        """
        rt = self.runtime
        old = rt.spec.index
        moving, reason = self._status.transition("moving")
        if not moving:
            logger.info("not moving to stage %d now: %s", target, reason)
            return False
        self._moving_to = target
        try:
            self._announce()
            rt.reject_queued("moving to another stage")
            records = self._fetch_records()
            module, state = self.states.obtain(target, records, timeout_s)
            rt.call(lambda: rt.replace(module, state), timeout_s)
            rt.call(lambda: rt.benchmark((self.swarm.microbatch_size, self.run.data.seq_len)), timeout_s)
            self._serve_state(target, timeout_s)
        except BaseException:
            self._status.leave("moving", "serving")  # back to the stage it still holds (or the new one, if replaced)
            raise
        finally:
            self._moving_to = None
        self._checked_phase = _phase_key(rt)
        self.rebalances += 1
        self._last_move = time.monotonic()
        self._status.leave("moving", "serving")
        self._announce()
        logger.info("moved from stage %d to stage %d", old, target)
        return True

    def _maybe_resync(self) -> None:
        """After an outer step (committed, kept or abandoned): download the stage state if the stage's peers are ahead
        or hold another state (a kept phase whose peers committed without us is abandoned by ``adopt_state``)."""
        rt = self.runtime
        peers = [r for r in self._fetch_records() if r.stage == rt.spec.index and r.status == "serving"]
        decision = self.states.resync(rt.state, peers)
        if decision.action != "download":
            return
        logger.info("stage %d: %s; downloading", rt.spec.index, decision.reason)
        donors = [r for r in peers if r.peer_id in decision.donors]
        _, state = self.states.obtain(rt.spec.index, donors, self.run.averaging.round_timeout_s)
        rt.call(lambda: rt.adopt_state(state), self.swarm.request_timeout_s)
        self._checked_phase = _phase_key(rt)

    # ---- per-stage DiLoCo ----------------------------------------------------------------------------------------

    def _outer_step(self, runtime: StageRuntime, deltas: list[torch.Tensor]) -> TrainingState:
        """Average the stage's pseudo-gradients with its peers and apply the outer step (runtime thread).

        Raises:
            RoundFailed: no round committed (the runtime keeps the phase open and tries again after a backoff).
            StatusRefused: the server is moving to another stage (the phase it leaves is abandoned).
        """
        stage = runtime.spec.index
        syncing, reason = self._status.transition("syncing")
        if not syncing:
            raise StatusRefused(f"no outer step for stage {stage}: {reason}")
        runtime.reject_queued("syncing the stage")
        try:
            self._announce()
            averager = self._averagers.get(stage)
            if averager is None:
                averager = self._averagers[stage] = self.averager_factory(
                    self.node, stage_prefix(self.run.run_id, self.fingerprint, stage)
                )
            weight = float(runtime.phase_microbatches)
            result = averager.average(deltas, weight, runtime.state.epoch, self.run.averaging.round_timeout_s)
            new_state = outer_step(
                runtime.state, result.tensors, self.run.diloco.outer_lr, self.run.diloco.outer_momentum
            )
            self.outer_steps[stage] += 1
            return new_state
        finally:
            self._status.leave("syncing", "serving")

    def diloco_phase_microbatches(self) -> int:
        return self.run.diloco.inner_steps * max(self.swarm.microbatches_per_inner_step, 1)
