"""Between phases, a trainer's place in the swarm: follow the state the evidence names, probe claims it does not.

``DilocoTrainer.sync_state`` calls ``Resync.run`` before each inner phase. It reads the swarm's records, asks
``sync_policy.decide_sync`` whether we are behind or forked, and:

- "download": waits for a settled view after our own commit (a "forked" verdict read while our group's records lag
  ours), then downloads and checks the state (``adoption.StateAdopter``: hash, per-epoch step, θ sketches, loss on our
  windows) and hands it to the trainer to install, banning the donors of a refused one;
- "train": probes a persistent claim it does not follow (``probe.Prober``), banning its holders if what they serve
  fails the same checks (issue 28: otherwise nobody ever holds evidence against identities that only lie).

At the run's last epoch ``Resync.linger`` keeps the peer up while a live trainer behind it may still download it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hivemind.utils import get_dht_time

from hivetrain.diloco.adoption import StateAdopter
from hivetrain.diloco.evidence import Evidence
from hivetrain.diloco.probe import ProbePolicy, Prober
from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.swarm_view import SwarmView
from hivetrain.diloco.sync_policy import decide_sync
from hivetrain.peers.records import PeerRecord, live_records

logger = logging.getLogger(__name__)

FORK_SETTLE_S = 2.0
"""After our own commit, a "forked" verdict waits this long (seconds) for one more read of the swarm: our group's
records follow ours within about a second (each member publishes at once after its commit). Two record intervals
(10 s) cost a joiner in chaos ahead-liars-2v2 two epochs: it waited through the next round."""


@dataclass(frozen=True)
class Synced:
    """What ``Resync.run`` made of one look at the swarm.

    Attributes:
        ok: False = a needed download failed, was refused or waits (the trainer retries before training).
        state: a downloaded, checked state to install; None = keep ours.
        reason: why (``decide_sync``'s reason), for the ``state_downloaded`` event.
        step: the adopted state's per-epoch step from ours (``update_bound.step_norm``), for the step history.
    """

    ok: bool
    state: TrainingState | None = None
    reason: str = ""
    step: float = 0.0


class Resync:
    """Decides and carries out state adoption and probes for one trainer (module docstring).

    Args:
        peer_id: ours.
        view: the swarm's records (read afresh at each ``run``).
        evidence: the trust the records are weighed with; bans go through it.
        adopter: downloads and checks a state.
        exact_average: butterfly averaging (forks are states at our epoch with another hash).
        stale_after_s: records older than this are ignored, seconds (the record TTL).
        record_interval_s: how often peers publish, seconds (a probe waits 2 of them; ``linger`` counts a peer
            alive while its record is at most 3 old).
        stop: set when the trainer stops (waits end early).
        emit: writes a metrics event (``PeerReport.emit``).
    """

    def __init__(
        self,
        peer_id: str,
        view: SwarmView,
        evidence: Evidence,
        adopter: StateAdopter,
        *,
        exact_average: bool,
        stale_after_s: float,
        record_interval_s: float,
        stop: threading.Event,
        emit: Callable[..., None],
    ):
        self.peer_id, self.view, self.evidence, self.adopter = peer_id, view, evidence, adopter
        self.exact_average, self.stale_after_s, self.record_interval_s = exact_average, stale_after_s, record_interval_s
        self.stop, self.emit = stop, emit
        self.prober = Prober(
            peer_id,
            adopter,
            ProbePolicy(settle_s=2 * record_interval_s, stale_after_s=stale_after_s),
            exact_average=exact_average,
        )

    def run(
        self,
        state: TrainingState,
        state_hash: str,
        committed_at: float,
        probe: bool = True,
        history: Mapping[int, str] | None = None,
    ) -> Synced:
        """One look at the swarm from ``state`` (sha256 ``state_hash``), our last commit at ``committed_at``
        (``time.monotonic()``): a state to install, nothing to do, or a failure to retry after. ``probe``: False at
        the run's last epoch (nothing left to protect); ``history``: epoch -> the sha256 of the state we held there
        (what a probe finds contradicted). Never raises for a peer's fault."""
        records = self.view.refresh()
        decision = decide_sync(
            self.peer_id,
            state.epoch,
            state_hash,
            records,
            get_dht_time(),
            stale_after_s=self.stale_after_s,
            exact_average=self.exact_average,
            trust=self.evidence.trust,
            unbacked=True,
            closed_without_us=self.evidence.closed_without_us(state.epoch),
        )
        self.evidence.ban(decision.ban, decision.reason)
        if decision.action == "train":
            if probe:
                self._probe(records, state, state_hash, history or {})
            return Synced(True)
        settle = committed_at + FORK_SETTLE_S - time.monotonic()
        if decision.forked and settle > 0:
            # our group's records lag ours by up to a heartbeat after a commit: a "fork" read now may be one record
            # that has not caught up (issue 28: a 2-2 split swung for a second); decide on a settled view
            logger.info(
                "state download deferred %.1fs for the view to settle after our commit: %s", settle, decision.reason
            )
            self.stop.wait(settle)
            return Synced(False)
        logger.info("state download: %s", decision.reason)
        exclude = {self.peer_id, *decision.donors, *self.evidence.trust.banned}
        if not self.adopter.ready(decision, records, exclude):
            self.stop.wait(1.0)  # the epoch's peers publish their θ sketches a few seconds after its commit
            return Synced(False)
        adoption = self.adopter.adopt(decision, records, state, exclude)
        for peers, reason in adoption.bans:
            self.evidence.ban(peers, reason)
        if adoption.state is None:
            logger.warning("state download failed: %s", adoption.failure)
            self.emit("state_download_failed", reason=adoption.failure)
            self.stop.wait(1.0)
            return Synced(False)
        return Synced(True, adoption.state, decision.reason, adoption.step)

    def _probe(
        self, records: list[PeerRecord], state: TrainingState, state_hash: str, history: Mapping[int, str]
    ) -> None:
        """Probe a persistent claim we do not follow (``diloco.probe``): ban its holders if what they serve fails
        the adoption checks; never adopt it."""
        result = self.prober.maybe_probe(
            records, state, state_hash, self.evidence.trust.banned, get_dht_time(), history
        )
        if result is None:
            return
        for peers, reason in result.adoption.bans:
            self.evidence.ban(peers, reason)
        verdict = "passed (not adopted)" if result.passed else f"failed: {result.adoption.failure}"
        logger.info("%s -> %s", result.decision.reason, verdict)
        self.emit("state_probed", reason=result.decision.reason, passed=result.passed, detail=verdict)

    def linger(self, epoch: int, banned: Callable[[], frozenset[str]], wait_s: float) -> None:
        """We hold the run's last epoch ``epoch``: stay (publishing our record, serving our state) while a live
        trainer behind us may still download it, or the run's coordinator's live record shows an earlier epoch (it
        downloads and checkpoints the final state from us), at most ``wait_s`` seconds. A peer that arrived near the
        end would otherwise train the last epoch alone once everyone else left, and fork it (seen in chaos runs under
        load: a restarted peer up 45 s after its restart); and the run would end without its final checkpoint.
        ``banned``: peers not waited for (liars, peers that sent us bad data)."""
        give_up_at, said, said_keeper = time.monotonic() + wait_s, False, False
        # moshpit/gossip: the coordinator follows no state (peers hold different ones by design), so it never shows
        # the last epoch; waiting for it cost every such run ``wait_s`` at its end
        keeper_id = self.evidence.trust.coordinator_id if self.exact_average else None
        while not self.stop.is_set() and time.monotonic() < give_up_at:
            now, skip = get_dht_time(), banned()
            records = self.view.refresh()
            # the run's coordinator keeps the checkpoints: until its record shows the last epoch, it may still need to
            # download it from us (issue 26: runs of 3 and 8 outer steps exported epochs 2 and 7, the trainers gone)
            coordinators = live_records(records, now, self.stale_after_s, role="coordinator")
            keeper = [r for r in coordinators if keeper_id and r.peer_id == keeper_id and r.epoch < epoch]
            # a paused peer will not take it until it resumes; a record older than 3 heartbeats: killed
            heartbeating = live_records(
                records, now, 3 * self.record_interval_s, banned=skip, exclude={self.peer_id}, paused=False
            )
            behind = [r for r in heartbeating if r.epoch < epoch]
            if not behind and not keeper:
                return
            if behind and not said:
                said = True
                logger.info("run finished at epoch %d: waiting for %d peer(s) behind to take it", epoch, len(behind))
            if keeper and not said_keeper:
                said_keeper = True
                logger.info("run finished at epoch %d: waiting for the run's coordinator (at epoch %d) to save it",
                            epoch, keeper[0].epoch)  # fmt: skip
            self.stop.wait(1.0)
