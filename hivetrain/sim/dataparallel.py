"""Data-parallel DiLoCo on a simulated swarm: SimPy processes that drive hivetrain's own decision functions.

Processes: ``_ticks`` (every ``tick_s``: departures, record heartbeats, first views of joiners, schedule decisions,
matchmaking), ``_arrivals`` (Poisson joiners, and the flash crowd) and one process per all-reduce or state download,
whose duration is computed from the participants' links in one step (``sim.network``): no packet is simulated.

Production functions called with simulated inputs (records, entries, time):
- ``diloco.schedule.decide_phase_end``: when a phase ends (or its vectorised model, ``sim.schedule_model``, checked
  against it on sampled peers every tick);
- ``diloco.rounds.expected_peers`` and ``averaging.matchmaking.decide``: who averages together, with entries and
  declarations of the real types and sizes;
- ``averaging.groups.moshpit_groups`` / ``gossip_pairs`` / ``grid_for`` / ``butterfly_partition`` / ``hierarchy``:
  groups, slices, and the rows and columns of the two-stage round;
- ``diloco.sync_policy.decide_sync``, ``diloco.round_policy.may_commit_alone`` and ``decide_after_round``: downloads,
  solo commits, retries.
- ``diloco.schedule.round_under_way``: a peer that holds state while its epoch's round is under way without it (a
  joiner's download ended during the round) waits for that round, as the trainer does, instead of training for it.

Where the simulation simplifies (each also said where it happens): decisions are taken on the tick grid; every peer
reads the same DHT (the newest stored records: no propagation delay), except across a ``[partition]`` while it lasts
(``sim.partition``: each side reads only its own side's records); a group's all-reduce fails as a
whole when a member is gone before it ends (all-or-nothing, as ``averaging.allreduce``), it is not retried in
sub-rounds; peers that share a view and a state share one ``decide_sync`` / ``decide_after_round`` call per tick
(their own record, which is all that differs, is excluded by the function and their own vote is the same).
"""

from __future__ import annotations

import time

import numpy as np
import simpy

from hivetrain.diloco.round_policy import keep_carried
from hivetrain.diloco.schedule import PhasePlan
from hivetrain.diloco.sync_policy import SyncTrust
from hivetrain.peers.record_shards import decide_shard_bits
from hivetrain.sim import dht as simdht
from hivetrain.sim.config import Scenario
from hivetrain.sim.consensus import relative_deviation
from hivetrain.sim.metrics import SimMetrics
from hivetrain.sim.partition import PartitionTracker, SideBoard
from hivetrain.sim.peers import draw_peer
from hivetrain.sim.rounds import RoundEngine
from hivetrain.sim.schedule_model import aggregate_phase_ends, check_against_real, real_phase_ends
from hivetrain.sim.state_sync import GENESIS, StateSync
from hivetrain.sim.swarm_state import (
    ABSENT,
    AVERAGING,
    DOWNLOADING,
    READY,
    SYNCING,
    TRAINING,
    WAITING,
    SwarmState,
)


class DataParallelSim:
    """One simulation run of a scenario in data-parallel mode. ``run()`` returns its ``SimMetrics``."""

    def __init__(self, scenario: Scenario):
        self.sc = scenario
        self.env = simpy.Environment()
        self.rng = np.random.default_rng(scenario.sim.seed)
        self.noise_rng = np.random.default_rng(scenario.sim.seed + 1)
        n = scenario.sim.num_peers
        self.state = SwarmState(max(16, 2 * n), scenario.sim.vector_size, self.rng)
        self.state.speed_jitter = scenario.peers.speed_jitter
        self.state.jitter_rng = np.random.default_rng(scenario.sim.seed + 2)
        self.board = simdht.RecordBoard(self.state.capacity)
        self.shard_bits = 0  # the peer records' shard level (``peers/record_shards.py``)
        self.metrics = SimMetrics(num_peers=n)
        self.metrics.dht.steady_after_s = scenario.schedule.record_ttl_s
        s = scenario.schedule
        self.plan = PhasePlan(s.schedule, s.inner_steps, s.batch_size, s.target_samples_per_epoch,
                              s.max_samples_per_peer, s.stale_after_s, s.max_extrapolation_s)  # fmt: skip
        self.schedule_model = scenario.sim.resolved_schedule_model()
        self.exact = scenario.averaging.exact_average
        self.trust = SyncTrust()  # what a trainer weighs records with (``diloco.evidence``: the default quorum rule)
        self.rounds = RoundEngine(self)
        self.sync = StateSync(self)
        self.partition = PartitionTracker(scenario.partition, scenario.sim.seed)
        self.views: dict[int, SideBoard] | None = None  # each side's view of the board while split, else None
        self.next_publish = np.zeros(self.state.capacity)
        self.num_drawn = 0
        self.done = False
        self.finished = self.env.event()
        self.wall_deadline = float("inf")  # perf_counter() seconds; a benchmark's time limit
        self.stopped_by: str | None = None  # "outer_steps", "max_sim_s", "time_limit" or "interrupted" once done
        self._deadline_means = "time_limit"
        self.on_tick = None  # optional callable(sim_s, outer steps done): progress of a long run (the CLI's bar)

    # ---- peers -----------------------------------------------------------------------------------------------
    def _new_peer(self, status: int) -> int:
        draw = draw_peer(self.rng, self.sc.sim.seed, self.num_drawn, self.sc.peers, self.sc.churn)
        self.num_drawn += 1
        slot = self.state.add(draw, self.env.now, self.rng, status)
        if self.partition.enabled:
            self.partition.add(slot)
        if self.state.capacity > self.board.capacity:
            self.board.grow(self.state.capacity)
            extra = np.zeros(self.state.capacity - len(self.next_publish))
            self.next_publish = np.concatenate([self.next_publish, extra])
        if len(self.metrics.serving) < self.state.capacity:
            grown = np.zeros(self.state.capacity, np.int64)
            grown[: len(self.metrics.serving)] = self.metrics.serving
            self.metrics.serving = grown
        self.next_publish[slot] = self.env.now + self.rng.uniform(0, self.sc.schedule.record_interval_s)
        return slot

    def _depart(self, slots: np.ndarray, now: float) -> None:
        st = self.state
        for slot in slots:
            slot = int(slot)
            status = st.i["status"][slot]
            if status == TRAINING:  # the phase's samples so far are lost, and those it carried
                steps = st.steps_done(np.array([slot]), now, self.sc.schedule.batch_size)[0]
                st.f["samples_computed"][slot] += steps * self.sc.schedule.batch_size
                st.f["compute_s"][slot] += steps * st.step_s(np.array([slot]), self.sc.schedule.batch_size)[0]
                self.metrics.lose("left mid-phase", steps * self.sc.schedule.batch_size + st.f["carried_samples"][slot])
            elif status == READY:
                self.metrics.lose("left before its round", st.f["weight"][slot])
            elif status == AVERAGING:
                self.metrics.lose("left during its round", st.f["weight"][slot])
            st.f["live_s"][slot] = now - st.f["joined_at"][slot]
            st.i["status"][slot] = ABSENT
            self.rounds.forget(slot)
            self.metrics.departures += 1

    def _publish(self, slots: np.ndarray, now: float) -> None:
        st, B = self.state, self.sc.schedule.batch_size
        training = st.i["status"][slots] == TRAINING
        steps = np.where(training, st.steps_done(slots, now, B), 0.0)
        ids = [st.peer_ids[s] for s in slots.tolist()]
        hashes = [st.state_hash[s] for s in slots.tolist()]
        self.board.publish_many(
            slots, ids, hashes, epoch=st.i["epoch"][slots], phase_epoch=st.i["phase_epoch"][slots],
            phase_samples=steps * B + np.where(training, st.f["carried_samples"][slots], 0),
            throughput=np.where(st.i["status"][slots] == WAITING, 0.0, st.f["samples_per_s"][slots]),
            done_epoch=st.i["done_epoch"][slots],
            done_samples=st.i["done_samples"][slots], updated_at=np.full(len(slots), now),
        )  # fmt: skip
        self.next_publish[slots] += self.sc.schedule.record_interval_s
        # the level: the coordinator's from the last count, at least what the level-0 key's crowd calls for (a
        # trainer's floor); this batch published at it before seeing each other (peers/record_shards.py)
        stored = self.board.num_stored()
        bits = self.shard_bits
        per_record = simdht.mean_record_bytes(bits)
        if bits == 0:
            value_bytes = read_bytes = stored * per_record  # one key: the whole swarm, read whole
            self.metrics.dht.ops(len(slots), 2, int(read_bytes), "peers")  # a store of ours and a get of everyone's
        else:
            ids = [self.board.peer_ids[i] for i in np.flatnonzero(self.board.published).tolist()]
            loads = simdht.shard_loads(ids, bits)
            value_bytes = float(loads.max()) * per_record
            # a store, and gets of level 0 (the coordinator's record), our shard and one more in rotation
            read_bytes = (1 + 2 * stored / len(loads)) * per_record
            self.metrics.dht.ops(len(slots), 4, int(read_bytes), "peers")
        self.metrics.dht.value_size(simdht.PEERS_KEY, int(value_bytes), now)
        self.shard_bits = decide_shard_bits(stored, bits)[0]

    def publish_now(self, slots: np.ndarray, now: float) -> None:
        """Publish the records of ``slots`` at once (the trainer's ``request_publish`` after a phase ends, a round
        commits or a download), and restart their heartbeat from now."""
        if len(slots):
            self.next_publish[slots] = now
            self._publish(slots, now)

    def after_commit(self, slots: np.ndarray, epoch: int, now: float) -> set[int]:
        """What a trainer does between a committed round and its next phase (``DilocoTrainer.run``): publish its
        record, and ``sync_state``: download if the records show it behind or forked (each butterfly group of an
        epoch with several groups commits its own state). It reads the records as they were before the group's own
        are republished: a real member's check races with its group mates' stores (on a real swarm of 6 with groups
        of 3, the first members of the second group to commit saw the first group's 3 records against their own 2
        and downloaded). Members whose ``commit_key`` agrees (``sim.sharing``) share one call, and an answer under
        ``top_key`` is reused: after the second epoch of several groups every member holds its own hash. Returns the
        slots that download."""
        by_view: dict[tuple, list[int]] = {}
        free = self.rounds.shared.free_hashes(epoch, now, self.sc.schedule.record_ttl_s)
        for slot in slots.tolist():
            by_view.setdefault(self.rounds.shared.commit_key(slot, now, free), []).append(slot)
        downloading: set[int] = set()
        for group in by_view.values():
            if self.sync.sync_or_download(group, epoch, self.state.state_hash[group[0]], now, top=free is not None):
                downloading.update(group)
                self.metrics.samples_discarded += float(self.state.f["weight"][group].sum())  # the round just applied
        self.publish_now(slots, now)
        return downloading

    # ---- processes -----------------------------------------------------------------------------------------------
    def _arrivals(self):
        churn = self.sc.churn
        if churn.session == "none" or not churn.arrivals:
            return
        rate = self.sc.sim.num_peers / churn.mean_session_s
        while not self.done:
            yield self.env.timeout(float(self.rng.exponential(1 / rate)))
            self._new_peer(SYNCING)
            self.metrics.arrivals += 1

    def _flash_crowd(self):
        crowd = self.sc.flash_crowd
        if crowd.num_joiners == 0:
            return
        yield self.env.timeout(crowd.at_s)
        for _ in range(crowd.num_joiners):
            self.metrics.flash_slots.append(self._new_peer(SYNCING))

    def _ticks(self):
        tick_s = self.sc.sim.tick_s
        while not self.done:
            now = self.env.now
            st = self.state
            alive = st.alive()
            leaving = alive[st.f["leaves_at"][alive] <= now]
            if len(leaving):
                self._depart(leaving, now)
                alive = st.alive()
            publishing = alive[self.next_publish[alive] <= now]
            if len(publishing):
                self._publish(publishing, now)
            self.board.expire(now, self.sc.schedule.record_ttl_s)
            self.views = self.partition.views(self.board, now)
            self.sync.first_views(now)
            self.sync.waiting(now)
            self._schedule(now)
            self.rounds.announce_retries(now)
            self.rounds.poll(now)
            self.metrics.sample_drift(st, now)
            if self.partition.enabled:
                self._sample_partition(now)
            done_steps = int(st.i["epoch"][: st.size].max(initial=0))
            if self.on_tick is not None:
                self.on_tick(now, done_steps)
            if done_steps >= self.sc.sim.outer_steps:
                self.stopped_by = "outer_steps"
            elif now >= self.sc.sim.max_sim_s:
                self.stopped_by = "max_sim_s"
            elif time.perf_counter() > self.wall_deadline:
                self.stopped_by = self._deadline_means
            if self.stopped_by is not None:
                self.done = True
                self.finished.succeed()
                break
            yield self.env.timeout(tick_s)

    # ---- partition (``sim.partition``) ------------------------------------------------------------------------------
    def records_for(self, slot: int) -> list:
        """The records ``slot`` reads from the DHT: everyone's, or its side's while the network is split."""
        return self.board_for(slot).records()

    def board_for(self, slot: int) -> simdht.RecordBoard | SideBoard:
        return self.board if self.views is None else self.views[int(self.partition.side[slot])]

    def by_side(self, slots: np.ndarray) -> list[np.ndarray]:
        """``slots`` split by side while the network is split (non-empty parts only), else ``[slots]``."""
        if self.views is None:
            return [slots]
        sides = self.partition.side[slots]
        return [slots[sides == s] for s in (0, 1) if (sides == s).any()]

    def _sample_partition(self, now: float) -> None:
        st = self.state
        alive = st.alive()
        if len(alive) == 0:
            return
        status = st.i["status"][alive]
        holding = (status != SYNCING) & (status != DOWNLOADING)
        held = alive[holding]
        drift = relative_deviation(st.theta[held]) if len(held) >= 2 else 0.0
        self.partition.sample(now, alive, holding, st.i["epoch"][alive], drift)

    # ---- the schedule --------------------------------------------------------------------------------------------
    def _schedule(self, now: float) -> None:
        st, B = self.state, self.sc.schedule.batch_size
        training = st.with_status(TRAINING)
        if len(training) == 0:
            return
        steps = st.steps_done(training, now, B)
        fresh = steps > st.f["last_decided_step"][training]  # a peer decides after each inner step it completes
        slots, steps = training[fresh], steps[fresh]
        if len(slots) == 0:
            return
        st.f["last_decided_step"][slots] = steps
        if self.views is None:
            ends = self._phase_ends(slots, steps, now)
        else:  # each side decides on its own side's records
            ends, sides = np.zeros(len(slots), bool), self.partition.side[slots]
            for side in (0, 1):
                if (sides == side).any():
                    ends[sides == side] = self._phase_ends(slots[sides == side], steps[sides == side], now)
        step_s = st.step_s(slots, B)
        ending = [int(slots[k]) for k in np.flatnonzero(ends)]
        for k in np.flatnonzero(ends):
            self._trim_carried(int(slots[k]), int(steps[k] * B))
            st.end_phase(int(slots[k]), int(steps[k] * B), float(steps[k] * step_s[k]), self.noise_rng)
        if ending:
            self.publish_now(np.array(ending), now)  # others stop counting on our progress (``request_publish``)
            self.rounds.announce(ending, now)

    def _trim_carried(self, slot: int, new_samples: int) -> None:
        """``slot`` ends a phase of ``new_samples`` samples: drop the oldest carried phases past
        ``schedule.max_carried_phases`` or ``averaging.max_samples_per_round`` (``keep_carried``, as the trainer).

        The simulation keeps a carried contribution's samples and phase count, not each phase's: every carried phase
        counts for an equal share of the samples, and the mean Δ of the phases kept stands for the mean of all (each
        is an estimate of the same update). The samples dropped are counted lost, so the accounting still closes.
        """
        st = self.state
        phases = int(st.i["carried_phases"][slot])
        carried = float(st.f["carried_samples"][slot])
        if phases == 0 or carried == 0:
            return
        share = carried / phases
        bounds = dict(
            max_samples=self.sc.averaging.max_samples_per_round, max_phases=self.sc.schedule.max_carried_phases
        )
        decision = keep_carried(0, 0, [share] * phases, new_samples, **bounds)
        if not decision.drop:
            return
        kept = phases - decision.drop
        st.f["carried_samples"][slot] = share * kept if kept else 0.0
        st.i["carried_phases"][slot] = kept
        self.metrics.lose("dropped from a carried contribution", carried - st.f["carried_samples"][slot])

    def _phase_ends(self, slots: np.ndarray, steps: np.ndarray, now: float) -> np.ndarray:
        """Which of ``slots`` (one side's, while split) end their phase now, after ``steps`` inner steps."""
        st, B = self.state, self.sc.schedule.batch_size
        samples = steps * B + st.f["carried_samples"][slots]
        epochs = st.i["phase_epoch"][slots]
        rates = st.f["samples_per_s"][slots]
        board = self.board if self.views is None else self.views[int(self.partition.side[slots[0]])]
        args = (self.plan, board, slots, epochs, samples, rates, now)
        if self.schedule_model == "real":
            return real_phase_ends(*args)
        ends = aggregate_phase_ends(*args)
        picks = self.rng.choice(len(slots), size=min(self.sc.sim.schedule_probes, len(slots)), replace=False)
        self.metrics.schedule_probes += len(picks)
        self.metrics.schedule_divergences += check_against_real(*args, ends, picks)
        return ends

    # ---- run -----------------------------------------------------------------------------------------------------
    def stop(self, why: str = "interrupted") -> None:
        """End the run at its next tick, metrics and report as for any other end (``stopped_by`` = ``why``). Safe to
        call from a signal handler (it only sets two fields)."""
        self._deadline_means = why
        self.wall_deadline = float("-inf")

    def run(self) -> SimMetrics:
        """Simulate until a peer commits ``outer_steps`` outer steps (or ``max_sim_s``); returns the metrics."""
        started = time.perf_counter()
        for _ in range(self.sc.sim.num_peers):
            slot = self._new_peer(TRAINING)
            self.state.start_phase(slot, 0, 0.0)
            self.state.state_hash[slot] = GENESIS
        # a trainer publishes its record as its first phase begins: a group that closes "complete" on the records it
        # sees must not miss a starting peer whose first heartbeat is still due (it would be "late")
        self.publish_now(self.state.alive(), 0.0)
        self.rounds.check_round_fits()
        self.env.process(self._ticks())
        self.env.process(self._arrivals())
        self.env.process(self._flash_crowd())
        self.env.run(until=self.finished)
        now = self.env.now
        alive = self.state.alive()
        self.state.f["live_s"][alive] = now - self.state.f["joined_at"][alive]
        self.metrics.finish(self, now, time.perf_counter() - started)
        return self.metrics
