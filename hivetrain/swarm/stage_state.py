"""A stage server's stage states: download a stage's committed state from the stage's servers, serve its own to
joiners, and decide when to resync after an outer step.

A downloaded state is checked against the hash a quorum of the stage's other servers announce
(``STAGE_QUORUM``, issue 12's quorum rule applied to stage records, ``hivetrain.peers.quorum``), chunk by chunk from
several donors (``hivetrain.diloco.state_sync.download_state``); a stage with no server starts from the run seed's
θ₀. ``StageStates`` holds no training state of its own: the runtime's committed state is what it serves and hashes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from transformers import LlamaConfig

from hivetrain import __version__
from hivetrain.config import RunConfig
from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_sync import StateDownloadFailed, StateServer, download_state
from hivetrain.diloco.sync_policy import SyncDecision, SyncTrust, decide_sync
from hivetrain.faults import FaultInjector
from hivetrain.peers.loop import LoopThread
from hivetrain.peers.node import PeerNode
from hivetrain.peers.quorum import QuorumConfig, backed_states
from hivetrain.swarm.announce import StageRecord
from hivetrain.swarm.config import SwarmConfig
from hivetrain.swarm.stages import PipelineStage, StageSpec, build_stage

logger = logging.getLogger(__name__)

STAGE_QUORUM = QuorumConfig(min_peers=1, min_fraction=0.51)  # 0.51: a strict majority (rule 3 is "at least")
"""A stage server adopts the state a strict majority of its stage's other servers hold, even a majority of one: a
stage served by one server must be joinable, and a stage's replicas must reconverge after one missed a commit. A
liar is outvoted only where it faces two or more honest servers of its stage (the quorum rule of item 1 of issue 12,
``hivetrain.peers.quorum``, applied to stage records)."""
STAGE_TRUST = SyncTrust(quorum=STAGE_QUORUM)


def majority_hashes(records: list[StageRecord]) -> dict[int, str]:
    """epoch -> the state hash a quorum of ``records`` (other servers of one stage) backs (``STAGE_QUORUM``)."""
    return {epoch: b.state_hash for epoch, b in backed_states(records, STAGE_QUORUM).items()}


class StageStates:
    """Downloads, serves and hashes one stage server's stage states.

    Args:
        node: this server's DHT node (its peer ID is never its own donor nor its own vote).
        run / swarm / model_config: the run, the pipeline settings and the uncut model's config.
        specs: the stage split (``stages.plan_stages``).
        fetch_records: returns the run's current stage records of this model (a DHT read).
    """

    def __init__(
        self,
        node: PeerNode,
        run: RunConfig,
        swarm: SwarmConfig,
        model_config: LlamaConfig,
        specs: list[StageSpec],
        faults: FaultInjector,
        fetch_records: Callable[[], list[StageRecord]],
    ):
        self.node, self.run, self.swarm, self.model_config = node, run, swarm, model_config
        self.specs, self.faults, self.fetch_records = specs, faults, fetch_records
        self.loop: LoopThread | None = None
        self.p2p = None
        self.downloads = 0
        self._served: set[int] = set()
        self._hashed_state: TrainingState | None = None
        self._hash = ""

    def attach(self, loop: LoopThread, p2p) -> None:
        """The event loop and P2P daemon handle that downloads and served states go through."""
        self.loop, self.p2p = loop, p2p

    def name(self, stage: int) -> str:
        """The RPC name a stage's state is served under."""
        return f"{self.run.run_id}.swarm.stage{stage}"

    def obtain(
        self, stage: int, records: list[StageRecord], timeout_s: float, attempts: int = 4
    ) -> tuple[PipelineStage, TrainingState]:
        """The stage module and committed state: downloaded from the stage's servers, or θ₀ from the seed.

        A donor that committed a newer phase since its last announcement offers a state whose hash no record
        names yet; the download is then retried with fresh records, up to ``attempts`` times.

        Raises:
            StateDownloadFailed: the stage has servers but none served a state matching the announced hashes.
            TimeoutError: a download took longer than ``timeout_s`` seconds.
        """
        spec = self.specs[stage]
        for attempt in range(attempts):
            donors = [
                r
                for r in records
                if r.stage == stage and r.peer_id != self.node.peer_id and r.state_hash and r.status != "moving"
            ]
            if not donors:
                module = build_stage(self.model_config, spec, self.run.seed)
                return module, TrainingState.from_model(module)
            module = PipelineStage(self.model_config, spec)
            try:
                state = self.loop.run(
                    download_state(
                        self.p2p,
                        self.name(stage),
                        [r.peer_id for r in donors],
                        majority_hashes(donors),
                        TrainingState.from_model(module),
                        timeout_s=self.swarm.request_timeout_s,
                        faults=self.faults,
                    ),
                    timeout_s,
                )
            except StateDownloadFailed as exc:
                if attempt + 1 == attempts:
                    raise
                logger.info("stage %d state download failed (%s); retrying with fresh records", stage, exc)
                time.sleep(self.swarm.announce_interval_s)
                records = self.fetch_records()
                continue
            self.downloads += 1
            logger.info("downloaded stage %d state of epoch %d from %d peer(s)", stage, state.epoch, len(donors))
            return module, state
        raise AssertionError("unreachable")

    def serve(self, stage: int, current: Callable[[], TrainingState | None], timeout_s: float) -> None:
        """Serve ``current()`` (this server's committed state of ``stage``, or None while it holds none) to joiners;
        one handler per stage ever served."""
        if stage in self._served:
            return
        self.loop.run(StateServer(current, faults=self.faults).register(self.p2p, self.name(stage)), timeout_s)
        self._served.add(stage)

    def hash(self, state: TrainingState) -> str:
        """sha256 of a committed state, computed once per state object (states are replaced, never mutated)."""
        if self._hashed_state is not state:
            self._hashed_state, self._hash = state, state.state_hash()
        return self._hash

    def resync(self, state: TrainingState, peers: list[StageRecord]) -> SyncDecision:
        """``decide_sync`` on the serving records of our stage's other servers: whether to download, and from whom
        (a strict majority's state, ``STAGE_TRUST``; our own record is no vote)."""
        peer_records = [r.as_peer_record(__version__, self.swarm.microbatch_size) for r in peers]
        return decide_sync(
            self.node.peer_id,
            state.epoch,
            self.hash(state),
            peer_records,
            time.time(),
            self.swarm.record_ttl_s,
            trust=STAGE_TRUST,
            my_vote=False,
        )
