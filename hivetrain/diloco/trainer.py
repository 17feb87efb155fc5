"""A DiLoCo training peer: the train loop as named phases (state sync, inner steps, outer step, evaluation).

DiLoCo (Douillard et al. 2023, Algorithm 1): from the shared θ every peer runs H inner AdamW steps on its own data,
sends the pseudo-gradient Δ = θ − θ_local to a sample-weighted average with the peers of its epoch, and applies outer
Nesterov SGD. Peers that fall behind, or whose state hash disagrees with the swarm's, download state first.

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
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from hivemind.utils import get_dht_time

from hivetrain import __version__
from hivetrain.averaging.base import Averager, RoundFailed
from hivetrain.config import RunConfig
from hivetrain.data import Corpus, stream_seed
from hivetrain.diloco.drift import ParamSketcher, sketch_seed, sketch_to_text
from hivetrain.diloco.inner import InnerOptimizer
from hivetrain.diloco.outer import load_into_model, outer_step, pseudo_gradient
from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_sync import StateDownloadFailed, StateServer, download_state
from hivetrain.diloco.sync_policy import decide_sync, may_commit_alone, published_hashes
from hivetrain.faults import NO_FAULTS, FaultInjector
from hivetrain.model import evaluate
from hivetrain.peers.loop import LoopThread
from hivetrain.peers.node import PeerNode
from hivetrain.peers.records import PeerRecord, fetch_records, publish_record
from hivetrain.testing.byzantine import (
    WIRE_MODES,
    arm_wire_corruption,
    corrupt_round_input,
    corrupt_served_state,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerOptions:
    """Per-peer settings that are not part of the run config.

    Args:
        public_name: shown on the contributors' board.
        record_ttl_s: our peer record expires after this many seconds unless refreshed.
        record_interval_s: refresh period of our record, seconds.
        state_timeout_s: limit of one state-download network call, seconds.
        max_outer_steps: stop after this epoch (0 = the run config's ``diloco.outer_steps``).
        dht_lost_after_s: give up (DhtLost) after the DHT has been unreachable this long, seconds.
        byzantine: fault-harness only: misbehave this way (see ``hivetrain.testing.byzantine``).
        duty_cycle: train at most this fraction of wall time (0 < F <= 1), sleeping between inner steps.
        pause_file: while this file exists the peer pauses its inner steps (stays in the swarm); "" = none.
    """

    public_name: str = ""
    record_ttl_s: float = 30.0
    record_interval_s: float = 5.0
    state_timeout_s: float = 30.0
    max_outer_steps: int = 0
    byzantine: str = ""
    dht_lost_after_s: float = 60.0
    duty_cycle: float = 1.0
    pause_file: str = ""


@dataclass
class TrainerStats:
    """Counters for progress displays and summaries (bytes, samples, seconds)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    state_bytes_downloaded: int = 0
    rounds_committed: int = 0
    rounds_failed: int = 0
    state_downloads: int = 0
    samples_total: int = 0  # samples of ours in committed outer steps
    samples_computed: int = 0  # samples of all our inner steps
    samples_discarded: int = 0  # computed samples that will never reach a committed outer step
    compute_s: float = 0.0  # seconds in inner steps (duty-cycle sleeps and pauses excluded)
    last_loss: float | None = None
    last_eval_loss: float | None = None
    throughput: float = 0.0
    peers_seen: int = 0
    last_round_s: float | None = None
    last_group_size: int = 0
    last_failure: str = ""
    state_hashes: dict[int, str] = field(default_factory=dict)
    param_sketches: dict[int, bytes] = field(default_factory=dict)  # epoch -> diloco.drift sketch of θ


class DilocoTrainer:
    """Runs one DiLoCo peer until ``stop()`` or the configured number of outer steps."""

    def __init__(
        self,
        node: PeerNode,
        loop: LoopThread,
        config: RunConfig,
        model: torch.nn.Module,
        corpus: Corpus,
        averager: Averager,
        fingerprint: str,
        options: TrainerOptions = TrainerOptions(),
        faults: FaultInjector = NO_FAULTS,
        on_event: Callable[[dict], None] | None = None,
    ):
        self.node, self.loop, self.config, self.model = node, loop, config, model
        self.corpus, self.averager, self.fingerprint = corpus, averager, fingerprint
        self.options, self.faults = options, faults
        self.on_event = on_event or (lambda event: None)
        self.state = TrainingState.from_model(model)
        self.stats = TrainerStats()
        self._hash_cache: tuple[TrainingState, str] = (self.state, self.state.state_hash())
        shapes = {name: tuple(p.shape) for name, p in self.state.params.items()}
        self.sketcher = ParamSketcher(shapes, sketch_seed(config.run_id, config.seed))
        self._note_state()
        self.inner = InnerOptimizer(model, config.diloco)
        self.batches = corpus.train_batches(
            config.data.seq_len, config.data.batch_size, stream_seed(config.seed, node.peer_id)
        )
        self.eval_windows = corpus.eval_windows(config.data.seq_len, config.data.num_eval_windows)
        arm_wire_corruption(options.byzantine, faults)
        self.state_server = StateServer(corrupt_served_state(options.byzantine, lambda: self.state), faults=faults)
        self._stop = threading.Event()
        self._left_reason = ""
        self._records: list[PeerRecord] = []
        self._exact_average = config.averaging.strategy == "butterfly"
        self._view_ok, self._view_ok_at = False, time.monotonic()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="records", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    @property
    def target_epoch(self) -> int:
        return self.options.max_outer_steps or self.config.diloco.outer_steps

    @property
    def state_hash(self) -> str:
        """sha256 of the current state, computed once per state object (hashing a large model takes seconds)."""
        if self._hash_cache[0] is not self.state:
            self._hash_cache = (self.state, self.state.state_hash())
        return self._hash_cache[1]

    @property
    def param_sketch(self) -> bytes:
        """The run's count sketch of the current θ (``diloco.drift``; 2 KiB fp32), computed once per state."""
        return self.sketcher.encode(self.state, self.state.params)

    def _note_state(self) -> None:
        self.stats.state_hashes[self.state.epoch] = self.state_hash
        self.stats.param_sketches[self.state.epoch] = self.param_sketch

    def stop(self) -> None:
        self._stop.set()

    def announce_leaving(self, reason: str) -> None:
        """Stop, and publish a last record saying why we leave (shown by the coordinator; ``reason`` <= 200 chars)."""
        self._left_reason = reason[:200] or "left"
        self._stop.set()
        self._publish()

    def run(self) -> TrainerStats:
        """Train until stopped or ``target_epoch`` is reached; returns the counters."""
        p2p = self.loop.run(self.node.dht.replicate_p2p(), timeout_s=30)
        self.loop.run(self.state_server.register(p2p, self.config.run_id), timeout_s=30)
        self._p2p = p2p
        self._publish()
        self._heartbeat.start()
        self._emit("start", eval_loss=self._evaluate())
        while not self._stop.is_set() and not (self.target_epoch and self.state.epoch >= self.target_epoch):
            self._check_dht()
            if not self.sync_state():
                continue
            pseudo_grad, inner = self.inner_phase()
            if pseudo_grad is None:
                continue
            self.outer_phase(pseudo_grad, inner.num_samples)
        self._emit("finish", eval_loss=self._evaluate())
        self._stop.set()
        self._publish()
        return self.stats

    # ---- phases --------------------------------------------------------------------------------------------------
    def sync_state(self) -> bool:
        """Download state if we are behind or forked. Returns False if a needed download failed (retry later)."""
        records = self._refresh_records()
        decision = decide_sync(
            self.node.peer_id,
            self.state.epoch,
            self.state_hash,
            records,
            get_dht_time(),
            stale_after_s=self.options.record_ttl_s,
            exact_average=self._exact_average,
        )
        if decision.action == "train":
            return True
        logger.info("state download: %s", decision.reason)

        def expected() -> dict[int, str]:  # runs inside the download: read the DHT only, no daemon check
            fresh = fetch_records(self.node.dht, self.config.run_id)
            return published_hashes(
                r for r in fresh if r.peer_id != self.node.peer_id and r.model_fingerprint == self.fingerprint
            )

        try:
            state = self.loop.run(
                download_state(
                    self._p2p,
                    self.config.run_id,
                    list(decision.donors),
                    expected,
                    self.state,
                    self.options.state_timeout_s,
                    self.faults,
                ),
                timeout_s=self.options.state_timeout_s * 4,
            )
        except (StateDownloadFailed, TimeoutError, ValueError) as exc:
            logger.warning("state download failed: %s", exc)
            self._emit("state_download_failed", reason=str(exc))
            self._stop.wait(1.0)
            return False
        self.state = state
        self.stats.state_downloads += 1
        self.stats.state_bytes_downloaded += state.num_bytes()
        self._note_state()
        self._emit("state_downloaded", reason=decision.reason)
        self._publish()
        return True

    def inner_phase(self):
        """H inner steps from θ. Returns (pseudo-gradient, InnerPhaseResult), or (None, None) if interrupted."""
        load_into_model(self.state, self.model)
        h = self.config.diloco.inner_steps
        epoch = self.state.epoch

        def on_step(i: int, loss: float) -> None:
            self.stats.last_loss = loss
            if self._stop.is_set():
                raise _Interrupted()
            self.on_event({"event": "inner_step", "epoch": epoch, "inner_step": epoch * h + i + 1, "loss": loss})

        try:
            result = self.inner.run(self.batches, first_step=epoch * h, num_steps=h, on_step=on_step)
        except _Interrupted:
            return None, None
        except FloatingPointError as exc:
            logger.error("inner phase diverged, discarding it: %s", exc)
            self._emit("inner_diverged", reason=str(exc))
            return None, None
        self.stats.compute_s += result.duration_s
        self.stats.throughput = result.samples_per_s
        self._emit(
            "inner_phase",
            loss=result.mean_loss,
            samples=result.num_samples,
            tokens_per_s=result.num_tokens / max(result.duration_s, 1e-9),
        )
        return pseudo_gradient(self.state, self.model), result

    def outer_phase(self, pseudo_grad: list[torch.Tensor], num_samples: int) -> bool:
        """Average Δ with the epoch's group and apply the outer step (moshpit/gossip: apply it, then average θ); on
        failure keep θ and retry or resync. Returns whether a round committed."""
        cfg, diloco = self.config.averaging, self.config.diloco
        epoch = self.state.epoch
        deadline = time.monotonic() + cfg.round_timeout_s
        # butterfly: average Δ, then everyone takes the same outer step; moshpit/gossip: outer step first, average θ
        local = None
        if not self._exact_average:
            local = outer_step(self.state, pseudo_grad, diloco.outer_lr, diloco.outer_momentum)
        averaged = pseudo_grad if local is None else list(local.params.values())
        attempt = 0
        while True:
            attempt += 1
            self.faults.check("diloco.before_outer_step", epoch=epoch, peer=self.node.peer_id)
            sent, weight = averaged, float(num_samples)
            if self.options.byzantine and self.options.byzantine not in WIRE_MODES:
                sent, weight = corrupt_round_input(self.options.byzantine, averaged, weight)
            try:
                result = self.averager.average(sent, weight, epoch, cfg.round_timeout_s)
                if len(result.group) == 1:
                    records = self._refresh_records()
                    if not self._view_ok:
                        raise RoundFailed("alone", "cannot read the swarm's records (DHT unreachable): no solo step")
                    ok, why = may_commit_alone(
                        self.node.peer_id, epoch, records, get_dht_time(), self.options.record_ttl_s
                    )
                    if not ok:
                        raise RoundFailed("alone", why)
            except RoundFailed as exc:
                self.stats.rounds_failed += 1
                self.stats.last_failure = f"epoch {epoch}: {exc.reason}"
                logger.warning("epoch %d round attempt %d failed: %s", epoch, attempt, exc)
                self._emit("round_failed", reason=exc.reason, detail=exc.detail, attempt=attempt)
                records = self._refresh_records()
                if (
                    self._stop.is_set()
                    or decide_sync(
                        self.node.peer_id,
                        epoch,
                        self.state_hash,
                        records,
                        get_dht_time(),
                        self.options.record_ttl_s,
                        exact_average=self._exact_average,
                    ).action
                    == "download"
                ):
                    return False  # others moved on: the next sync_state() downloads their state
                # Peers of our epoch that are still in their inner phase will be ready soon: keep our Δ and retry.
                # Past the retries (and past the deadline when nobody else is left), discard Δ and start over from θ.
                waiting_for_peers = not may_commit_alone(
                    self.node.peer_id, epoch, records, get_dht_time(), self.options.record_ttl_s
                )[0]
                if attempt > cfg.max_retries and not (waiting_for_peers and time.monotonic() < deadline):
                    self._emit("pseudo_gradient_discarded", reason=exc.reason)
                    return False
                self._check_dht()
                self._stop.wait(min(0.25 * 2 ** (attempt - 1), 4.0))  # back off: failures must not spin
                continue
            if local is None:
                self.state = outer_step(self.state, result.tensors, diloco.outer_lr, diloco.outer_momentum)
            else:
                theta = {name: t.clone() for name, t in zip(local.params, result.tensors, strict=True)}
                self.state = TrainingState(epoch=local.epoch, params=theta, momentum=local.momentum)
            self.stats.rounds_committed += 1
            self.stats.last_round_s, self.stats.last_group_size = result.duration_s, len(result.group)
            self.stats.samples_total += num_samples
            self.stats.bytes_sent += result.bytes_sent
            self.stats.bytes_received += result.bytes_received
            self._note_state()
            self._publish()
            eval_every = self.config.diloco.eval_every
            eval_loss = self._evaluate() if eval_every and self.state.epoch % eval_every == 0 else None
            self._emit(
                "outer_step",
                group_size=len(result.group),
                round_s=result.duration_s,
                bytes_sent=result.bytes_sent,
                eval_loss=eval_loss,
                excluded=list(result.excluded),
            )
            return True

    # ---- helpers -------------------------------------------------------------------------------------------------
    def _evaluate(self) -> float:
        load_into_model(self.state, self.model)
        loss = evaluate(self.model, self.eval_windows)
        self.stats.last_eval_loss = loss
        return loss

    def _record(self) -> PeerRecord:
        return PeerRecord(
            peer_id=self.node.peer_id,
            role="trainer",
            version=__version__,
            run_id=self.config.run_id,
            model_fingerprint=self.fingerprint,
            epoch=self.state.epoch,
            throughput=self.stats.throughput,
            state_hash=self.state_hash,
            param_sketch=sketch_to_text(self.param_sketch),
            samples_total=self.stats.samples_total,
            compute_s=self.stats.compute_s,
            public_name=self.options.public_name,
            maddrs=tuple(self.node.visible_maddrs()[:8]),
            reachable=not self.node.config.client_mode,
            loss=self.stats.last_loss,
            eval_loss=self.stats.last_eval_loss,
            rounds_committed=self.stats.rounds_committed,
            rounds_failed=self.stats.rounds_failed,
            last_round_s=self.stats.last_round_s,
            last_group_size=self.stats.last_group_size,
            last_failure=self.stats.last_failure[:200],
            left_reason=self._left_reason,
            updated_at=get_dht_time(),
        )

    def _publish(self) -> None:
        try:
            publish_record(self.node.dht, self.node.owner_marker, self._record(), self.options.record_ttl_s)
        except Exception as exc:  # noqa: BLE001 - a failed refresh is retried by the heartbeat
            logger.warning("could not publish our record: %r", exc)

    def _refresh_records(self) -> list[PeerRecord]:
        """Read the swarm's records. ``_view_ok`` tells whether the read was real: our p2pd daemon answers and the
        answer holds our own record (refreshed every few seconds). The DHT also answers from its local storage, so
        an empty or stale answer from a node that lost its daemon must not look like an empty swarm: a peer that
        believed it was alone would commit solo steps and fork the run."""
        try:
            records = fetch_records(self.node.dht, self.config.run_id)
        except Exception as exc:  # noqa: BLE001 - keep the last view
            logger.warning("could not read peer records: %r", exc)
            records = []
        self._view_ok = any(r.peer_id == self.node.peer_id for r in records) and self._p2pd_alive()
        if not self._view_ok:
            return self._records
        self._view_ok_at = time.monotonic()
        self._records = [r for r in records if r.model_fingerprint == self.fingerprint]
        self.stats.peers_seen = len([r for r in self._records if r.role == "trainer"])
        return self._records

    def _p2pd_alive(self) -> bool:
        try:
            self.loop.run(self._p2p.list_peers(), timeout_s=5.0)
            return True
        except Exception as exc:  # noqa: BLE001 - any failure means the daemon is not usable
            logger.warning("p2pd daemon does not answer: %r", exc)
            return False

    def _check_dht(self) -> None:
        """Raise DhtLost if the DHT (or its p2pd daemon) has been unreachable for too long to keep training."""
        lost_s = time.monotonic() - self._view_ok_at
        if not self.node.dht.is_alive() or lost_s > self.options.dht_lost_after_s:
            raise DhtLost(f"lost the DHT: could not read the swarm for {lost_s:.0f}s (did the p2pd daemon die?)")

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.options.record_interval_s):
            self._publish()

    def _emit(self, event: str, **fields) -> None:
        payload = {
            "event": event,
            "time": time.time(),
            "peer": self.node.peer_id,
            "epoch": self.state.epoch,
            "state_hash": self.state_hash,
            "peers_seen": self.stats.peers_seen,
            **fields,
        }
        self.on_event(payload)


class _Interrupted(Exception):
    pass


class DhtLost(RuntimeError):
    """This peer can no longer reach the DHT; it stops rather than train on a view of the swarm it cannot check."""
