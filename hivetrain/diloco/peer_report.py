"""What a DiLoCo peer reports about itself: the record the swarm reads and the metrics events its operator reads.

The record (``PeerRecord``, published by ``SwarmView``'s heartbeat) carries our epoch, state hash, θ sketch, the
progress of our inner phase, our counters, why we left and whose samples we vouch for (``diloco.credit``). The events
(one dict per call of ``on_event``: ``cli.progress`` writes them as JSON lines, the chaos harness reads them) carry
the time, our peer ID, epoch, state hash and how many trainers we see, with the event's own fields.

``PeerReport`` reads the trainer's changing state through the callables it is given, and keeps what only the report
says: ``left_reason``, ``witnessed``, ``sketch_text`` and the lock that keeps events whole (the background round and
the inner steps write them from other threads).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from hivemind.utils import get_dht_time

from hivetrain import __version__
from hivetrain.config import RunConfig
from hivetrain.diloco.duty import DutyCycle
from hivetrain.diloco.options import TrainerOptions, TrainerStats
from hivetrain.diloco.phase import PhaseRunner
from hivetrain.diloco.state import TrainingState
from hivetrain.faults import FaultInjector, HookPoint
from hivetrain.peers.node import PeerNode
from hivetrain.peers.record_shards import carries_sketch
from hivetrain.peers.records import PeerRecord

logger = logging.getLogger(__name__)


class PeerReport:
    """Our record and our metrics events (module docstring).

    Args:
        node: our DHT node (peer ID, addresses, reachability).
        config: the run config (run ID).
        fingerprint: our model's fingerprint.
        options: per-peer settings (public name, join token).
        stats: the trainer's counters (read, never written here).
        phases: the inner phase runner (progress, last phase, throughput).
        duty: the duty cycle (whether we are paused).
        faults: a "call" fault at ``HookPoint.DILOCO_RECORD`` may replace the record.
        on_event: called with every event dict, one call at a time.
        state: our current state.
        state_hash: sha256 of our current state (cached by the trainer: hashing a large model takes seconds).
        records: the swarm's records as our view holds them now.
        shard_bits: how many bits of the peer ID our view's shard level uses (``record_shards``).
    """

    def __init__(
        self,
        node: PeerNode,
        config: RunConfig,
        fingerprint: str,
        options: TrainerOptions,
        stats: TrainerStats,
        phases: PhaseRunner,
        duty: DutyCycle,
        faults: FaultInjector,
        on_event: Callable[[dict], None],
        *,
        state: Callable[[], TrainingState],
        state_hash: Callable[[], str],
        records: Callable[[], list[PeerRecord]],
        shard_bits: Callable[[], int],
    ):
        self.node, self.config, self.fingerprint, self.options = node, config, fingerprint, options
        self.stats, self.phases, self.duty, self.faults, self.on_event = stats, phases, duty, faults, on_event
        self.state, self.state_hash, self.records, self.shard_bits = state, state_hash, records, shard_bits
        self.left_reason = ""  # why we leave (<= 200 chars), in our last record; "" while we train
        # (epoch, what we witness) of our last committed round: the others' credit (diloco.credit)
        self.witnessed: tuple[int, tuple[tuple[str, int], ...]] = (0, ())
        self.sketch_text: tuple[int, str] = (-1, "")  # (epoch, our θ sketch of that epoch as text), once computed
        self._lock = threading.Lock()

    def record(self) -> PeerRecord:
        """The record we publish now (a fault-harness "call" fault at ``HookPoint.DILOCO_RECORD`` may replace it)."""
        stats = self.stats
        phase_epoch, phase_samples = self.phases.progress
        done_epoch, done_samples = self.phases.done
        sketch_epoch, sketch_text = self.sketch_text
        record = PeerRecord(
            peer_id=self.node.peer_id,
            role="trainer",
            version=__version__,
            run_id=self.config.run_id,
            model_fingerprint=self.fingerprint,
            epoch=self.state().epoch,
            throughput=min(self.phases.throughput, 1e12),
            state_hash=self.state_hash(),
            param_sketch=sketch_text if self._carries_sketch(sketch_epoch) else "",
            samples_total=stats.samples_total,
            compute_s=stats.compute_s,
            public_name=self.options.public_name,
            maddrs=tuple(self.node.visible_maddrs()[:8]),
            reachable=not self.node.config.client_mode,
            loss=stats.last_loss,
            eval_loss=stats.last_eval_loss,
            rounds_committed=stats.rounds_committed,
            rounds_failed=stats.rounds_failed,
            last_round_s=stats.last_round_s,
            last_group_size=stats.last_group_size,
            last_failure=stats.last_failure[:200],
            phase_epoch=phase_epoch,
            phase_samples=phase_samples,
            done_epoch=done_epoch,
            done_samples=done_samples,
            left_reason=self.left_reason,
            paused=self.duty.paused,
            join_token=self.options.join_token,
            witnessed=self.witnessed[1],
            witnessed_epoch=self.witnessed[0] if self.witnessed[1] else 0,
            updated_at=get_dht_time(),
        )
        return self.faults.check(HookPoint.DILOCO_RECORD, record=record)["record"]

    def _carries_sketch(self, sketch_epoch: int) -> bool:
        """Our record carries our θ sketch of the current epoch: always in a small swarm, in 1 epoch of 8 in a sharded
        one (``record_shards.carries_sketch``: bounded heartbeat reads)."""
        epoch = self.state().epoch
        return sketch_epoch == epoch and carries_sketch(self.node.peer_id, epoch, self.shard_bits())

    def emit(self, event: str, **fields) -> None:
        """Write the metrics event ``event``: its ``fields`` after our time, peer ID, epoch, state hash and
        ``peers_seen`` (the trainers in our view)."""
        payload = {
            "event": event,
            "time": time.time(),
            "peer": self.node.peer_id,
            "epoch": self.state().epoch,
            "state_hash": self.state_hash(),
            "peers_seen": len([r for r in self.records() if r.role == "trainer"]),
            **fields,
        }
        self.write(payload)

    def discard(self, samples: int, reason: str) -> None:
        """Computed samples that no round will take: counted (``samples_discarded``), logged and an event."""
        if samples <= 0:
            return
        self.stats.samples_discarded += samples
        logger.warning("discarding %d computed samples: %s", samples, reason)
        self.emit("samples_discarded", samples=samples, reason=reason)

    def write(self, payload: dict) -> None:
        """Pass ``payload`` to ``on_event`` as it is (an inner step's event carries only its own fields)."""
        with self._lock:  # the background round and the inner steps emit too
            self.on_event(payload)

    def fault_fired(self, point: HookPoint, action: str, context: dict) -> None:
        """``FaultInjector.on_fire``: a ``fault_fired`` event with the point, the action and the hook's plain context
        values (``epoch``, ``peer``, ``subround``, ...; tensors and dicts left out). Runs on the thread that hit the
        hook, before the action (an ``exit`` fault's event is written before the process ends)."""
        plain = {key: value for key, value in context.items() if isinstance(value, (bool, int, float, str))}
        self.emit("fault_fired", point=point.value, action=action, context=plain)
