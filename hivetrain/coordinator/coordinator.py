"""The coordinator: a long-running bootstrap peer that publishes the run's signed config and watches the swarm.

It is a convenience, not a single point of failure: training peers need it only to bootstrap and read the config.
Its peer ID is part of the address volunteers are given, and joiners accept only a config signed by that ID.
Optionally (``StateFollower``) it keeps a verified copy of the training state, serves it to joiners and writes
checkpoints; and (``DashboardServer``) it serves a live dashboard, a JSON API and Prometheus metrics.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hivemind.utils import get_dht_time

from hivetrain import __version__
from hivetrain.config import RunConfig
from hivetrain.coordinator.follower import StateFollower
from hivetrain.coordinator.observer import SwarmObserver
from hivetrain.coordinator.pipeline import fetch_pipeline_records
from hivetrain.coordinator.revocations import RevocationFile
from hivetrain.coordinator.run_clock import earliest_start, load_start, save_start, start_for_epoch
from hivetrain.data import vocab_size_of
from hivetrain.model import build_run_model
from hivetrain.peers.node import PeerNode
from hivetrain.peers.quorum import QuorumConfig
from hivetrain.peers.record_shards import decide_shard_bits, fetch_swarm
from hivetrain.peers.records import (
    PeerRecord,
    RunConfigRecord,
    fetch_run_config,
    live_records,
    publish_record,
    publish_run_config,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoordinatorOptions:
    """Args:
    config_ttl_s: the published run config expires after this many seconds unless refreshed.
    refresh_interval_s: how often the config and our record are re-published and the swarm is read, seconds.
    record_ttl_s: our peer record's lifetime, seconds.
    run_clock_path: where the run's start is saved (``run_clock``); None = keep it only in the DHT.
    quorum: supplies ``min_epoch_s`` and ``max_clock_skew_s`` of the run-age bound (the trainers' defaults).
    revocations_path: the token issuer's revocation list (``coordinator.revocations``), read again at every refresh
        and published in our record; None = none.
    """

    config_ttl_s: float = 3600.0
    refresh_interval_s: float = 10.0
    record_ttl_s: float = 30.0
    run_clock_path: Path | None = None
    quorum: QuorumConfig = QuorumConfig()
    revocations_path: Path | None = None

    def __post_init__(self) -> None:
        if self.refresh_interval_s >= min(self.config_ttl_s, self.record_ttl_s):
            raise ValueError("refresh_interval_s must be shorter than config_ttl_s and record_ttl_s")


def run_fingerprint(config: RunConfig) -> str:
    """The model fingerprint of a run, computed without allocating parameters (meta device); a pretrained start's
    weights are read once to hash them (``hivetrain.model.build_run_model``)."""
    return build_run_model(config, vocab_size_of(config.data), meta=True).fingerprint


class Coordinator:
    """Publishes the run config and a coordinator record, follows the state and feeds the dashboard until stop()."""

    def __init__(
        self,
        node: PeerNode,
        config: RunConfig,
        fingerprint: str,
        options: CoordinatorOptions = CoordinatorOptions(),
        follower: StateFollower | None = None,
        observer: SwarmObserver | None = None,
    ):
        self.node, self.config, self.fingerprint, self.options = node, config, fingerprint, options
        self.follower, self.observer = follower, observer
        self._stop = threading.Event()
        self._publish_lock = threading.Lock()
        self.records: list[PeerRecord] = []
        self.shard_bits = 0  # the level trainers store their records at (peers/record_shards.py), said in our record
        self._previous_bits, self._bits_changed_at = 0, -float("inf")
        self.started_at = time.time()
        self.run_started_at: float | None = None  # DHT time of the run's epoch 0, set by the first publish()
        if follower is not None:
            follower.read_records = self._read_records  # the follower's fresh reads see every shard too
        self._follow_thread = threading.Thread(target=self._follow_loop, name="follower", daemon=True)
        path = options.revocations_path
        self.revocations = RevocationFile(path) if path is not None else None

    def publish(self) -> None:
        """Publish (refresh) the signed run config and our record (from the main loop, and from the follower's
        thread when our epoch changed)."""
        with self._publish_lock:
            self._publish()

    def _publish(self) -> None:
        self._update_run_start()
        record = RunConfigRecord(
            run_config=self.config.to_dict(),
            version=__version__,
            coordinator_id=self.node.peer_id,
            published_at=get_dht_time(),
            run_started_at=self.run_started_at,
        )
        if not publish_run_config(self.node.dht, self.node.owner_marker, record, self.options.config_ttl_s):
            logger.warning("no DHT node accepted the run config")
        if self.follower is not None:
            epoch, state_hash = self.follower.epoch, self.follower.state_hash
        else:
            epoch, state_hash = max((r.epoch for r in self.records if r.role == "trainer"), default=0), ""
        me = PeerRecord(
            peer_id=self.node.peer_id,
            role="coordinator",
            version=__version__,
            run_id=self.config.run_id,
            model_fingerprint=self.fingerprint,
            epoch=epoch,
            throughput=0.0,
            state_hash=state_hash,
            maddrs=tuple(self.node.visible_maddrs()[:8]),
            reachable=not self.node.config.client_mode,
            revoked=self.revocations.current() if self.revocations is not None else (),
            record_shard_bits=self.shard_bits,
            updated_at=get_dht_time(),
        )
        publish_record(self.node.dht, self.node.owner_marker, me, self.options.record_ttl_s)

    def _update_run_start(self) -> None:
        """Resolve the run's start once (saved file, our record still in the DHT, now: the earliest), then move it
        earlier whenever the state we follow is further ahead than it allows; save and hand it to the follower."""
        now, quorum, path = get_dht_time(), self.options.quorum, self.options.run_clock_path
        start = self.run_started_at
        if start is None:
            saved = load_start(path, self.config.run_id) if path is not None else None
            try:
                ours = fetch_run_config(self.node.dht, {self.node.peer_id})
            except Exception as exc:  # noqa: BLE001 - the saved value and now remain
                logger.warning("could not read our earlier run config record: %r", exc)
                ours = None
            published = ours.run_started_at if ours is not None else None
            start = earliest_start([saved, published], now, quorum.max_clock_skew_s)
        if self.follower is not None:
            start = start_for_epoch(start, self.follower.epoch, now, quorum.min_epoch_s)
        if start != self.run_started_at:
            self.run_started_at = start
            if path is not None:
                save_start(path, self.config.run_id, start)
            if self.follower is not None:
                self.follower.options = dataclasses.replace(self.follower.options, run_started_at=start)

    def poll(self) -> list[PeerRecord]:
        """Refresh the view of the swarm (peer records of this run)."""
        try:
            self.records = self._read_records()
        except Exception as exc:  # noqa: BLE001 - keep the last view
            logger.warning("could not read peer records: %r", exc)
        self._update_shard_bits()
        if self.observer is not None:
            self.observer.observe(self.records, time.time())
            if self.observer.pipeline is not None:
                try:
                    found = fetch_pipeline_records(self.node.dht, self.config.run_id)
                    self.observer.pipeline.observe(*found, time.time())
                except Exception as exc:  # noqa: BLE001 - keep the last view
                    logger.warning("could not read the pipeline's records: %r", exc)
        return self.records

    def run(self, on_tick=None) -> None:
        """Publish and poll every ``refresh_interval_s`` until ``stop()``; ``on_tick(records)`` after each poll."""
        if self.follower is not None:
            self._follow_thread.start()
        while not self._stop.is_set():
            try:
                self.publish()
            except Exception as exc:  # noqa: BLE001 - a DHT hiccup must not kill the coordinator
                logger.warning("publishing failed: %r", exc)
            records = self.poll()
            if on_tick is not None:
                on_tick(records)
            self._stop.wait(self.options.refresh_interval_s)

    def _follow_loop(self) -> None:
        assert self.follower is not None
        while not self._stop.wait(min(2.0, self.options.refresh_interval_s)):
            try:
                records, before = self.records, self.follower.epoch
                if self._at_the_end(records):  # trainers linger only until our record shows their last epoch
                    records = self._read_records()
                self.follower.step(records)
                if self.follower.epoch != before:
                    self.publish()  # our epoch (and the checkpoint it stands for) reaches the trainers at once
                if self.observer is not None:
                    self.observer.set_checkpoints(self.follower.checkpoint_rows(), self.follower.checkpoints_written)
            except Exception:  # noqa: BLE001 - keep following; the next poll retries
                logger.exception("following the swarm's state failed")

    def _read_records(self) -> list[PeerRecord]:
        """Every record of the run: the level-0 key and every shard at our level (and the previous one for a record
        TTL after a change, while trainers move)."""
        levels = {self.shard_bits}
        if time.monotonic() - self._bits_changed_at <= self.options.record_ttl_s:
            levels.add(self._previous_bits)
        return fetch_swarm(self.node.dht, self.config.run_id, levels)

    def _update_shard_bits(self) -> None:
        """Move the shard level when the live trainers no longer fit it (``decide_shard_bits``: up at once, down a
        level per poll); the next publish tells the trainers."""
        now = get_dht_time()
        live = live_records(self.records, now, self.options.record_ttl_s)
        bits, reason = decide_shard_bits(len(live), self.shard_bits)
        if bits != self.shard_bits:
            logger.info("peer records: shard level %d -> %d (%s)", self.shard_bits, bits, reason)
            self._previous_bits, self._bits_changed_at, self.shard_bits = self.shard_bits, time.monotonic(), bits

    def _at_the_end(self, records: list[PeerRecord]) -> bool:
        """Whether trainers are at the run's last epoch (or one before it) and we do not hold it yet: then the
        follower reads the records afresh every step instead of every ``refresh_interval_s``, so the final state is
        downloaded (and checkpointed) seconds after its commit while its trainers wait for us to hold it
        (``diloco.resync.Resync.linger``)."""
        last = self.config.diloco.outer_steps
        assert self.follower is not None
        newest = max((r.epoch for r in records if r.role == "trainer"), default=0)
        return bool(last) and newest >= last - 1 and self.follower.epoch < last

    def stop(self) -> None:
        self._stop.set()
