"""Per-peer settings of a DiLoCo trainer that are not part of the run config, and the counters it keeps."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class TrainerOptions:
    """Per-peer settings that are not part of the run config.

    Args:
        public_name: shown on the contributors' board.
        record_ttl_s: our peer record expires after this many seconds unless refreshed.
        record_interval_s: refresh period of our record, seconds.
        state_timeout_s: limit of one state-download network call, seconds.
        max_outer_steps: stop after this epoch (0 = the run config's ``diloco.outer_steps``).
        dht_lost_after_s: give up (DhtLost) after the DHT has been unreachable this long, seconds.
        duty_cycle: train at most this fraction of wall time (0 < F <= 1), sleeping between inner steps.
        pause_file: while this file exists the peer pauses its inner steps (stays in the swarm); "" = none.
        coordinator_id: base58 peer ID of the run's coordinator (the signer of the run config we trust); its records
            count as evidence of the state at its epoch. "" = none known: coordinator-role records are ignored.
        run_started_at: DHT time (unix seconds) of the run's epoch 0 as the coordinator publishes it, for the run-age
            bound on claimed epochs; None = unknown (no bound).
        join_token: our join token for an invite-only run (``peers.membership``), carried in our record; "" = none.
    """

    public_name: str = ""
    record_ttl_s: float = 30.0
    record_interval_s: float = 5.0
    state_timeout_s: float = 30.0
    max_outer_steps: int = 0
    dht_lost_after_s: float = 60.0
    duty_cycle: float = 1.0
    pause_file: str = ""
    coordinator_id: str = ""
    join_token: str = ""
    run_started_at: float | None = None


@dataclass
class TrainerStats:
    """Counters for progress displays and summaries (bytes, samples, seconds)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    state_bytes_downloaded: int = 0
    rounds_committed: int = 0
    rounds_failed: int = 0
    state_downloads: int = 0
    samples_total: int = 0  # samples of ours in committed outer steps
    samples_computed: int = 0  # samples of all our inner steps
    samples_discarded: int = 0  # computed samples that will never reach a committed outer step
    compute_s: float = 0.0  # seconds in inner steps (duty-cycle sleeps and pauses excluded)
    last_loss: float | None = None
    last_eval_loss: float | None = None
    throughput: float = 0.0
    peers_seen: int = 0
    last_round_s: float | None = None
    last_group_size: int = 0
    last_failure: str = ""
    state_hashes: dict[int, str] = field(default_factory=dict)
    param_sketches: dict[int, bytes] = field(default_factory=dict)  # epoch -> diloco.drift sketch of θ
    # seconds outside inner steps and the all-reduce, per part of the outer step, summed over the run (issue 24):
    # "pseudo_gradient", "outer_step", "state_hash", "evaluate", "load" (θ into the model for the next phase)
    outer_overhead_s: dict[str, float] = field(default_factory=dict)
    last_overhead_s: dict[str, float] = field(default_factory=dict)  # the newest of each part
    compile_s: float = 0.0  # torch.compile of the inner step, once (``InnerOptimizer.warm_up``)

    def timed(self, part: str, fn: Callable[..., T], *args) -> T:
        """``fn(*args)``, its seconds counted as ``part`` (``add_overhead``), also when it raises."""
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.add_overhead(part, time.perf_counter() - started)

    def add_overhead(self, part: str, seconds: float) -> None:
        self.outer_overhead_s[part] = self.outer_overhead_s.get(part, 0.0) + seconds
        self.last_overhead_s[part] = seconds

    def step_overhead(self, commit_s: dict[str, float], evaluated: bool) -> dict[str, float]:
        """An outer step's parts outside the all-reduce, seconds: the pseudo-gradient of our newest phase, the
        commit's parts (``commit_s``: outer step, state hash) and the evaluation after it (if ``evaluated``)."""
        parts = {"pseudo_gradient": self.last_overhead_s.get("pseudo_gradient", 0.0), **commit_s}
        if evaluated:
            parts["evaluate"] = self.last_overhead_s.get("evaluate", 0.0)
        return {part: round(seconds, 6) for part, seconds in parts.items()}
