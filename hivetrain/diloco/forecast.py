"""What a volunteer will contribute, before it joins (``join-swarm --check``): its share of the swarm's samples and
its expected compute utilization at the run's H, group and its link. Pure: a function of measured figures and the
run config's numbers.

The model (each step the production rule it stands for):

- **Phase** (``diloco.schedule``): with ``schedule = "steps"``, H inner steps at our speed; with ``"swarm"``, the
  epoch's target (``target_samples_per_epoch``, or H x samples per step x the trainers with us) over the swarm's
  speed with us: every peer ends its phase at about the same time, a faster one with more samples.
- **Round** (``averaging``): every member sends and receives about 2(k-1)/k of the encoded pseudo-gradient in a
  butterfly group of k = min(trainers with us, ``target_group_size``); with more trainers than one group, the
  two-stage round adds 2(R-1)/R for its columns (R rows); Moshpit/gossip run ``moshpit_rounds`` rounds in groups of k.
  Its duration is that of our own link, the larger of bytes / upload rate and bytes / download rate (other members'
  links and latency are not known here: a lower bound).
- **Utilization** (compute utilization, as ``DilocoTrainer`` reports it): time in inner steps over wall time. Without
  overlap the round follows the phase: phase / (phase + round); with ``overlap`` it runs during the next phase:
  phase / max(phase, round).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Forecast:
    """A volunteer's predicted contribution (``forecast``).

    Attributes:
        phase_s: seconds of one inner phase.
        samples_per_phase: our samples per phase (the weight of our pseudo-gradient).
        group_size: k, members of our group (our row in the two-stage round).
        round_bytes: bytes we send (and about as many we receive) per outer step.
        round_s: seconds of one round on our link.
        utilization: predicted compute utilization, in (0, 1].
        share: our share of the swarm's samples, in (0, 1].
        reason: the figures in one line, for people.
    """

    phase_s: float
    samples_per_phase: float
    group_size: int
    round_bytes: int
    round_s: float
    utilization: float
    share: float
    reason: str


def forecast(
    *,
    samples_per_s: float,
    swarm_samples_per_s: float,
    num_trainers: int,
    schedule: str,
    inner_steps: int,
    samples_per_step: int,
    target_samples_per_epoch: int,
    strategy: str,
    target_group_size: int,
    moshpit_rounds: int,
    wire_bytes: int,
    upload_bytes_per_s: float,
    download_bytes_per_s: float,
    overlap: bool,
) -> Forecast:
    """Our predicted contribution (module docstring).

    Args:
        samples_per_s: our measured inner-step throughput, > 0.
        swarm_samples_per_s: the live trainers' throughput in all, without us, >= 0 (their records).
        num_trainers: live trainers without us, >= 0.
        schedule / inner_steps / target_samples_per_epoch: ``diloco``'s; samples_per_step: ``data.batch_size`` x
            ``diloco.grad_accum_steps``.
        strategy / target_group_size / moshpit_rounds: ``averaging``'s.
        wire_bytes: bytes of our encoded pseudo-gradient on the wire (``averaging.compression``).
        upload_bytes_per_s / download_bytes_per_s: our measured link rates, > 0.
        overlap: ``diloco.overlap`` is not "off".

    Raises:
        ValueError: a rate is not positive and finite, or a count is negative.
    """
    for name, value in (("samples_per_s", samples_per_s), ("upload_bytes_per_s", upload_bytes_per_s),
                        ("download_bytes_per_s", download_bytes_per_s)):  # fmt: skip
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be positive and finite, got {value!r}")
    if num_trainers < 0 or swarm_samples_per_s < 0 or inner_steps < 1 or samples_per_step < 1:
        raise ValueError("counts and rates must not be negative")
    n = num_trainers + 1
    if schedule == "swarm":
        target = target_samples_per_epoch or inner_steps * samples_per_step * n
        phase_s = target / (swarm_samples_per_s + samples_per_s)
    else:
        phase_s = inner_steps * samples_per_step / samples_per_s
    k = max(1, min(n, target_group_size))
    if n == 1:
        vectors = 0.0
    elif strategy == "butterfly":
        rows = math.ceil(n / target_group_size)
        vectors = 2 * (k - 1) / k + (2 * (rows - 1) / rows if rows > 1 else 0.0)
    else:
        vectors = moshpit_rounds * 2 * (k - 1) / k
    round_bytes = int(vectors * wire_bytes)
    round_s = max(round_bytes / upload_bytes_per_s, round_bytes / download_bytes_per_s)
    utilization = phase_s / max(phase_s, round_s) if overlap else phase_s / (phase_s + round_s)
    share = samples_per_s / (swarm_samples_per_s + samples_per_s)
    stages = ", two stages" if strategy == "butterfly" and n > k else ""
    reason = (
        f"phase {phase_s:.1f} s ({samples_per_s * phase_s:.0f} samples), round {round_s:.1f} s "
        f"({round_bytes / 1e6:.1f} MB each way in a group of {k}{stages}), utilization {utilization:.2f}"
        f"{' with overlap' if overlap else ''}, {100 * share:.0f}% of the swarm's samples"
    )
    return Forecast(phase_s, samples_per_s * phase_s, k, round_bytes, round_s, utilization, share, reason)
