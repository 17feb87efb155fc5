"""The simulated swarm's state: one slot per volunteer that ever joined, as numpy columns.

A slot is never reused (a peer that leaves and comes back is a new peer, as a restarted trainer with a fresh identity
would be). Statuses: ABSENT (left or not yet joined), SYNCING (joined, waiting for its first view of the swarm),
DOWNLOADING (fetching state), TRAINING (in an inner phase), READY (phase ended, announced for matchmaking),
AVERAGING (in an all-reduce), WAITING (holding state while its epoch's round is under way without it,
``diloco.schedule.round_under_way``: it trains for the next epoch once that round is over).
Units: seconds, samples, bytes.

The stand-in model: each peer holds θ (``vector_size`` float64) and, at the end of a phase, a pseudo-gradient
Δ = samples x ``STEP_SCALE`` x (g + b_p + ε), with g common to all peers, b_p the peer's data bias and ε fresh noise:
peers that average exactly stay identical, peers that do not drift apart, and the drift is measured on θ.
"""

from __future__ import annotations

import numpy as np

from hivetrain.sim.peers import PeerDraw

ABSENT, SYNCING, DOWNLOADING, TRAINING, READY, AVERAGING, WAITING = range(7)
STEP_SCALE = 1e-4  # Δ per sample, relative to |θ₀| ~ 3 sqrt(D)


class SwarmState:
    """Columns per slot (see the module docstring); ``grow`` doubles the capacity when slots run out."""

    FLOAT = ("joined_at", "leaves_at", "samples_per_s", "base_samples_per_s", "up_bps", "down_bps", "latency_s",
             "phase_start", "carried_samples", "compute_s", "live_s", "samples_computed", "samples_committed", "weight",
             "bytes_sent", "bytes_received", "last_decided_step", "ready_since", "trained_at")  # fmt: skip
    INT = ("status", "epoch", "phase_epoch", "done_epoch", "done_samples", "attempt", "nat", "phases", "carried_phases")

    def __init__(self, capacity: int, vector_size: int, rng: np.random.Generator):
        self.size = 0
        self.capacity = 0
        self.vector_size = vector_size
        self.f = {c: np.zeros(0) for c in self.FLOAT}
        self.i = {c: np.zeros(0, np.int64) for c in self.INT}
        self.theta = np.zeros((0, vector_size))
        self.delta = np.zeros((0, vector_size))
        self.bias = np.zeros((0, vector_size))
        self.peer_ids: list[str] = []
        self.state_hash: list[str] = []
        # per slot: the rounds whose result it accepted with others (numbered by ``GroupRounds.rounds_accepted``); two
        # slots' shared rounds are their seniority with each other (``diloco.evidence``: outer steps committed together)
        self.rounds_with: list[set[int]] = []
        self.index_of: dict[str, int] = {}
        self.speed_jitter = 0.0  # sigma of a phase's log-speed around the peer's (``peers.speed_jitter``)
        self.jitter_rng = np.random.default_rng(0)  # its own stream: jitter leaves the other draws of a seed alone
        self.common = rng.standard_normal(vector_size)
        self.theta0 = 3.0 + rng.standard_normal(vector_size)
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        extra = capacity - self.capacity
        for c in self.FLOAT:
            self.f[c] = np.concatenate([self.f[c], np.zeros(extra)])
        for c in self.INT:
            self.i[c] = np.concatenate([self.i[c], np.zeros(extra, np.int64)])
        for name in ("theta", "delta", "bias"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros((extra, self.vector_size))]))
        self.capacity = capacity

    def add(self, draw: PeerDraw, now: float, rng: np.random.Generator, status: int) -> int:
        """A new slot for ``draw``, joined at ``now``; returns the slot."""
        if self.size == self.capacity:
            self.grow(2 * self.capacity)
        s = self.size
        self.size += 1
        f, i = self.f, self.i
        f["joined_at"][s], f["leaves_at"][s] = now, now + draw.session_s
        f["base_samples_per_s"][s] = draw.samples_per_s
        f["samples_per_s"][s], f["up_bps"][s], f["down_bps"][s] = (
            draw.samples_per_s,
            draw.upload_bytes_per_s,
            (draw.download_bytes_per_s),
        )
        f["latency_s"][s], i["nat"][s] = draw.latency_s, int(draw.behind_nat)
        f["last_decided_step"][s] = -1
        i["status"][s] = status
        self.theta[s] = self.theta0
        self.bias[s] = 0.5 * rng.standard_normal(self.vector_size)
        self.peer_ids.append(draw.peer_id)
        self.state_hash.append("")
        self.rounds_with.append(set())
        self.index_of[draw.peer_id] = s
        return s

    def alive(self) -> np.ndarray:
        """Slots present in the swarm (any status but ABSENT), as indices."""
        return np.flatnonzero(self.i["status"][: self.size] != ABSENT)

    def with_status(self, status: int) -> np.ndarray:
        return np.flatnonzero(self.i["status"][: self.size] == status)

    def step_s(self, slots: np.ndarray, batch_size: int) -> np.ndarray:
        return batch_size / self.f["samples_per_s"][slots]

    def steps_done(self, slots: np.ndarray, now: float, batch_size: int) -> np.ndarray:
        """Inner steps completed since each slot's phase started (0 before a phase that starts later: a peer still
        applying its outer step, ``peers.outer_step_s``)."""
        elapsed = np.maximum(now - self.f["phase_start"][slots], 0.0)
        return np.floor(elapsed / self.step_s(slots, batch_size) + 1e-9)

    def start_phase(self, slot: int, epoch: int, now: float) -> None:
        """Begin an inner phase computing a pseudo-gradient for round key ``epoch``; its first step starts at ``now``
        (which may lie ahead: the peer counts as training with 0 steps done until then). With ``speed_jitter`` the
        phase runs at a fresh speed around the peer's own. Its round starts afresh: attempts and the call deadline
        count from its next announce (the trainer's ``RoundRunner.run`` per phase), also after a state download."""
        self.i["status"][slot] = TRAINING
        self.i["phase_epoch"][slot] = epoch
        self.f["phase_start"][slot] = now
        self.i["attempt"][slot], self.f["ready_since"][slot] = 0, 0.0
        if self.speed_jitter > 0:
            factor = np.exp(self.speed_jitter * self.jitter_rng.standard_normal())
            self.f["samples_per_s"][slot] = self.f["base_samples_per_s"][slot] * factor
        self.f["last_decided_step"][slot] = 0
        if self.f["trained_at"][slot] == 0:
            self.f["trained_at"][slot] = now

    def end_phase(self, slot: int, num_samples: int, compute_s: float, rng: np.random.Generator) -> None:
        """The phase ended with ``num_samples`` new samples: compute the pseudo-gradient. A carried contribution
        (``carried_samples`` over ``carried_phases`` phases, what ``keep_carried`` left of it) joins it as the
        trainer's does (``diloco.rounds.Contribution.merged``): Δ their sample-weighted mean, weight their sum."""
        f = self.f
        f["compute_s"][slot] += compute_s
        f["samples_computed"][slot] += num_samples
        carried = f["carried_samples"][slot]
        total = num_samples + carried
        noise = rng.standard_normal(self.vector_size)
        fresh = num_samples * STEP_SCALE * (self.common + self.bias[slot] + noise)
        if carried and total > 0:
            self.delta[slot] = (carried * self.delta[slot] + num_samples * fresh) / total
        else:
            self.delta[slot] = fresh
        f["weight"][slot] = total
        f["carried_samples"][slot] = 0
        self.i["phases"][slot] = self.i["carried_phases"][slot] + 1 if carried else 1
        self.i["carried_phases"][slot] = 0
        self.i["done_epoch"][slot] = self.i["phase_epoch"][slot]
        self.i["done_samples"][slot] = int(total)
