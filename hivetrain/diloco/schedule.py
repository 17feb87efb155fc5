"""When a peer ends its inner phase: the swarm's schedule, not each peer's step count (``diloco.schedule``).

With ``schedule = "steps"`` every peer runs exactly H inner steps (DiLoCo's fixed H, Douillard et al. 2023): on
uneven hardware the fast peers wait for the slow ones, or the slow ones arrive after the group closed.

With ``schedule = "swarm"`` an epoch ends when the samples that all live peers have computed for it reach a target
(hivemind's ``ProgressTracker``: a global ``target_batch_size`` per epoch, every peer publishing its progress and
throughput, everyone estimating when the swarm reaches the target). Every peer then ends its phase at about the same
time, a fast peer running more inner steps than a slow one (the dynamic local updates of Async Local-SGD, Liu et al.
2024, "Asynchronous Local-SGD Training for Language Modeling", Sec. 3.2), and the average stays weighted by samples.

The progress of others comes from their signed records (``PeerRecord.phase_epoch``, ``phase_samples``,
``throughput``, ``updated_at``), extrapolated from ``updated_at`` to ``now`` by their throughput; a peer whose phase
for the epoch has ended (``done_epoch``, ``done_samples``) counts with its final samples. Without that, a slow peer
whose step outlasts the others' phase end would see them gone to the next epoch (overlap) and count itself alone.
A record is a claim, so every claimed number is bounded: extrapolation covers at most ``max_extrapolation_s``, and
one peer counts for at most ``max_samples_per_peer`` samples, so a liar can shorten an epoch only to what that bound
allows.

Pure: no I/O, no clock (``now`` is DHT time, seconds).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from hivetrain.peers.records import PeerRecord, live_records


@dataclass(frozen=True)
class PhasePlan:
    """The run's schedule settings one peer needs (from ``DilocoConfig`` and ``DataConfig``).

    Attributes:
        schedule: "steps" or "swarm".
        inner_steps: H (for "steps"; for "swarm" the per-peer share of the automatic target).
        batch_size: samples per inner step of this peer.
        target_samples_per_epoch: the swarm's samples per epoch; 0 = inner_steps * batch_size * live peers.
        max_samples_per_peer: the most one peer's claimed progress counts for, samples.
        stale_after_s: records older than this are ignored, seconds.
        max_extrapolation_s: a record's progress is extrapolated by its throughput for at most this long, seconds.
    """

    schedule: Literal["steps", "swarm"]
    inner_steps: int
    batch_size: int
    target_samples_per_epoch: int = 0
    max_samples_per_peer: int = 1_000_000
    stale_after_s: float = 30.0
    max_extrapolation_s: float = 15.0


@dataclass(frozen=True)
class PhaseDecision:
    """``action``: "continue" (run another inner step) or "end" (average now). Figures in samples and seconds."""

    action: Literal["continue", "end"]
    reason: str
    swarm_samples: float = 0.0
    target_samples: int = 0
    num_peers: int = 1
    eta_s: float = 0.0


def decide_phase_end(
    plan: PhasePlan,
    my_peer_id: str,
    phase_epoch: int,
    my_samples: int,
    my_samples_per_s: float,
    records: Iterable[PeerRecord],
    now: float,
    coverage: float = 1.0,
) -> PhaseDecision:
    """Decide whether to run another inner step or end the phase and average.

    Args:
        plan: the schedule settings.
        my_peer_id: our peer id (our own record, if among ``records``, is ignored: ``my_samples`` is exact).
        phase_epoch: the epoch (round key) our phase computes a pseudo-gradient for.
        my_samples: samples we computed for it so far; 0 when asked before the phase's first step (then "end" means:
            join the round with weight 0, as others already did or will before our step could end).
        my_samples_per_s: our effective throughput (samples per wall second, sleeps and pauses included); before the
            first step, the last phase's (0 = unknown: a first step runs).
        records: the swarm's peer records (any roles; only live trainers in the same phase epoch count).
        now: DHT time, seconds.
        coverage: the fraction of the swarm's trainers ``records`` holds (``SwarmView.coverage``: a uniform sample
            of a sharded swarm, ``peers/record_shards.py``); the others' samples, throughputs and count are scaled by
            1 / ``coverage``. In (0, 1]; 1 = every record.

    Returns:
        The decision, with the swarm's estimated samples, the target, the number of peers counted and the
        estimated seconds until the target is reached.
    """
    if plan.schedule == "steps":
        target = plan.inner_steps * plan.batch_size
        if my_samples >= target:
            return PhaseDecision("end", f"ran {plan.inner_steps} inner steps", my_samples, target)
        return PhaseDecision("continue", "fixed H", my_samples, target)
    if not 0.0 < coverage <= 1.0:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    scale = 1.0 / coverage  # each record we see stands for this many trainers
    live = live_records(records, now, plan.stale_after_s, exclude={my_peer_id})

    # A peer whose phase for this epoch ended counts with its final samples, not extrapolated: with overlap it has
    # moved on to the next epoch's phase already, and without overlap it waits for the round.
    # (Membership by predicate, not ``r not in done``: comparing pydantic records field by field made this O(N^2),
    # 0.8 s per call at 1,000 records, and a trainer decides after every inner step.)
    def is_done(r: PeerRecord) -> bool:
        return r.done_epoch == phase_epoch and r.done_samples > 0

    done = [r for r in live if is_done(r)]
    running = [r for r in live if not is_done(r) and r.phase_epoch == phase_epoch]
    # A peer that committed the round before ours (its epoch is our phase's) but whose record still shows its previous
    # phase has begun this one and not published yet (records lag by up to a heartbeat): it counts from 0 samples at
    # its commit. Left out, it shrank the target and the others' phases ended without the slowest peer (duty-cycle
    # e2e on a busy machine: the 0.25 peer missed epoch 2 and downloaded state).
    starting = [r for r in live if not is_done(r) and r.epoch == phase_epoch and r.phase_epoch < phase_epoch]
    running += [r.model_copy(update={"phase_samples": 0}) for r in starting]
    num_peers = 1 + round((len(done) + len(running)) * scale)
    step_s = plan.batch_size / my_samples_per_s if my_samples_per_s > 0 else float("inf")
    finished = scale * sum(min(r.done_samples, plan.max_samples_per_peer) for r in done)

    def swarm_samples(ahead_s: float, mine: float) -> float:
        """The swarm's samples ``ahead_s`` seconds from now: each record extrapolated by its throughput, bounded."""
        others = 0.0
        for r in running:
            elapsed_s = min(max(now - r.updated_at, 0.0) + ahead_s, plan.max_extrapolation_s)
            others += min(r.phase_samples + r.throughput * elapsed_s, plan.max_samples_per_peer)
        return mine + finished + scale * others

    target = plan.target_samples_per_epoch or plan.inner_steps * plan.batch_size * num_peers
    total = swarm_samples(0.0, my_samples)
    rate = my_samples_per_s + scale * sum(r.throughput for r in running)
    eta_s = max(0.0, target - total) / rate if rate > 0 else float("inf")
    # The round our phase is for is over: most of the live trainers that took part in it (or could have) committed it
    # and hold a later state. Our pseudo-gradient can no longer join it, and each further step only delays our
    # download (chaos cpu-starve beside 2 hogs: the 20%-CPU peer downloaded epoch 1 while its round was being
    # committed, then ran all 20 steps for it alone, 9 s, since nobody else computed for epoch 1 any more; it reached
    # matchmaking a whole epoch late, downloaded, and never committed once). At least 2 must have moved on, as for
    # ``round_under_way``: one record claiming an epoch ahead cannot cut our phases short. A record that claims a later
    # epoch while its phase still computes for our round (or an earlier one) and has not ended is incoherent: an
    # honest peer at a later epoch computes for a later round, or shows its phase for ours ended. Two identities that
    # claimed one epoch ahead so, beside two honest peers (chaos ahead-liars-2v2 beside 2 hogs), ended an honest
    # peer's phase before its first step; it waited alone in matchmaking, and the group that formed when the others
    # arrived closed at once, without the joiner still in its last step.
    moved_on = sum(
        1
        for r in live
        if r.epoch > phase_epoch and not r.paused and (r.phase_epoch > phase_epoch or r.done_epoch >= phase_epoch)
    )
    still_here = sum(
        1
        for r in live
        if r.epoch <= phase_epoch and not r.paused and phase_epoch in (r.epoch, r.phase_epoch, r.done_epoch)
    )
    if moved_on >= 2 and moved_on > still_here:
        return PhaseDecision(
            "end",
            f"the round of epoch {phase_epoch} is over: {moved_on} live peer(s) committed it, {still_here} did not",
            total,
            target,
            num_peers,
            eta_s,
        )
    if my_samples >= plan.max_samples_per_peer:
        return PhaseDecision("end", f"our {my_samples} samples reach the per-peer bound", total, target, num_peers)
    if my_samples < 1 and num_peers == 1:
        return PhaseDecision("continue", "no inner step yet", total, target, num_peers, eta_s)
    # From here on ``my_samples`` may be 0: the phase is asked before its first step too (``PhaseRunner.run``). A peer
    # whose one step outlasts the others' whole phase (chaos cpu-starve in CI: a 20%-CPU peer on a loaded machine
    # reached matchmaking ~6 s after each group closed and missed 3 of 6 epochs) then joins the round with weight 0
    # instead: it contributes nothing this epoch but stays in it, where its step would have cost the others a wait or
    # itself a download.
    if total >= target:
        how = f"ours {my_samples}, {len(done)} done with {finished:.0f}, {len(running)} running"
        if coverage < 1.0:
            how += f", coverage {coverage:.2f}"
        return PhaseDecision(
            "end", f"swarm reached {total:.0f}/{target} samples ({num_peers} peers: {how})", total, target, num_peers
        )
    # Every other live peer ended its phase for this epoch: they wait for us in matchmaking (a group waits a window and
    # a grace for an expected peer, then closes without it). They ended on their estimate of our progress, which our
    # own pace fell short of (a busy machine: chaos cpu-starve beside 2 hogs, the 20%-CPU peer ran 19 of 20 steps
    # over 5.8 s, arrived ~1 s after each group closed, and missed 5 of 6 epochs). Each further step of ours only
    # delays them or loses our samples and costs a download: average now, once they did their share of the target
    # (a claim counted at most ``max_samples_per_peer``, like progress: a liar that claims to be done must claim its
    # share, and then ends the phase of a peer it is alone with, as a bounded progress claim could already shorten it),
    # or once two or more of them wait, whatever they did: their group waits one step of ours for us, not the rest of
    # the target (cpu-starve beside 2 hogs: the others ended with 280 of 480 samples by our count, having counted on
    # progress our starved steps never made; the starved peer computed on for 10 s and missed the epoch). Two records
    # claiming to be done are the evidence the other rules ask for (``round_under_way``).
    share = target * (num_peers - 1) / num_peers
    if done and not running and (finished >= share or len(done) >= 2):
        return PhaseDecision(
            "end",
            f"every other live peer ({len(done)}) ended its phase: they wait for us ({total:.0f}/{target} samples)",
            total,
            target,
            num_peers,
            eta_s,
        )
    # Our next step would end after the swarm reached the target (it gets there within half a step of ours without
    # us): the others would wait for us. Projected with the same bounds, so a claimed throughput cannot end it early.
    if step_s < float("inf") and swarm_samples(0.5 * step_s, my_samples) >= target:
        return PhaseDecision(
            "end", f"swarm reaches its target in {eta_s:.2f}s, before our next step", total, target, num_peers, eta_s
        )
    return PhaseDecision(
        "continue", f"swarm at {total:.0f}/{target} samples, ~{eta_s:.1f}s to go", total, target, num_peers, eta_s
    )


def round_under_way(
    my_peer_id: str,
    epoch: int,
    records: Iterable[PeerRecord],
    now: float,
    stale_after_s: float,
    min_group_size: int = 2,
) -> bool:
    """Whether the round of ``epoch`` is under way without us: of the other live, unpaused trainers at ``epoch``, more
    have ended their inner phase for it (``done_epoch == epoch``, ``done_samples > 0``) than still compute one
    (``phase_epoch <= epoch``, not ended), and those that ended can average without us (at least 2, and at least
    ``min_group_size``, ``averaging.min_group_size``).

    The swarm's schedule ends the phases of one epoch within seconds of each other, so a majority that ended is
    matching or averaging, and its group closes (or closed) without a phase we would start now; a peer still
    computing then is itself late (a slow one, or a joiner that started before this rule could see the round), and
    must not hold back everyone who arrives after it (the simulator: one such peer kept every later joiner of the
    epoch training for a round it could not join). Peers at ``epoch`` whose phase is for a later round (waiting out
    this one, or overlapping it) count neither way. A lone peer that ended waits for us instead (a group of one
    beside a live trainer is never formed): in a run of two, a peer that restarted while the other had ended its
    phase would otherwise wait for a round that waits for it, until both timed out.

    A phase started then for ``epoch`` ends after that group was declared: its matchmaking answer is "late", and
    once the group commits the peer is behind, downloads ``epoch + 1`` and drops the phase (a pseudo-gradient
    computed against the state before a download is not sent: ``round_policy.keep_carried``). Without overlap such a
    peer (a joiner whose download ended during the round, a peer that just resynced) waits for the round instead
    (``round_wait.RoundWait``, publishing ``phase_epoch = epoch + 1``) and then trains for the next epoch
    from its result. In the simulator, 100 volunteers with 1 h sessions dropped 0.07 of every sample computed this
    way (dev/LOG.md, 2026-11-30).

    Pure. ``records``: the swarm's peer records (any roles; ours is ignored); ``now``: DHT time, seconds; records
    older than ``stale_after_s`` seconds do not count. A peer that claims to be done only makes us wait: the caller
    bounds the wait (one round timeout, once per epoch).
    """
    ended = computing = 0
    for r in live_records(records, now, stale_after_s, exclude={my_peer_id}, paused=False):
        if r.epoch != epoch:
            continue
        if r.done_epoch == epoch and r.done_samples > 0:
            ended += 1
        elif r.phase_epoch <= epoch:
            computing += 1
    return ended >= max(2, min_group_size) and ended > computing


def round_to_wait_for(
    my_peer_id: str,
    my_epoch: int,
    records: Iterable[PeerRecord],
    now: float,
    stale_after_s: float,
    min_group_size: int = 2,
) -> int | None:
    """The epoch whose round a peer at ``my_epoch`` should wait out before it trains or downloads: the newest epoch a
    live trainer holds (ours if newer; behind, the state we would download is about to be replaced), if that round is
    under way without us (``round_under_way``); else None. The trainer (``round_wait.RoundWait``) and the
    simulator (``sim.state_sync``) both ask this."""
    records = list(records)
    live = [r.epoch for r in live_records(records, now, stale_after_s)]
    epoch = max([my_epoch, *live])
    return epoch if round_under_way(my_peer_id, epoch, records, now, stale_after_s, min_group_size) else None


def failed_rounds(records: Iterable[PeerRecord]) -> dict[str, int]:
    """peer id -> the ``rounds_failed`` count each trainer's record shows (the baseline of ``round_failed_since``)."""
    return {r.peer_id: r.rounds_failed for r in records if r.role == "trainer"}


def round_failed_since(baseline: dict[str, int], epoch: int, records: Iterable[PeerRecord]) -> bool:
    """Whether a trainer at ``epoch`` (a member of the round we wait out) published a failed round since ``baseline``
    (``failed_rounds`` when the wait began). Its members then match again for the same epoch, and a peer that waited
    for them can train for it and join that attempt instead of waiting out ``round_timeout_s`` (chaos nan-peer: two
    peers that started 1 s after the others waited 32 s for a round that had failed 2 s in)."""
    return any(
        r.role == "trainer" and r.epoch == epoch and r.rounds_failed > baseline.get(r.peer_id, r.rounds_failed)
        for r in records
    )
