"""Robust aggregation of one part: shift test, collusion discount, bucketing, rejection, CenteredClip.

``robust_aggregate`` is what a reducer runs for ``aggregation = "centered_clip"`` (``reduce.aggregate_into``). For k
contributions x_i (fp32 (n,), one slice of the flat pseudo-gradient, in peer-id order) with weights w_i (samples):

0. Sizes: peers run different numbers of inner steps (the "swarm" schedule gives fast peers more), so honest
   pseudo-gradients differ in size by design, and a peer that ran 16x the steps of another sits far from the
   median without being an outlier. Every step below compares u_i = x_i (w_mean / w_i)^p, where p, how size grows
   with weight, is estimated from the contributions (``estimate_size_exponent``: a repeated median, clamped to [0, 1];
   the tiny Llama's pseudo-gradient norm grew as steps^0.56 over 5-80 inner steps; weights that differ for other
   reasons, e.g. batch size, give p near 0) or fixed by ``size_exponent``, with weights
   a_i = w_i (w_i / w_mean)^p; the weighted mean of the u_i with weights a_i, times sum a / sum w over the kept
   contributions, is exactly the weighted mean of the x_i, so with no outlier the result is unchanged.
1. Drop contributions holding NaN or Inf (they count as absent, not as attackers).
1b. Shift test (the paired sign test, Dixon and Mood 1946, "The statistical sign test", applied coordinate by
   coordinate): for each pair (i, j), s_ij = |mean over coordinates of sign(x_i - x_j)|. Two honest peers' difference
   is their independent data noise, symmetric about 0 in each coordinate, so s_ij is about 1/sqrt(n); measured on
   real pseudo-gradients, 0.07 at most, also with a 16x spread of inner steps. A contribution shifted by a little
   in every coordinate in one direction, the signature of "A little is enough" (Baruch et al. 2019: mu - z sigma)
   with or without noise added, is on one side of most honest peers in most coordinates (s = 0.25-0.75 measured). A
   contribution whose median s_ij over the others exceeds ``shift_threshold`` (at least 6 / sqrt(n), the
   chance level of small parts) gets weight 0. Identical attackers score 0 with each other, so the median over the
   others stays an honest pair's value for fewer than half attackers; if half or more of the contributions fail, the
   test is not applied (its premise, an honest majority, does not hold for this part). Distance cannot find such an
   attacker: at z = 1 it sits exactly at the honest peers' RMS distance from their mean.
2. Collusion discount (the observation of FoolsGold, Fung, Yoon, Beschastnikh 2020, "The Limitations of Federated
   Learning in Sybil Settings", Sec. 4: colluding identities that pursue one goal send similar updates, while honest
   peers with their own data do not). Contributions closer to each other than ``duplicate_ratio`` x the median
   pairwise distance are one group (connected components); each member's weight is divided by the group's size, so a
   group weighs as much as one of its members (proportions inside the group are kept). ALIE and IPM attackers all
   send the same vector, so f of them count once. Honest peers are never that close (their distance is their
   independent data noise), so with no attacker nothing changes.
3. Bucketing (Karimireddy, He, Jaggi 2022, "Byzantine-robust learning on heterogeneous datasets via bucketing",
   Alg. 1): a random permutation, buckets of ``bucket_size`` consecutive contributions, the weighted mean of each
   bucket (bucket weight = its members' weight). It shrinks the honest spread by ~sqrt(s) but lowers the breakdown
   point: f attackers may reach f of the ceil(k / s) buckets, so keep s * f < k / 2. Off by default (s = 1): with
   k = 8, s = 2 broke down at f = 2 and gave no gain at f = 1 (scripts/bench/robust_aggregation.py, dev/LOG.md).
4. Radius and rejection: c = the coordinate-wise median of the bucket means, tau = ``tau_factor`` x the median of
   their distances to c (unless the caller fixes ``tau``). Fewer than half of the buckets bad cannot move c outside
   the honest per-coordinate range nor tau above the honest distances. Bucket means farther than
   ``reject_factor`` x tau from c get weight 0 (the reweighting step of robust statistics, e.g. Rousseeuw and van
   Driessen 1999, "A fast algorithm for the minimum covariance determinant estimator", Sec. 6): a far attacker
   (huge norm, large-epsilon IPM, sign flip when honest peers agree) then adds nothing, not tau * W_b / W_h.
5. CenteredClip (``robust.centered_clip``, Karimireddy, He, Jaggi 2021, Alg. 2) of the bucket means kept, from c,
   with radius tau: an attacker inside the radius moves the result by at most tau * W_b / W_h (module docstring of
   ``robust``). With ``tau_factor`` above the ratio of the farthest honest bucket to the median one, nothing honest is
   rejected or clipped and the result is exactly the weighted mean (one iteration from any start reaches it).

What it cannot do: an attacker that stays inside the honest spread, is not a near-copy of another and has no
one-sided shift (one IPM attacker with a small epsilon; any vector drawn like an honest peer's) is indistinguishable
from an honest peer by its value alone, and moves the result as much as it moves the mean (f * w / W times its
distance, at most tau).

Determinism: the permutation of step 3 is a pure function of ``seed`` (BLAKE2b of (seed, index), no RNG object), and
the caller derives the seed from what every member shares (``aggregation_seed``: the round's plan tag, which hashes
the round id and its members in order, and the slice's index). Every other step is a fixed sequence of torch ops,
so the same inputs and seed give a bit-identical result on the same machine and torch thread count (norms and the Gram
matrix are reductions whose order depends on the thread count). Only the part's reducer computes it and all members
decode the same bytes it sends, so members agree whatever the reducer's machine; another member re-running it (an
audit) gets the same buckets.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hivetrain.averaging.robust import (
    NoValidContribution,
    centered_clip,
    check_parts,
    coordinate_median,
    is_finite,
    weighted_mean,
)


@dataclass(frozen=True)
class AggregateResult:
    """The outcome of ``robust_aggregate``.

    Attributes:
        value: the robust aggregate, fp32, shape (n,).
        tau: the clipping radius used (L2 norm over the part, in the units of the values).
        dropped: indices (into the caller's list) of contributions dropped for NaN or Inf.
        colluding: groups of indices whose weights were divided by the group's size (step 2), each sorted.
        clipped: indices of contributions in a bucket clipped in the last CenteredClip iteration.
        rejected: indices of contributions in a bucket farther than ``reject_factor`` x tau from the median (weight 0).
        shifted: indices of contributions that failed the shift test (step 1b; weight 0).
        size_exponent: the p of step 0 used (given, or estimated).
        buckets: the buckets, as tuples of the caller's indices, in the permuted order.
    """

    value: torch.Tensor
    tau: float
    dropped: tuple[int, ...]
    colluding: tuple[tuple[int, ...], ...]
    clipped: tuple[int, ...]
    rejected: tuple[int, ...]
    buckets: tuple[tuple[int, ...], ...]
    shifted: tuple[int, ...] = ()
    size_exponent: float = 0.0


def aggregation_seed(tag: bytes, part_index: int) -> int:
    """A 64-bit seed for one slice of one round, from inputs every member of the round shares.

    Args:
        tag: the round's plan tag (bytes; ``reduce.Plan.tag``), or the caller's ``seed_tag``.
        part_index: the index of the slice (its first reducer's position in the round's order), >= 0.
    """
    if part_index < 0:
        raise ValueError(f"part_index must be >= 0, got {part_index}")
    return int.from_bytes(hashlib.blake2b(tag + part_index.to_bytes(8, "little"), digest_size=8).digest(), "little")


def bucket_permutation(num_items: int, seed: int) -> list[int]:
    """A pseudo-random permutation of range(num_items): indices sorted by BLAKE2b(seed, index).

    A pure function of its arguments on any machine and Python or torch version (unlike ``torch.randperm``).

    Raises:
        ValueError: num_items < 0 or seed outside [0, 2**64).
    """
    if num_items < 0:
        raise ValueError(f"num_items must be >= 0, got {num_items}")
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    key = seed.to_bytes(8, "little")
    return sorted(range(num_items), key=lambda i: hashlib.blake2b(i.to_bytes(8, "little"), key=key).digest())


def colluding_groups(parts: Sequence[torch.Tensor], center: torch.Tensor, ratio: float) -> list[list[int]]:
    """Groups (connected components, size >= 2) of contributions within ``ratio`` x the median pairwise distance.

    Args:
        parts: k finite tensors, fp32 (n,) each.
        center: fp32 (n,), subtracted before the Gram matrix (e.g. the coordinate median) so that a large common
            component does not cost the distances their precision.
        ratio: in [0, 1); 0 = no groups.

    Returns:
        Groups of indices into ``parts``, each sorted, ordered by their first index. Costs one (k, n) copy and one
        (k, n) x (n, k) product.
    """
    k = len(parts)
    if ratio <= 0 or k < 3:
        return []
    y_KN = torch.stack([p - center for p in parts])  # (k, n)
    gram_KK = (y_KN @ y_KN.T).double()  # (k, k)
    sq = gram_KK.diagonal()
    dist_KK = (sq[:, None] + sq[None, :] - 2 * gram_KK).clamp_min(0).sqrt()  # (k, k)
    iu = torch.triu_indices(k, k, offset=1)
    pair = dist_KK[iu[0], iu[1]]
    threshold = ratio * float(pair.median())  # the lower middle value for an even number of pairs
    root = list(range(k))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    for i, j, d in zip(iu[0].tolist(), iu[1].tolist(), pair.tolist(), strict=True):
        if d <= threshold:
            root[max(find(i), find(j))] = min(find(i), find(j))
    groups: dict[int, list[int]] = {}
    for i in range(k):
        groups.setdefault(find(i), []).append(i)
    return [g for _, g in sorted(groups.items()) if len(g) > 1]


MIN_WEIGHT_RATIO = 1.25  # pairs of contributions closer in weight than this say little about the size exponent


def estimate_size_exponent(norms: Sequence[float], weights: Sequence[float]) -> float:
    """How contribution size grows with weight, from the honest majority: the repeated-median slope (Siegel 1982,
    "Robust regression using repeated medians") of log norm against log weight, clamped to [0, 1].

    Args:
        norms: L2 norms of the contributions (>= 0).
        weights: their weights (samples, >= 0), same length.

    Returns:
        The median over contributions i of the median over j of log(n_i / n_j) / log(w_i / w_j), over pairs whose
        weights differ by ``MIN_WEIGHT_RATIO`` or more (norms and weights positive), clamped to [0, 1]; 0.0 when no
        pair qualifies (weights nearly equal: the scaling of step 0 would change little). Its breakdown point is
        50%: with fewer than half the contributions bad, every honest inner median and so the result lie within the
        honest slopes' range (3 of 8 liars moved Theil-Sen's single median of pairs off it); the clamp bounds it.
    """
    inner = []
    for i in range(len(norms)):
        slopes = []
        for j in range(len(norms)):
            if j == i or min(norms[i], norms[j], weights[i], weights[j]) <= 0:
                continue
            ratio = math.log(weights[i] / weights[j])
            if abs(ratio) >= math.log(MIN_WEIGHT_RATIO):
                slopes.append(math.log(norms[i] / norms[j]) / ratio)
        if slopes:
            inner.append(_median(slopes))
    return min(1.0, max(0.0, _median(inner))) if inner else 0.0


def shifted_contributions(parts: Sequence[torch.Tensor], threshold: float) -> list[int]:
    """Indices of contributions that fail the shift test of step 1b (module docstring).

    Args:
        parts: k finite tensors, fp32 (n,) each.
        threshold: in [0, 1]; 0 = no test. The test uses max(threshold, 6 / sqrt(n)).

    Returns:
        Sorted indices; empty if k < 3, if the test is off, or if half or more of the contributions would fail.
        Deterministic: the scores are exact integer sums of signs. Costs k (k - 1) / 2 passes over n elements.
    """
    k = len(parts)
    if threshold <= 0 or k < 3 or parts[0].numel() == 0:
        return []
    n = parts[0].numel()
    limit = max(threshold, 6.0 / math.sqrt(n)) * n
    sums = [[0] * k for _ in range(k)]
    for i in range(k):
        for j in range(i + 1, k):
            sums[i][j] = sums[j][i] = abs(int(torch.sign(parts[i] - parts[j]).sum(dtype=torch.int64)))
    failed = [i for i in range(k) if _median([sums[i][j] for j in range(k) if j != i]) > limit]
    return failed if 2 * len(failed) < k else []


def robust_options(config) -> dict:
    """The keyword arguments of ``robust_aggregate`` that an ``AveragingConfig`` sets (all but ``seed``)."""
    return dict(
        bucket_size=config.bucket_size,
        tau=config.clip_tau if config.clip_tau > 0 else None,
        tau_factor=config.clip_tau_factor,
        num_iters=config.clip_iters,
        duplicate_ratio=config.duplicate_ratio,
        shift_threshold=config.shift_threshold,
        size_exponent=None if config.size_exponent == "auto" else config.size_exponent,
    )


def _median(values: list[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])


def robust_aggregate(
    parts: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    seed: int,
    bucket_size: int = 1,
    tau: float | None = None,
    tau_factor: float = 1.75,
    num_iters: int = 5,
    duplicate_ratio: float = 0.1,
    reject_factor: float = 1.0,
    shift_threshold: float = 0.2,
    size_exponent: float | None = None,
) -> AggregateResult:
    """Steps 1-5 of the module docstring.

    Args:
        parts: k tensors, fp32, shape (n,) each, in an order every member agrees on (peer id).
        weights: k weights (samples), finite and >= 0.
        seed: in [0, 2**64), the bucket permutation's seed (``aggregation_seed``).
        bucket_size: contributions per bucket, >= 1 (1 = no bucketing).
        tau: fixed clipping radius (L2 norm per part, in units of a contribution of the mean weight; step 0), > 0;
            None = data-driven (step 4).
        tau_factor: > 0, the data-driven radius in median distances of the bucket means to their coordinate median.
            1.75 (default) rejected no honest peer in any case of scripts/bench/robust_aggregation.py and was never
            worse than the mean; 2.0 let sign flips through (0.29 at f = 2 on real pseudo-gradients); 1.5 rejected
            honest peers of uneven size under attack (0.25 against the mean's 0.19) (dev/LOG.md, 2026-11-25).
        num_iters: CenteredClip iterations, >= 1.
        duplicate_ratio: in [0, 1), the collusion threshold of step 2 as a fraction of the median pairwise distance
            (0 = off).
        reject_factor: 0 (no rejection: plain CenteredClip) or >= 1, the rejection radius of step 4 in units of tau.
            If every bucket mean lies beyond it (a fixed tau below the spread), none is rejected.
        shift_threshold: in [0, 1], the shift test of step 1b (0 = off). 0.2: honest real pseudo-gradients scored
            0.07 at most, ALIE 0.38-0.75 and ALIE with noise 0.25-0.35 (scripts/bench/robust_aggregation.py,
            dev/LOG.md).
        size_exponent: p in [0, 1] of step 0: contributions are compared as x_i (w_mean / w_i)^p (0 = as sent);
            None (default) = estimated (``estimate_size_exponent``). With 0, a 16x spread of inner steps got the
            largest honest contributions rejected (error 0.45 with no attacker, dev/LOG.md).

    Returns:
        AggregateResult; its ``value`` is a new fp32 (n,) tensor.

    Raises:
        ValueError: bad shapes/dtypes/weights or a parameter out of range (the message names it).
        NoValidContribution: every contribution is non-finite, or the finite ones weigh zero.
    """
    w = check_parts(parts, weights)
    _check_options(bucket_size, tau, tau_factor, duplicate_ratio, seed, shift_threshold, size_exponent, reject_factor)
    dropped = tuple(i for i, p in enumerate(parts) if not is_finite(p))
    kept = [i for i in range(len(parts)) if i not in dropped]
    if not kept or not math.fsum(w[i] for i in kept) > 0:
        raise NoValidContribution(f"{len(dropped)} of {len(parts)} contributions non-finite, the rest weigh 0")
    p, scale, us = _scaled(parts, w, kept, size_exponent)  # step 0
    shifted = tuple(kept[j] for j in shifted_contributions([us[i] for i in kept], shift_threshold))  # step 1b
    kept = [i for i in kept if i not in shifted]
    if not math.fsum(w[i] for i in kept) > 0:
        raise NoValidContribution(f"the {len(kept)} contribution(s) left after the shift test weigh 0")
    xs = [us[i] for i in kept]
    groups = [[kept[j] for j in g] for g in colluding_groups(xs, coordinate_median(xs), duplicate_ratio)]  # step 2
    for g in groups:
        for i in g:
            w[i] /= len(g)
    a = {i: w[i] / scale[i] for i in kept}  # the weights of the scaled contributions (step 0)
    buckets, means, bucket_weights = _bucket_means(kept, us, w, a, seed, bucket_size)  # step 3
    center, t, inside = _radius(means, tau, tau_factor, reject_factor)  # step 4
    rejected = tuple(sorted(i for j, b in enumerate(buckets) if j not in inside for i in b))
    value, clipped = _clipped_mean(means, bucket_weights, buckets, inside, center, t, num_iters, w, a)  # step 5
    return AggregateResult(
        value=value,
        tau=t,
        dropped=dropped,
        colluding=tuple(tuple(g) for g in groups),
        clipped=clipped,
        rejected=rejected,
        buckets=tuple(tuple(b) for b in buckets),
        shifted=shifted,
        size_exponent=p,
    )


def _check_options(bucket_size, tau, tau_factor, duplicate_ratio, seed, shift_threshold, size_exponent, reject_factor):
    """``robust_aggregate``'s parameters, each in its range. Raises ValueError naming the one that is not."""
    if not isinstance(bucket_size, int) or bucket_size < 1:
        raise ValueError(f"bucket_size must be an int >= 1, got {bucket_size!r}")
    if tau is not None and not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"tau must be finite and > 0 (or None for the data-driven radius), got {tau}")
    if not (math.isfinite(tau_factor) and tau_factor > 0):
        raise ValueError(f"tau_factor must be finite and > 0, got {tau_factor}")
    if not 0 <= duplicate_ratio < 1:
        raise ValueError(f"duplicate_ratio must be in [0, 1), got {duplicate_ratio}")
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    if not 0 <= shift_threshold <= 1:
        raise ValueError(f"shift_threshold must be in [0, 1], got {shift_threshold}")
    if size_exponent is not None and not 0 <= size_exponent <= 1:
        raise ValueError(f"size_exponent must be in [0, 1] or None (estimated), got {size_exponent}")
    if not (reject_factor == 0 or (math.isfinite(reject_factor) and reject_factor >= 1)):
        raise ValueError(f"reject_factor must be 0 (off) or finite and >= 1, got {reject_factor}")


def _scaled(parts, w: list[float], kept: list[int], size_exponent: float | None):
    """Step 0: (p, scale, u): each kept contribution compared as u_i = x_i (w_mean / w_i)^p, p given or estimated."""
    positive = [w[i] for i in kept if w[i] > 0]
    w_ref = math.fsum(positive) / len(positive)
    p = size_exponent
    if p is None:
        p = estimate_size_exponent([float(torch.linalg.vector_norm(parts[i])) for i in kept], [w[i] for i in kept])
    scale = {i: (w_ref / w[i]) ** p if w[i] > 0 else 1.0 for i in kept}
    return p, scale, {i: parts[i] if scale[i] == 1.0 else parts[i] * scale[i] for i in kept}


def _radius(means: list[torch.Tensor], tau: float | None, tau_factor: float, reject_factor: float):
    """Step 4: (center, t, inside): the coordinate median of the bucket means, the clipping radius (``tau``, or
    ``tau_factor`` median distances to the center) and the buckets within ``reject_factor`` radii of it (every
    bucket if none is)."""
    center = coordinate_median(means)
    dists = [float(torch.linalg.vector_norm(m - center)) for m in means]
    t = tau if tau is not None else tau_factor * _median(dists)
    inside = [j for j, d in enumerate(dists) if reject_factor == 0 or d <= reject_factor * t]
    return center, t, inside or list(range(len(means)))  # a fixed tau below every distance: clip only


def _clipped_mean(means, bucket_weights, buckets, inside: list[int], center, t: float, num_iters: int, w, a: dict):
    """Step 5: (value, clipped): CenteredClip of the inside buckets' means from ``center`` with radius ``t``, scaled
    back from the compared u's to sum w x / sum w of their members; the contributions of the buckets it clipped."""
    if t == 0:  # every bucket mean equals the median, so the mean is the median too
        value, clipped = center.clone(), ()
    else:
        res = centered_clip([means[j] for j in inside], [bucket_weights[j] for j in inside], t, num_iters, init=center)
        value, clipped = res.value, tuple(sorted(i for c in res.clipped for i in buckets[inside[c]]))
    members = [i for j in inside for i in buckets[j]]
    back = math.fsum(a[i] for i in members) / math.fsum(w[i] for i in members)  # sum w x / sum w, from the u's
    if back != 1.0:
        value.mul_(back)
    return value, clipped


def _bucket_means(kept: list[int], us: dict, w: list[float], a: dict, seed: int, bucket_size: int):
    """Step 3: the seeded buckets of the kept contributions (weightless ones dropped), their means and weights."""
    order = [kept[j] for j in bucket_permutation(len(kept), seed)]
    buckets = [order[b : b + bucket_size] for b in range(0, len(order), bucket_size)]
    buckets = [b for b in buckets if math.fsum(w[i] for i in b) > 0]  # weightless buckets have no mean
    means = [us[b[0]] if len(b) == 1 else weighted_mean([us[i] for i in b], [a[i] for i in b]) for b in buckets]
    return buckets, means, [math.fsum(a[i] for i in b) for b in buckets]
