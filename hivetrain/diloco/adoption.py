"""Adopting a state another peer computed: the I/O half of ``sync_policy.decide_sync``.

A sync decision names an epoch, its hash and the donors that hold it; ``StateAdopter.adopt`` downloads it
(``state_fetch``: verified, multi-donor) and takes it only on evidence its donors cannot fake:

1. the bytes hash to a state the swarm publishes (a quorum's, the coordinator's, or the decision's own target:
   ``sync_policy.download_hashes``), and the state takes us forward (``download_short``);
2. θ is one step from ours: ‖θ_new − θ_ours‖₂ per epoch jumped is within ``averaging.max_update_ratio`` x the median
   of our last committed steps (``update_bound.step_norm``; no bound before we know ``update_norm_min_history``);
3. with moshpit or gossip, where no other peer holds the donor's exact state, θ is close to the θ sketches other
   peers published (``join_check``);
4. its eval loss on our own held-out windows is at most 10% above ours (``sync_policy.loss_check``): a quorum
   counts identities, which are free in an open run (issue 28: 2 identities one epoch ahead took over 2 honest peers,
   their joiner and the coordinator with random weights x5), and an unbacked state has no quorum at all.

A state someone vouches for (``SyncDecision.vouched``: the run's coordinator, or a seniority-weighted majority of
peers we committed rounds with) needs 2 or 4, not both, and a finite loss: our own state may be many epochs stale,
and the swarm's loss can really rise meanwhile. Session 13's chaos ``pause-twice``: a peer asleep 15 s came back 6
epochs behind, refused the swarm's epoch-16 state (loss 2.325 against its epoch-10 state's 1.891, bound +10%),
banned both honest peers, took solo steps and forked for good. An unvouched state needs both.

The trainer applies the outcome: it adopts the state, or bans the donors the outcome names and retries later.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from hivetrain.diloco.drift import ParamSketcher
from hivetrain.diloco.join_check import JoinCheck
from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_fetch import download_bound_s
from hivetrain.diloco.state_sync import StateDownloadFailed, download_state
from hivetrain.diloco.state_wire import layout_num_bytes
from hivetrain.diloco.sync_policy import SyncDecision, download_hashes, download_short, loss_check
from hivetrain.diloco.update_bound import UpdateNorms, step_norm, update_bound
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
            state far from ours, from the swarm's or far worse than ours.
        step: ‖θ_new − θ_ours‖₂ per epoch jumped of an adopted state (``update_bound.step_norm``; 0 without one).
    """

    state: TrainingState | None
    failure: str = ""
    bans: tuple[tuple[tuple[str, ...], str], ...] = field(default=())
    step: float = 0.0


class StateAdopter:
    """Downloads and checks the state a sync decision names (module docstring).

    Args:
        loop: the asyncio loop thread that talks to p2pd.
        p2p: returns our hivemind P2P handle (set once the trainer started).
        run_id: the run (the state protocol's name).
        published: returns the hashes the swarm publishes now, epoch -> sha256 (a fresh DHT read: donors may commit
            while we download).
        claims: returns what the given peers' current records claim, epoch -> sha256 (a fresh DHT read; probes).
        evaluate: mean eval loss (nats per token) of a state on our held-out windows; None = our current state.
        timeout_s: one download's network timeout, seconds (the whole call is bounded by ``download_bound_s``: 4x,
            plus the state at 1 MiB/s).
        faults: the fault injector (state download hook points).
        admits: whether a donor is a member of the run (invite-only runs); None = an open run.
        join_check: the moshpit/gossip sketch check; None with exact (butterfly) averaging.
        sketcher: computes a state's θ sketch for ``join_check``.
        steps: the per-epoch step norms of our last committed outer steps (the trainer adds each committed or adopted
            step; ``step_check`` reads them).
        max_step_ratio, step_min_history: the step bound (the run's ``averaging.max_update_ratio`` and
            ``update_norm_min_history``); ratio 0 = no bound.
    """

    def __init__(
        self,
        loop: LoopThread,
        p2p: Callable[[], object],
        run_id: str,
        *,
        published: Callable[[], dict[int, str]],
        claims: Callable[[Sequence[str]], dict[int, str]],
        evaluate: Callable[[TrainingState | None], float],
        timeout_s: float,
        faults: FaultInjector,
        admits: Callable[[str], bool] | None,
        join_check: JoinCheck | None,
        sketcher: ParamSketcher,
        steps: UpdateNorms,
        max_step_ratio: float,
        step_min_history: int,
    ):
        self.loop, self.p2p, self.run_id = loop, p2p, run_id
        self.published, self.claims, self.evaluate, self.timeout_s = published, claims, evaluate, timeout_s
        self.faults, self.admits, self.join_check, self.sketcher = faults, admits, join_check, sketcher
        self.steps, self.max_step_ratio, self.step_min_history = steps, max_step_ratio, step_min_history

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
                    lambda: download_hashes(
                        self.published(), decision, self.claims(decision.donors) if decision.probe else None
                    ),
                    ours,
                    self.timeout_s,
                    self.faults,
                    on_bad_donor=lambda peer, reason: bad.append(peer),
                    admits=self.admits,
                    local=ours,  # what an epoch or two changed is all we fetch (with fragments: 1/F per epoch)
                ),
                timeout_s=download_bound_s(self.timeout_s, layout_num_bytes(ours)),
            )
        except (StateDownloadFailed, TimeoutError, ValueError) as exc:
            return Adoption(None, str(exc), ((tuple(bad), manifest_liars),))
        bans: list[tuple[tuple[str, ...], str]] = [(tuple(bad), manifest_liars)]
        short = download_short(decision, state.epoch, ours.epoch)
        if short:
            return Adoption(None, short, tuple(bans))
        step = step_norm(ours, state)
        step_ok, step_why = update_bound(step, self.steps.history, self.max_step_ratio, self.step_min_history)
        step_why = f"per-epoch step to epoch {state.epoch}: {step_why}"
        if not step_ok and not decision.vouched:
            bans.append((decision.donors, f"served a state far from ours: {step_why}"))
            return Adoption(None, f"state refused: {step_why}", tuple(bans))
        if self.join_check is not None:  # moshpit/gossip: no other peer holds the donor's hash; check θ's sketch
            sketch = self.sketcher.sketch(state.params)
            verdict = self.join_check.verdict(sketch, records, state.epoch, decision.donors, set(exclude))
            if verdict.refused:
                if verdict.ban_donors:
                    bans.append((decision.donors, f"served a state far from the swarm's: {verdict.refused}"))
                return Adoption(None, verdict.refused, tuple(bans))
        candidate = self.evaluate(state)
        loss_ok, loss_why = loss_check(candidate, self.evaluate(None))
        if decision.vouched and math.isfinite(candidate) and (step_ok or loss_ok):
            # vouched for, and one outer step from ours or as good as ours: the swarm's loss may really have risen
            # since our stale state (module docstring, 4)
            return Adoption(state, "", tuple(bans), step)
        if not loss_ok:
            why = loss_why if step_ok else f"{step_why}; {loss_why}"
            bans.append((decision.donors, f"served a state far worse than ours: {why}"))
            return Adoption(None, f"state refused: {why}", tuple(bans))
        return Adoption(state, "", tuple(bans), step)
