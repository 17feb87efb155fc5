"""The coordinator's copy of the training state: follow the swarm, serve joiners, write checkpoints.

The coordinator trains nothing and contributes no weight. After peers commit an outer step it downloads the new
state (θ, outer momentum, epoch) from them with the same verified, multi-donor state download joiners use, accepting
it only if its hash is the one the trainers published. It then serves that state to joiners (so a joiner is not
limited to busy peers as donors) and saves a checkpoint every ``checkpoint_every`` epochs. On restart it loads its
newest complete checkpoint and catches up from the peers.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from hivemind.utils import get_dht_time

from hivetrain.coordinator.checkpoint import CheckpointStore
from hivetrain.coordinator.dashboard import CheckpointRow
from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_sync import StateDownloadFailed, StateServer, download_state
from hivetrain.diloco.sync_policy import decide_sync, published_hashes
from hivetrain.peers.loop import LoopThread
from hivetrain.peers.node import PeerNode
from hivetrain.peers.records import PeerRecord, fetch_records

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FollowerOptions:
    """Args:
    checkpoint_every: save a checkpoint every this many epochs (0 = never).
    keep_checkpoints: keep the newest K complete checkpoints.
    download_timeout_s: limit of one state-download network call, seconds.
    stale_after_s: peer records older than this are ignored, seconds.
    """

    checkpoint_every: int = 1
    keep_checkpoints: int = 3
    download_timeout_s: float = 30.0
    stale_after_s: float = 30.0

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ValueError("checkpoint_every must be >= 0 and keep_checkpoints >= 1")


class StateFollower:
    """Keeps ``state`` equal to the swarm's newest committed state; thread-safe reads via ``current()``."""

    def __init__(
        self,
        node: PeerNode,
        loop: LoopThread,
        run_id: str,
        initial: TrainingState,
        store: CheckpointStore | None,
        run_config: dict,
        fingerprint: str,
        options: FollowerOptions = FollowerOptions(),
    ):
        self.node, self.loop, self.run_id, self.store = node, loop, run_id, store
        self.run_config, self.fingerprint, self.options = run_config, fingerprint, options
        self.reference = initial
        self._state, self._hash = initial, initial.state_hash()
        self._lock = threading.Lock()
        self.server = StateServer(self.current)
        self.checkpoints_written = 0
        self.downloads = 0

    def restore(self) -> int | None:
        """Load the newest complete checkpoint, if any. Returns its epoch."""
        if self.store is None:
            return None
        loaded = self.store.load_latest(self.reference)
        if loaded is None:
            return None
        state, manifest = loaded
        self._set(state)
        logger.info("restored checkpoint of epoch %d (%s)", state.epoch, manifest.get("state_hash", "")[:12])
        return state.epoch

    def current(self) -> TrainingState:
        with self._lock:
            return self._state

    @property
    def state_hash(self) -> str:
        with self._lock:
            return self._hash

    def _set(self, state: TrainingState) -> None:
        digest = state.state_hash()
        with self._lock:
            self._state, self._hash = state, digest

    def register(self) -> None:
        p2p = self.loop.run(self.node.dht.replicate_p2p(), timeout_s=30)
        self._p2p = p2p
        self.loop.run(self.server.register(p2p, self.run_id), timeout_s=30)

    def step(self, records: list[PeerRecord]) -> str:
        """Catch up with the trainers if they are ahead (or hold another state), then checkpoint.

        Returns a short description of what it did (for logs)."""
        trainers = [r for r in records if r.role == "trainer" and r.model_fingerprint == self.fingerprint]
        state = self.current()
        decision = decide_sync(
            self.node.peer_id, state.epoch, self.state_hash, trainers, get_dht_time(), self.options.stale_after_s
        )
        did = "in sync"
        if decision.action == "download" and decision.donors:
            try:
                new = self.loop.run(
                    download_state(
                        self._p2p,
                        self.run_id,
                        list(decision.donors),
                        self._fresh_hashes,
                        self.reference,
                        self.options.download_timeout_s,
                    ),
                    timeout_s=self.options.download_timeout_s * 4,
                )
            except (StateDownloadFailed, TimeoutError, ValueError) as exc:
                logger.warning("state download failed: %s", exc)
                return f"download failed: {exc}"
            self._set(new)
            self.downloads += 1
            did = f"downloaded epoch {new.epoch} ({decision.reason})"
            logger.info("%s", did)
        self._maybe_checkpoint()
        return did

    def _fresh_hashes(self) -> dict[int, str]:
        """The hashes trainers published, read afresh (donors may have committed since our last poll)."""
        records = fetch_records(self.node.dht, self.run_id)
        return published_hashes(r for r in records if r.role == "trainer" and r.model_fingerprint == self.fingerprint)

    def _maybe_checkpoint(self) -> None:
        state = self.current()
        every = self.options.checkpoint_every
        if self.store is None or not every or state.epoch == 0 or state.epoch % every:
            return
        if any(c.epoch == state.epoch and c.status == "ok" for c in self.store.list(verify=False)):
            return
        self.store.save(state, self.run_config, extra={"model_fingerprint": self.fingerprint})
        self.checkpoints_written += 1
        logger.info("checkpoint of epoch %d written", state.epoch)

    def checkpoint_rows(self) -> list[CheckpointRow]:
        if self.store is None:
            return []
        return [CheckpointRow(c.epoch, c.created_at, c.status, c.reason) for c in self.store.list(verify=True)]
