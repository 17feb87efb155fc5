"""The coordinator's copy of the training state: follow the swarm, serve joiners, write checkpoints.

The coordinator trains nothing and contributes no weight. After peers commit an outer step it downloads the new
state (θ, outer momentum, epoch) from them with the same verified, multi-donor state download joiners use, accepting
it only if its hash is the one the trainers published. It then serves that state to joiners (so a joiner is not
limited to busy peers as donors) and saves a checkpoint every ``checkpoint_every`` epochs. On restart it loads its
newest complete checkpoint and catches up from the peers.

States live on disk when a work directory is given (``state_file``: the CLI always gives one), so the coordinator
of a 7B run holds a few MB of the state in memory at a time, never the state: downloads are written into a file,
hashed from it, served from it and hard-linked into checkpoints. Without θ₀ of its own (a model too big to build
here, ``initial=None``) the first state it holds is the one the trainers' quorum publishes.

It follows on evidence (``diloco/sync_policy.decide_sync`` with the quorum rule of ``peers/quorum.py``), never on one
claim among others: by default a strict majority of the live trainers, even a majority of one (``FollowerOptions``);
trainers whose epochs the run's age rules out are banned for a while and ignored.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hivemind.utils import get_dht_time

from hivetrain.coordinator.checkpoint import CheckpointStore
from hivetrain.coordinator.dashboard import CheckpointRow
from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_fetch import download_bound_s
from hivetrain.diloco.state_file import StateFile, write_state_file
from hivetrain.diloco.state_sync import StateDownloadFailed, StateServer, download_state
from hivetrain.diloco.state_wire import layout_num_bytes
from hivetrain.diloco.sync_policy import SyncTrust, decide_sync, published_hashes
from hivetrain.diloco.update_bound import UpdateNorms
from hivetrain.diloco.update_bound import step_check as bound_step
from hivetrain.peers.bans import BanList
from hivetrain.peers.loop import LoopThread
from hivetrain.peers.node import PeerNode
from hivetrain.peers.quorum import QuorumConfig
from hivetrain.peers.records import PeerRecord, fetch_records

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FollowerOptions:
    """Args:
    checkpoint_every: save a checkpoint every this many epochs (0 = never).
    keep_checkpoints: keep the newest K complete checkpoints.
    download_timeout_s: limit of one state-download network call, seconds.
    stale_after_s: peer records older than this are ignored, seconds.
    quorum: the quorum rule the coordinator follows trainers by. ``min_peers`` = 1 (the trainers' default is 2): a
        run of one trainer is followed, so joiners can take its state from the coordinator; a lone trainer defines
        the run's progress anyway, honest or not, and a single liar beside one honest trainer is no majority.
    run_started_at: DHT time (unix seconds) of the run's epoch 0, for the run-age bound; None = unknown (no
        bound). Must survive restarts (a later value would make honest epochs look implausible).
    max_step_ratio: a state is adopted only if θ moved from ours by at most this many times the median of the
        last ``step_window`` per-epoch steps we followed, per epoch jumped (``step_check``; the run's
        ``averaging.max_update_ratio``); 0 = no bound. The coordinator trains nothing and holds no data: the size of
        the step is the evidence it can check itself (issue 28: 3 identities one epoch ahead of 2 honest trainers
        made it follow and checkpoint random weights).
    step_window: per-epoch step norms remembered; step_min_history: the bound applies once this many are known.
    """

    checkpoint_every: int = 1
    keep_checkpoints: int = 3
    download_timeout_s: float = 30.0
    stale_after_s: float = 30.0
    # a lone holder may lead (min_peers 1), but only a strict majority: with "at least half" (rule 3 at 0.5) one liar
    # ahead of one honest trainer would be followed
    # and peers still at epoch 0 count against a lone holder: at a run's start a lone liar is otherwise "1 of 1"
    quorum: QuorumConfig = QuorumConfig(min_peers=1, min_fraction=0.51, count_untrained=True)
    run_started_at: float | None = None
    max_step_ratio: float = 10.0
    step_window: int = 16
    step_min_history: int = 3

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ValueError("checkpoint_every must be >= 0 and keep_checkpoints >= 1")


State = TrainingState | StateFile


class StateFollower:
    """Keeps ``state`` equal to the swarm's newest committed state; thread-safe reads via ``current()``.

    Args:
        initial: θ₀ with zero momentum, or None (no state until the first download).
        store: where checkpoints go, or None.
        run_config: the run's config dict (stored in checkpoints; ``diloco.outer_steps`` marks the last epoch).
        fingerprint: the run model's fingerprint: records of another model are ignored.
        on_event: called with a dict per state the follower adopts or refuses and per checkpoint it writes
            (``event``: "state_downloaded" / "state_refused" / "checkpoint_saved", with ``epoch``, ``time`` (unix s)
            and ``state_hash`` / ``reason``), on the follower's thread; it must not raise (the coordinator's
            ``--metrics-file`` appends them as JSON lines).
        reference: names and shapes of the model (``state_file.meta_reference``); default ``initial``.
        work_dir: keep every state on disk in this directory (``state_file.StateFile``); None = in memory. Files
            named ``state-*.safetensors`` there are the follower's: those left by an earlier process are removed.

    Raises:
        ValueError: neither ``initial`` nor ``reference`` given.
        OSError: ``initial`` could not be written to ``work_dir``.
    """

    SERVED_EPOCHS_ON_DISK = 2
    """Epochs the state server serves when states are on disk: the current one and the one before (a joiner whose
    download began one epoch ago can finish it). With the next state downloading, 3 states' worth of disk."""
    KEEP_FILES = 1
    """State files kept under their names: the current one. An older file is unlinked at once; its bytes stay
    readable, and on disk, for as long as the state server serves it (an open descriptor), then are freed."""

    def __init__(
        self,
        node: PeerNode,
        loop: LoopThread,
        run_id: str,
        initial: TrainingState | None,
        store: CheckpointStore | None,
        run_config: dict,
        fingerprint: str,
        options: FollowerOptions = FollowerOptions(),
        on_event: Callable[[dict], None] | None = None,
        *,
        reference: TrainingState | None = None,
        work_dir: Path | None = None,
    ):
        self.on_event = on_event or (lambda event: None)
        self.node, self.loop, self.run_id, self.store = node, loop, run_id, store
        # every record of the run, read afresh (the coordinator replaces it with its read of every shard)
        self.read_records: Callable[[], list[PeerRecord]] = lambda: fetch_records(node.dht, run_id)
        self.run_config, self.fingerprint, self.options = run_config, fingerprint, options
        reference = reference if reference is not None else initial
        if reference is None:
            raise ValueError("StateFollower needs the initial state or a reference of the model's shapes")
        self.reference: TrainingState = reference
        self.work_dir, self._files, self._next_file = work_dir, deque(), 0
        if work_dir is not None:
            for stale in Path(work_dir).glob("state-*.safetensors"):
                stale.unlink(missing_ok=True)
        state: State | None = initial
        if initial is not None and work_dir is not None:
            state = self._keep_file(write_state_file(initial, self._new_path(), reference))
        self._state, self._hash = state, state.state_hash() if state is not None else ""
        self._lock = threading.Lock()
        self.server = StateServer(self.current, keep_epochs=self.SERVED_EPOCHS_ON_DISK if work_dir is not None else 3)
        self.checkpoints_written = 0
        self.downloads = 0
        self.bans = BanList()
        self.steps = UpdateNorms(options.step_window)  # ‖θ_{e+1} − θ_e‖ of the epochs we followed

    def _new_path(self) -> Path:
        assert self.work_dir is not None
        self._next_file += 1
        return Path(self.work_dir) / f"state-{self._next_file:06d}.safetensors"

    def _keep_file(self, state: State) -> State:
        """Track a state file; unlink the names of those past ``KEEP_FILES`` (their bytes live while referenced)."""
        if isinstance(state, StateFile):
            self._files.append(state.path)
            while len(self._files) > self.KEEP_FILES:
                self._files.popleft().unlink(missing_ok=True)
        return state

    def restore(self) -> int | None:
        """Load the newest complete checkpoint, if any. Returns its epoch.

        Raises:
            OSError: the state file could not be written to ``work_dir`` (a full disk).
        """
        if self.store is None:
            return None
        if self.work_dir is not None:
            path = self._new_path()
            loaded = self.store.load_latest_file(self.reference, path)
        else:
            loaded = self.store.load_latest(self.reference)
        if loaded is None:
            return None
        state, manifest = loaded
        self._set(self._keep_file(state))
        logger.info("restored checkpoint of epoch %d (%s)", state.epoch, manifest.get("state_hash", "")[:12])
        return state.epoch

    def current(self) -> State | None:
        """The state we hold (None before the first, without θ₀)."""
        with self._lock:
            return self._state

    @property
    def epoch(self) -> int:
        """The epoch of the state we hold; 0 while we hold none."""
        state = self.current()
        return state.epoch if state is not None else 0

    @property
    def state_hash(self) -> str:
        with self._lock:
            return self._hash

    def _set(self, state: State) -> None:
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
        state, now = self.current(), get_dht_time()
        decision = decide_sync(
            self.node.peer_id,
            state.epoch if state is not None else -1,  # none held: the trainers' θ₀ is ahead of us
            self.state_hash,
            trainers,
            now,
            self.options.stale_after_s,
            trust=self._trust(now),
            my_vote=False,  # the coordinator trains nothing: its copy is no vote
        )
        for peer_id in decision.ban:
            self.bans.ban(peer_id, now, reason="epoch past the run-age bound")
            logger.warning("banned %s: its epoch is past what the run's age allows", peer_id)
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
                        into=self._new_path() if self.work_dir is not None else None,
                        local=state,  # the chunks our state already holds are not fetched (fragments: 1 - 1/F)
                    ),
                    timeout_s=download_bound_s(self.options.download_timeout_s, layout_num_bytes(self.reference)),
                )
            except (StateDownloadFailed, TimeoutError, ValueError) as exc:
                logger.warning("state download failed: %s", exc)
                return f"download failed: {exc}"
            except OSError as exc:  # the state file: a full disk
                logger.warning("state download failed: cannot write %s: %s", self.work_dir, exc.strerror or exc)
                return f"download failed: {exc}"
            unchecked = unchecked_adoption(state, new, self.steps, self.options)
            ok, why = step_check(state, new, self.steps, self.options)
            if not ok:
                for peer_id in decision.donors:
                    self.bans.ban(peer_id, now, reason=f"served an unbounded step: {why}")
                logger.warning("refused epoch %d from %s: %s", new.epoch, ", ".join(decision.donors), why)
                self._emit("state_refused", new.epoch, reason=why, donors=list(decision.donors))
                if isinstance(new, StateFile):
                    new.close()
                    new.path.unlink(missing_ok=True)
                return f"refused epoch {new.epoch}: {why}"
            if unchecked:
                logger.warning("adopting epoch %d unchecked: %s", new.epoch, unchecked)
                self._keep_before(state, f"epoch {new.epoch} adopted unchecked: {unchecked}")
            self._set(self._keep_file(new))
            self.downloads += 1
            did = f"downloaded epoch {new.epoch} ({decision.reason})"
            logger.info("%s", did)
            self._emit("state_downloaded", new.epoch, state_hash=self._hash, reason=decision.reason)
        self._maybe_checkpoint()
        return did

    def _keep_before(self, state: State | None, reason: str) -> None:
        """Checkpoint ``state`` (if it is not yet) and protect that checkpoint from pruning: the run can go back to it
        if what we adopt next was poisoned. Never raises (a full disk must not stop the follower)."""
        if self.store is None or state is None or state.epoch == 0:
            return
        try:
            if not any(c.epoch == state.epoch and c.status == "ok" for c in self.store.list(verify=False)):
                self.store.save(state, self.run_config, extra={"model_fingerprint": self.fingerprint})
                self.checkpoints_written += 1
            self.store.protect(state.epoch, reason)
        except (OSError, ValueError, TimeoutError) as exc:
            logger.warning("could not keep a checkpoint of epoch %d before %s: %s", state.epoch, reason, exc)

    def _fresh_hashes(self) -> dict[int, str]:
        """The hashes trainers published, read afresh (donors may have committed since our last poll)."""
        records = self.read_records()
        trainers = [r for r in records if r.role == "trainer" and r.model_fingerprint == self.fingerprint]
        now = get_dht_time()
        return published_hashes(trainers, trust=self._trust(now), now=now, stale_after_s=self.options.stale_after_s)

    def _trust(self, now: float) -> SyncTrust:
        banned = frozenset(b.peer_id for b in self.bans.active(now))
        return SyncTrust(self.options.quorum, run_started_at=self.options.run_started_at, banned=banned)

    def _maybe_checkpoint(self) -> None:
        """Checkpoint every ``checkpoint_every`` epochs, and the run's last epoch (``diloco.outer_steps``) whatever
        ``checkpoint_every`` (not 0) says: a run of 8 steps checkpointed every 5 must still end saved."""
        state = self.current()
        every = self.options.checkpoint_every
        last = int((self.run_config.get("diloco") or {}).get("outer_steps") or 0)
        if self.store is None or not every or state is None or state.epoch == 0:
            return
        if state.epoch % every and state.epoch != last:
            return
        if any(c.epoch == state.epoch and c.status == "ok" for c in self.store.list(verify=False)):
            return
        self.store.save(state, self.run_config, extra={"model_fingerprint": self.fingerprint})
        self.checkpoints_written += 1
        logger.info("checkpoint of epoch %d written", state.epoch)
        self._emit("checkpoint_saved", state.epoch)

    def _emit(self, event: str, epoch: int, **fields) -> None:
        self.on_event({"event": event, "time": time.time(), "epoch": epoch, **fields})

    def checkpoint_rows(self) -> list[CheckpointRow]:
        if self.store is None:
            return []
        return [CheckpointRow(c.epoch, c.created_at, c.status, c.reason) for c in self.store.list(verify=True)]


def unchecked_adoption(current: State | None, new: State, steps: UpdateNorms, options: FollowerOptions) -> str:
    """Why moving from ``current`` to ``new`` is more than a step the coordinator can check ("" = it is one): we hold
    no state to measure from (no θ₀ of our own), no step history for ``step_check`` past the run's start (a restart:
    we hold an epoch we did not follow step by step), or another state at our own epoch (a fork resolved by the
    quorum). Before such an adoption the coordinator keeps a checkpoint of ``current`` out of pruning's reach
    (``CheckpointStore.protect``)."""
    if current is None:
        return "we hold no state of our own to measure its step from (the quorum's state is taken as it is)"
    if new.epoch == current.epoch:
        return f"it replaces our state of epoch {current.epoch} (a fork resolved)"
    known, needed = len(steps.history), options.step_min_history
    if options.max_step_ratio and known < needed and current.epoch > known:  # not the run's start followed step by step
        return f"we hold epoch {current.epoch} but only {known} followed step(s) to bound it by (need {needed})"
    return ""


def step_check(current: State | None, new: State, steps: UpdateNorms, options: FollowerOptions) -> tuple[bool, str]:
    """May the coordinator move from ``current`` to ``new``? ``update_bound.step_check`` with the follower's bound
    (``options.max_step_ratio``, ``options.step_min_history``); on yes the per-epoch step is added to ``steps``.

    A state one outer step from ours moves θ by one averaged update; random weights move it by the norm of θ itself,
    orders of magnitude more. The coordinator trains nothing and holds no data, so this is its check. With no state
    of our own there is no step to measure: yes (``unchecked_adoption`` says so)."""
    if current is None:
        return True, "no state of our own to measure the step from"
    return bound_step(current, new, steps, options.max_step_ratio, options.step_min_history)
