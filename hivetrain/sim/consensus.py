"""Group averaging on stand-in vectors, and how many Moshpit or gossip rounds reach consensus.

``group_means`` is the arithmetic of one averaging round: every member of a group ends with its group's
weighted mean (``"mean"`` aggregation; all-or-nothing, so a failed group keeps its inputs). ``rounds_to_consensus``
runs rounds of the production group functions (``averaging.groups.moshpit_groups`` on ``grid_for(N, g)``, or
``gossip_pairs``) on random vectors until max_p ||x_p - mean|| / ||mean|| falls below ``fraction`` of its start:
Moshpit SGD (Ryabinin et al. 2021, Sec. 3.1) reaches the exact mean in d = ceil(log_g N) rounds on a full grid, and
contracts geometrically on a partial one; gossip pairs contract by ~1/2 in expectation per round (Boyd et al. 2006).
Under churn (``leave_prob`` > 0) each member of a group leaves during a round with that probability, and a group with
a leaver fails all-or-nothing (its members keep their values; the leaver comes back in the next round, so N stays).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hivetrain.averaging.groups import gossip_pairs, grid_for, moshpit_groups


def labels_for(groups: Sequence[Sequence[str]], index_of: dict[str, int], num_rows: int) -> np.ndarray:
    """(num_rows,) int64 group label per row; rows in no group get -1."""
    labels = np.full(num_rows, -1, np.int64)
    for k, group in enumerate(groups):
        labels[[index_of[p] for p in group]] = k
    return labels


def group_means(x: np.ndarray, weights: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Replace each labelled row of ``x`` by its group's weighted mean.

    Args:
        x: (P, D) float64 vectors. weights: (P,) >= 0 (samples). labels: (P,) group per row, -1 = untouched.

    Returns:
        (x', w'): the averaged vectors and, per row, its group's total weight (what a Moshpit member carries into
        the next round, ``averaging.engine``); untouched rows keep theirs.
    """
    out, w_out = x.copy(), weights.astype(np.float64).copy()
    rows = np.flatnonzero(labels >= 0)
    if len(rows) == 0:
        return out, w_out
    lab = labels[rows]
    num = int(lab.max()) + 1
    w = weights[rows].astype(np.float64)
    totals = np.bincount(lab, weights=w, minlength=num)
    sums = np.zeros((num, x.shape[1]))
    np.add.at(sums, lab, x[rows] * w[:, None])
    safe = np.where(totals > 0, totals, 1.0)
    means = sums / safe[:, None]
    # a group whose weights are all 0 averages unweighted (no sample to weigh by)
    zero = totals <= 0
    if zero.any():
        counts = np.bincount(lab, minlength=num).astype(np.float64)
        plain = np.zeros((num, x.shape[1]))
        np.add.at(plain, lab, x[rows])
        means[zero] = plain[zero] / np.maximum(counts[zero], 1.0)[:, None]
    out[rows] = means[lab]
    w_out[rows] = totals[lab]
    return out, w_out


def relative_deviation(x: np.ndarray) -> float:
    """max_p ||x_p - mean|| / ||mean|| (``averaging.groups.max_relative_deviation``, in numpy for speed)."""
    mean = x.mean(axis=0)
    worst = float(np.sqrt(((x - mean) ** 2).sum(axis=1).max()))
    norm = float(np.sqrt((mean**2).sum()))
    return 0.0 if worst == 0 else (worst / norm if norm > 0 else math.inf)


@dataclass(frozen=True)
class ConsensusRun:
    """Rounds until the drift fell below ``fraction`` of its start (``max_rounds + 1`` = never), next to the
    Moshpit bound d = ceil(log_g N)."""

    strategy: str
    num_peers: int
    group_size: int
    rounds: int
    bound_rounds: int
    start_deviation: float
    end_deviation: float
    leave_prob: float = 0.0


def rounds_to_consensus(
    strategy: str,
    num_peers: int,
    group_size: int,
    seed: int,
    fraction: float = 0.01,
    max_rounds: int = 60,
    leave_prob: float = 0.0,
) -> ConsensusRun:
    """Average random vectors (mean offset from 0) in rounds of the production groups until the drift is below
    ``fraction`` of its start. Equal weights.

    Args:
        leave_prob: probability that one member leaves during one round (0 = no failures); a group with a leaver
            keeps its inputs (all-or-nothing).

    Raises:
        ValueError: ``leave_prob`` outside [0, 1).
    """
    if not 0.0 <= leave_prob < 1.0:
        raise ValueError(f"leave_prob must be in [0, 1), got {leave_prob}")
    rng = np.random.default_rng(seed)
    churn_rng = np.random.default_rng(seed + 1)
    ids = [f"c{i:06d}" for i in range(num_peers)]
    index_of = {p: i for i, p in enumerate(ids)}
    x = rng.standard_normal((num_peers, 8)) + 3.0
    weights = np.ones(num_peers)
    start = relative_deviation(x)
    grid = grid_for(num_peers, group_size)
    dev, r = start, 0
    while r < max_rounds and dev > fraction * start:
        if strategy == "moshpit":
            groups, _ = moshpit_groups(ids, grid, r, seed)
        else:
            groups, _ = gossip_pairs(ids, r, seed)
        labels = labels_for(groups, index_of, num_peers)
        if leave_prob > 0 and (labels >= 0).any():
            left = churn_rng.random(num_peers) < leave_prob
            failed = np.unique(labels[left & (labels >= 0)])
            labels[np.isin(labels, failed)] = -1
        x, _ = group_means(x, weights, labels)
        dev = relative_deviation(x)
        r += 1
    rounds = r if dev <= fraction * start else max_rounds + 1
    bound = max(1, math.ceil(math.log(num_peers) / math.log(group_size))) if num_peers > 1 else 0
    return ConsensusRun(strategy, num_peers, group_size, rounds, bound, start, dev, leave_prob)
