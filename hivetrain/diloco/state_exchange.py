"""A trainer's side of state sync: the server others download our state from, and the resync that downloads theirs.

``StateExchange`` builds and owns, for one ``DilocoTrainer``:

- the ``state_sync.StateServer`` that serves our current state to joiners and to peers behind us (a fault-harness
  "call" fault at ``HookPoint.DILOCO_STATE_SERVER`` may replace it: a hostile donor); in an invite-only run it serves
  members only;
- the ``adoption.StateAdopter`` that downloads a state and checks it against what the swarm's current records publish
  and claim (hash, per-epoch step, θ sketches with moshpit/gossip, loss on our held-out windows);
- the ``resync.Resync`` that decides, between phases, whether we download, probe a claim we do not follow, or train
  on (the trainer installs what it returns);

and what they check about our own state, computed off the critical path on one worker thread: the θ sketch of each
state we hold (``drift.ParamSketcher``; our record publishes it, and a download is checked against the swarm's) and
the per-epoch norms of our recent steps (``update_bound.UpdateNorms``: what a downloaded state's step is bounded by).

``start`` registers the server on our P2P handle, which the downloads then use too; ``close`` ends the worker.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from hivetrain.config import RunConfig
from hivetrain.diloco.adoption import StateAdopter
from hivetrain.diloco.drift import ParamSketcher, sketch_seed
from hivetrain.diloco.evidence import Evidence
from hivetrain.diloco.join_check import JoinCheck
from hivetrain.diloco.options import TrainerOptions
from hivetrain.diloco.resync import Resync
from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_sync import StateServer
from hivetrain.diloco.swarm_view import SwarmView
from hivetrain.diloco.update_bound import UpdateNorms, step_norm
from hivetrain.faults import FaultInjector, HookPoint
from hivetrain.peers.loop import LoopThread
from hivetrain.peers.membership import MemberRoster
from hivetrain.peers.node import PeerNode

REGISTER_TIMEOUT_S = 30.0


class StateExchange:
    """Our state server and our resync (module docstring).

    Args:
        node: our DHT node.
        loop: the asyncio loop thread every P2P call runs on.
        config: the run config (run ID, averaging strategy and update bound, ``diloco.max_downloaders``).
        fingerprint: our model's fingerprint (records of another model are not evidence).
        options: per-peer settings (record timing, state download timeout).
        view: the swarm's records; a download reads them afresh.
        evidence: the trust the records are weighed with; bans go through it.
        faults: the fault injector (a hostile donor replaces our server).
        membership: an invite-only run's roster (we serve and adopt members only); None = an open run.
        state: our current state (what the server serves; its shapes size the θ sketch).
        known_hash: the ``state_hash()`` we already computed for a state, or None (``StateServer``'s).
        evaluate: eval loss of a state (None: ours) on our held-out windows (a downloaded state's loss check).
        stop: set when the trainer stops (waits end early).
        emit: writes a metrics event (``PeerReport.emit``).
    """

    def __init__(
        self,
        node: PeerNode,
        loop: LoopThread,
        config: RunConfig,
        fingerprint: str,
        options: TrainerOptions,
        view: SwarmView,
        evidence: Evidence,
        faults: FaultInjector,
        membership: MemberRoster | None,
        *,
        state: Callable[[], TrainingState],
        known_hash: Callable[[TrainingState], str | None] | None = None,
        evaluate: Callable[[TrainingState | None], float],
        stop: threading.Event,
        emit: Callable[..., None],
    ):
        self.loop, self.run_id = loop, config.run_id
        self._p2p = None  # our P2P handle, from ``start`` on
        shapes = {name: tuple(p.shape) for name, p in state().params.items()}
        self.sketcher = ParamSketcher(shapes, sketch_seed(config.run_id, config.seed))
        # per-epoch ‖θ_{t+1} − θ_t‖₂ of our last committed or adopted steps: what a downloaded state is bounded by
        self.steps = UpdateNorms(config.averaging.update_norm_window)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="sketch")  # off the critical path
        self.join_check = JoinCheck(max_wait_s=options.record_ttl_s)  # moshpit/gossip downloads (``join_check``)
        served = faults.check(
            HookPoint.DILOCO_STATE_SERVER,
            server=StateServer(
                state, faults=faults, max_downloaders=config.diloco.max_downloaders, known_hash=known_hash
            ),
            get_state=state,
            faults=faults,
        )
        self.server: StateServer = served["server"]
        exact_average = config.averaging.exact_average

        def published() -> dict[int, str]:  # runs inside a download: read the DHT only, no daemon check
            fresh = view.fetch_fresh()
            return evidence.published_hashes(r for r in fresh if r.model_fingerprint == fingerprint)

        def claims(peers: Sequence[str]) -> dict[int, str]:  # what these peers' current records claim (probes)
            fresh = view.fetch_fresh()
            return {r.epoch: r.state_hash for r in fresh if r.peer_id in peers and r.model_fingerprint == fingerprint}

        adopter = StateAdopter(
            loop,
            lambda: self._p2p,
            config.run_id,
            published=published,
            claims=claims,
            evaluate=evaluate,
            timeout_s=options.state_timeout_s,
            faults=faults,
            admits=membership.admits if membership is not None else None,  # None: an open run
            join_check=None if exact_average else self.join_check,
            sketcher=self.sketcher,
            steps=self.steps,
            max_step_ratio=config.averaging.max_update_ratio,
            step_min_history=config.averaging.update_norm_min_history,
        )
        self.resync = Resync(
            node.peer_id,
            view,
            evidence,
            adopter,
            exact_average=exact_average,
            stale_after_s=options.record_ttl_s,
            record_interval_s=options.record_interval_s,
            stop=stop,
            emit=emit,
        )
        if membership is not None:
            self.server.admits = membership.admits

    def start(self, p2p) -> None:
        """Serve our state on ``p2p`` (our hivemind P2P handle) and download through it from now on.

        Raises:
            TimeoutError: the handler could not be registered within 30 s.
        """
        self.loop.run(self.server.register(p2p, self.run_id), timeout_s=REGISTER_TIMEOUT_S)
        self._p2p = p2p

    def sketch(self, state: TrainingState, then: Callable[[bytes], None]) -> None:
        """Compute ``state``'s θ sketch on the worker (17 s for 154M parameters), then call ``then`` with it there."""
        self._worker.submit(lambda: then(self.sketcher.encode(state, state.params)))

    def note_step(self, old: TrainingState, new: TrainingState) -> None:
        """A round committed ``new`` from ``old``: add its per-epoch step (``update_bound.step_norm``) to the history
        downloads are bounded by, computed on the worker."""
        self._worker.submit(lambda: self.steps.add(step_norm(old, new)))

    def close(self, cancel: bool) -> None:
        """Wait for the worker's jobs to end (``cancel``: drop those not started yet); idempotent."""
        self._worker.shutdown(wait=True, cancel_futures=cancel)
