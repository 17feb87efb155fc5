"""Adopting a state another peer computed: the I/O half of ``sync_policy.decide_sync``.

A sync decision names an epoch, its hash and the donors that hold it; ``StateAdopter.adopt`` downloads it
(``state_fetch``: verified, multi-donor) and takes it only on evidence its donors cannot fake:

1. the bytes hash to a state the swarm publishes (a quorum's, the coordinator's, or the decision's own target:
   ``sync_policy.download_hashes``), and the state takes us forward (``download_short``);
2. with moshpit or gossip, where no other peer holds the donor's exact state, θ is close to the θ sketches other
   peers published (``join_check``);
3. its eval loss on our own held-out windows is at most 10% above ours (``sync_policy.loss_check``): a quorum
   counts identities, which are free in an open run (issue 28: 2 identities one epoch ahead took over 2 honest peers,
   their joiner and the coordinator with random weights x5), and an unbacked state has no quorum at all.

The trainer applies the outcome: it adopts the state, or bans the donors the outcome names and retries later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from hivetrain.diloco.drift import ParamSketcher
from hivetrain.diloco.join_check import JoinCheck
from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_sync import StateDownloadFailed, download_state
from hivetrain.diloco.sync_policy import SyncDecision, download_hashes, download_short, loss_check
from hivetrain.faults import FaultInjector
from hivetrain.peers.loop import LoopThread
from hivetrain.peers.records import PeerRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Adoption:
    """What came of one adoption attempt.

    Attributes:
        state: the downloaded, checked state to adopt; None = nothing to adopt (see ``failure``).
        failure: why not, for the ``state_download_failed`` event ("" = not failed: the download was not started
            because sketches are still missing, ``state`` is None too).
        bans: (peer ids, reason) pairs the caller bans: donors that served chunks contradicting their manifest, or a
            state far from the swarm's or far worse than ours.
    """

    state: TrainingState | None
    failure: str = ""
    bans: tuple[tuple[tuple[str, ...], str], ...] = field(default=())


class StateAdopter:
    """Downloads and checks the state a sync decision names (module docstring).

    Args:
        loop: the asyncio loop thread that talks to p2pd.
        p2p: returns our hivemind P2P handle (set once the trainer started).
        run_id: the run (the state protocol's name).
        published: returns the hashes the swarm publishes now, epoch -> sha256 (a fresh DHT read: donors may commit
            while we download).
        evaluate: mean eval loss (nats per token) of a state on our held-out windows; None = our current state.
        timeout_s: one download's network timeout, seconds (the whole call is bounded by 4x).
        faults: the fault injector (state download hook points).
        admits: whether a donor is a member of the run (invite-only runs); None = an open run.
        join_check: the moshpit/gossip sketch check; None with exact (butterfly) averaging.
        sketcher: computes a state's θ sketch for ``join_check``.
    """

    def __init__(
        self,
        loop: LoopThread,
        p2p: Callable[[], object],
        run_id: str,
        *,
        published: Callable[[], dict[int, str]],
        evaluate: Callable[[TrainingState | None], float],
        timeout_s: float,
        faults: FaultInjector,
        admits: Callable[[str], bool] | None,
        join_check: JoinCheck | None,
        sketcher: ParamSketcher,
    ):
        self.loop, self.p2p, self.run_id = loop, p2p, run_id
        self.published, self.evaluate, self.timeout_s = published, evaluate, timeout_s
        self.faults, self.admits, self.join_check, self.sketcher = faults, admits, join_check, sketcher

    def ready(self, decision: SyncDecision, records: list[PeerRecord], exclude: Iterable[str]) -> bool:
        """Whether the download may start now: with moshpit/gossip, once enough θ sketches of the target epoch are
        published to check it against (they come a few seconds after its commit); always with butterfly."""
        if self.join_check is None:
            return True
        ready, note = self.join_check.ready(
            records, decision.target_epoch, decision.donors, set(exclude), time.monotonic()
        )
        if note:
            (logger.warning if ready else logger.info)("state download: %s", note)
        return ready

    def adopt(
        self, decision: SyncDecision, records: list[PeerRecord], ours: TrainingState, exclude: Iterable[str]
    ) -> Adoption:
        """Download the state ``decision`` names and check it (module docstring). Never raises for a donor's fault:
        a failed or refused download is an ``Adoption`` without a state.

        Args:
            decision: a "download" decision of ``decide_sync``.
            records: the records it was made from (the sketches ``join_check`` compares against).
            ours: our current state (the reference layout; its epoch is where we are).
            exclude: peer ids whose sketches do not count (us, the donors, banned peers).
        """
        bad: list[str] = []  # donors that served chunks contradicting their own manifest (appended on the loop)
        manifest_liars = "served state chunks that contradict its own manifest"
        try:
            state = self.loop.run(
                download_state(
                    self.p2p(),
                    self.run_id,
                    list(decision.donors),
                    lambda: download_hashes(self.published(), decision),
                    ours,
                    self.timeout_s,
                    self.faults,
                    on_bad_donor=lambda peer, reason: bad.append(peer),
                    admits=self.admits,
                ),
                timeout_s=self.timeout_s * 4,
            )
        except (StateDownloadFailed, TimeoutError, ValueError) as exc:
            return Adoption(None, str(exc), ((tuple(bad), manifest_liars),))
        bans: list[tuple[tuple[str, ...], str]] = [(tuple(bad), manifest_liars)]
        short = download_short(decision, state.epoch, ours.epoch)
        if short:
            return Adoption(None, short, tuple(bans))
        if self.join_check is not None:  # moshpit/gossip: no other peer holds the donor's hash; check θ's sketch
            sketch = self.sketcher.sketch(state.params)
            verdict = self.join_check.verdict(sketch, records, state.epoch, decision.donors, set(exclude))
            if verdict.refused:
                if verdict.ban_donors:
                    bans.append((decision.donors, f"served a state far from the swarm's: {verdict.refused}"))
                return Adoption(None, verdict.refused, tuple(bans))
        ok, why = loss_check(self.evaluate(state), self.evaluate(None))
        if not ok:
            bans.append((decision.donors, f"served a state far worse than ours: {why}"))
            return Adoption(None, f"state refused: {why}", tuple(bans))
        return Adoption(state, "", tuple(bans))
