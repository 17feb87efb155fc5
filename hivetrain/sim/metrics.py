"""What a simulation measures, and the summary ``report.json`` is made of.

Definitions (units in the names):
- ``utilization_mean``: seconds peers spent in inner steps / seconds they were in the swarm, over all peers.
- ``committed_sample_share``: samples that went into a committed round / samples computed (a peer that leaves
  mid-phase, or whose contribution is dropped across a state download, loses them).
- ``lost_sample_shares``: where the computed samples that no committed round took went, each a share of the
  samples computed: ``left mid-phase`` (a peer left while training), ``left before its round`` (it left with a
  finished phase, waiting for its round), ``left during its round`` (it left inside its round before its
  contribution was in it: in the two-stage round, before its row committed), ``dropped by a resync`` (a failed round
  sent it to download state: ``keep_carried`` with staleness 0 drops its pseudo-gradient), ``dropped from a carried
  contribution`` (a contribution carried past ``schedule.max_carried_phases`` phases loses its oldest);
  ``unaccounted`` is what is left of computed - committed after those (0 when the accounting closes).
- ``discarded_sample_share``: samples of committed rounds whose members then found themselves forked and downloaded
  another group's state (butterfly with several groups per epoch) / samples computed: counted as committed above
  (as the real trainers' summaries count them), yet not in the model the swarm keeps.
- ``time_per_outer_step_s``: median over epochs of the time between the median commits of consecutive epochs.
- ``bytes_per_peer_per_step``: all-reduce bytes sent + received, per committed (peer, round).
- ``dht_ops_per_peer_per_step`` / ``dht_read_bytes_per_peer_per_step``: DHT gets and stores (heartbeats,
  announcements, matchmaking polls), per committed (peer, round).
- ``peak_dht_value_bytes``: the largest value stored under one DHT key (``peak_dht_value_bytes_by_key`` per key);
  ``peak_dht_value_bytes_steady``: the same from one record TTL after the start on (every simulated peer starts
  within one heartbeat: a crowd the peer records' shard level cannot have followed yet).
- ``drift``: max_p ||θ_p - mean|| / ||mean|| over the live peers at the most common epoch, sampled every tick.
- ``committed_states_max``: the most distinct states (state hashes) the commits of one epoch ended on, over epochs:
  1 = every peer that committed an epoch holds one model; more = the epoch forked.
- ``round_s_median``: median duration of one group all-reduce (or one Moshpit/gossip group round) that finished.
- ``flash_*``: the flash crowd's downloads only: catch-up = a joiner's state download time (mean, p90, max),
  ``flash_all_caught_up_s`` = from the crowd's arrival until its last joiner holds the state, and
  ``flash_max_donor_bytes`` = the most bytes one donor served to the crowd; ``flash_still_syncing`` = joiners still
  waiting for or in their download when the run ended (their time is not in the means).
- ``partition``: ``sim.partition.PartitionTracker.summary`` (only with a ``[partition]``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hivetrain.sim.consensus import relative_deviation
from hivetrain.sim.dht import DhtStats
from hivetrain.sim.network import Transfer
from hivetrain.sim.swarm_state import ABSENT, AVERAGING, DOWNLOADING, READY, SYNCING, TRAINING

if TYPE_CHECKING:
    from hivetrain.sim.dataparallel import DataParallelSim
    from hivetrain.sim.swarm_state import SwarmState


@dataclass
class SimMetrics:
    """Counters and samples collected during a run; ``summary`` once ``finish`` ran."""

    num_peers: int
    dht: DhtStats = field(default_factory=DhtStats)
    decisions: Counter = field(default_factory=Counter)
    group_sizes: list[int] = field(default_factory=list)
    commits: dict[int, list[float]] = field(default_factory=dict)  # epoch -> commit time of each member
    downloads: list[dict[str, float]] = field(default_factory=list)
    donor_bytes: dict[int, int] = field(default_factory=dict)
    flash_donor_bytes: dict[int, int] = field(default_factory=dict)
    round_s: list[float] = field(default_factory=list)
    flash_slots: list[int] = field(default_factory=list)
    serving: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    drift: list[tuple[float, int, float]] = field(default_factory=list)  # (time, epoch, deviation)
    partition_history: list[tuple[float, float, float, float, float]] = field(default_factory=list)
    schedule_probes: int = 0
    schedule_divergences: int = 0
    arrivals: int = 0
    departures: int = 0
    samples_discarded: float = 0.0  # committed, then replaced by another group's state (``discarded_sample_share``)
    samples_lost: Counter = field(default_factory=Counter)  # why samples never committed (``lost_sample_shares``)
    committed_states: dict[int, set[str]] = field(default_factory=dict)  # epoch -> the states its commits made
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def flash_set(self) -> set[int]:
        return set(self.flash_slots)

    def count(self, what: str, times: int = 1) -> None:
        self.decisions[what] += times

    def record_commit(self, epoch: int, now: float, num_members: int, state_hashes: Iterable[str] = ()) -> None:
        """``num_members`` peers committed ``epoch`` at ``now``, moving to ``state_hashes`` (one state = one hash)."""
        self.commits.setdefault(epoch, []).extend([now] * num_members)
        self.committed_states.setdefault(epoch, set()).update(state_hashes)

    def record_download(self, slot: int, donors: np.ndarray, cost: Transfer, started: float, now: float,
                        flash: bool) -> None:  # fmt: skip
        for d, b in zip(donors, cost.sent_bytes, strict=True):
            self.donor_bytes[int(d)] = self.donor_bytes.get(int(d), 0) + int(b)
            if flash:
                self.flash_donor_bytes[int(d)] = self.flash_donor_bytes.get(int(d), 0) + int(b)
        self.downloads.append({"slot": slot, "duration_s": now - started, "num_donors": int((cost.sent_bytes > 0)
                               .sum()), "max_donor_bytes": int(cost.sent_bytes.max()), "flash": flash,
                               "ended_at": now})  # fmt: skip

    def lose(self, why: str, num_samples: float) -> None:
        """``num_samples`` computed samples will never be in a committed round, because ``why``."""
        if num_samples > 0:
            self.samples_lost[why] += float(num_samples)

    def regain(self, why: str, num_samples: float) -> None:
        """``num_samples`` counted lost because ``why`` reached a committed round after all (a member of a two-stage
        round that left after its row committed: its pseudo-gradient is in the mean)."""
        if num_samples > 0:
            self.samples_lost[why] -= float(num_samples)

    def _lost_shares(self, computed: float, committed: float) -> dict[str, float]:
        shares = {why: lost / max(computed, 1.0) for why, lost in sorted(self.samples_lost.items())}
        shares["unaccounted"] = (computed - committed - sum(self.samples_lost.values())) / max(computed, 1.0)
        return shares

    def sample_drift(self, st: SwarmState, now: float) -> None:
        alive = st.alive()
        if len(alive) < 2:
            return
        epochs = st.i["epoch"][alive]
        modal = int(np.bincount(epochs).argmax())
        at = alive[epochs == modal]
        if len(at) >= 2:
            self.drift.append((now, modal, relative_deviation(st.theta[at])))

    def finish(self, sim: DataParallelSim, now: float, wall_s: float) -> None:
        st = sim.state
        n = st.size
        f = st.f
        live_s = float(f["live_s"][:n].sum())
        per_step = max(1, sum(len(v) for v in self.commits.values()))
        medians = {e: float(np.median(t)) for e, t in self.commits.items() if t}
        epochs = sorted(medians)
        gaps = [medians[b] - medians[a] for a, b in zip(epochs, epochs[1:], strict=False) if b == a + 1]
        if epochs:
            gaps = [medians[epochs[0]]] + gaps  # the first step starts at time 0
        catchup = [d["duration_s"] for d in self.downloads]
        flash = [d for d in self.downloads if d["flash"]]
        flash_s = [d["duration_s"] for d in flash]
        final_drift = self.drift[-1][2] if self.drift else 0.0
        alive = np.flatnonzero(st.i["status"][:n] != ABSENT)
        # not yet decided when the run ended: rounds cut off by the end, and samples carried into a phase still running
        in_flight = alive[np.isin(st.i["status"][alive], (READY, AVERAGING))]
        carrying = alive[st.i["status"][alive] == TRAINING]
        undecided = f["weight"][in_flight].sum() + f["carried_samples"][carrying].sum()
        computed = float(f["samples_computed"][:n].sum() - undecided)
        self.partition_history = sim.partition.history
        self.summary = {
            "scenario": sim.sc.name,
            "stopped_by": sim.stopped_by,
            "strategy": sim.sc.averaging.strategy,
            "peers": self.num_peers,
            "peers_ever": n,
            "peers_alive_end": int(len(alive)),
            "sim_s": now,
            "outer_steps_done": int(st.i["epoch"][:n].max(initial=0)),
            "utilization_mean": float(f["compute_s"][:n].sum() / live_s) if live_s > 0 else 0.0,
            "committed_sample_share": float(f["samples_committed"][:n].sum() / max(computed, 1.0)),
            "discarded_sample_share": float(self.samples_discarded / max(computed, 1.0)),
            "lost_sample_shares": self._lost_shares(computed, float(f["samples_committed"][:n].sum())),
            "time_per_outer_step_s": float(np.median(gaps)) if gaps else None,
            "bytes_per_peer_per_step": float((f["bytes_sent"][:n].sum() + f["bytes_received"][:n].sum()) / per_step),
            "dht_ops_per_peer_per_step": float(self.dht.ops_total / per_step),
            "dht_read_bytes_per_peer_per_step": float(self.dht.read_bytes_total / per_step),
            "dht_read_bytes_per_peer_per_step_by_key": {
                k: float(v / per_step) for k, v in self.dht.read_bytes_by_key.items()
            },
            "peak_dht_value_bytes": int(max(self.dht.peak_value_bytes.values(), default=0)),
            "peak_dht_value_bytes_by_key": dict(self.dht.peak_value_bytes),
            "peak_dht_value_bytes_steady": int(max(self.dht.peak_value_bytes_steady.values(), default=0)),
            "peak_dht_value_bytes_steady_by_key": dict(self.dht.peak_value_bytes_steady),
            "group_size_mean": float(np.mean(self.group_sizes)) if self.group_sizes else 0.0,
            "group_size_max": int(max(self.group_sizes, default=0)),
            "drift_final": final_drift,
            "drift_max": max((d[2] for d in self.drift), default=0.0),
            # distinct states the commits of one epoch ended on, at the worst epoch (1: one model)
            "committed_states_max": max((len(h) for h in self.committed_states.values()), default=0),
            "downloads": len(self.downloads),
            "catchup_s_mean": float(np.mean(catchup)) if catchup else None,
            "catchup_s_p90": float(np.percentile(catchup, 90)) if catchup else None,
            "flash_catchup_s_mean": float(np.mean(flash_s)) if flash else None,
            "flash_catchup_s_p90": float(np.percentile(flash_s, 90)) if flash else None,
            "flash_catchup_s_max": float(max(flash_s)) if flash else None,
            "flash_downloads": len(flash),
            "flash_joiners": len(self.flash_slots),
            "flash_still_syncing": int(np.isin(st.i["status"][self.flash_slots], (SYNCING, DOWNLOADING)).sum())
            if self.flash_slots
            else 0,
            "flash_all_caught_up_s": (max(d["ended_at"] for d in flash) - sim.sc.flash_crowd.at_s) if flash else None,
            "flash_max_donor_bytes": int(max(self.flash_donor_bytes.values(), default=0)),
            "download_donors": sim.sc.download.num_donors,
            "max_donor_bytes": int(max(self.donor_bytes.values(), default=0)),
            "round_s_median": float(np.median(self.round_s)) if self.round_s else None,
            "mean_session_s": sim.sc.churn.mean_session_s if sim.sc.churn.session != "none" else None,
            "churn": sim.sc.churn.session,
            "group_size_target": sim.sc.averaging.target_group_size,
            "partition": sim.partition.summary(now),
            "arrivals": self.arrivals + len(self.flash_slots),
            "departures": self.departures,
            "schedule_model": sim.schedule_model,
            "schedule_probes": self.schedule_probes,
            "schedule_divergences": self.schedule_divergences,
            "decisions": dict(sorted(self.decisions.items())),
            "wall_s": wall_s,
        }
