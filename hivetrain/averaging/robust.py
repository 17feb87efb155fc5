"""Aggregation of one part from k contributions: a deterministic weighted mean and CenteredClip.

A reducer in butterfly all-reduce holds one slice of the flat pseudo-gradient from each of the k members of its group
(``parts``: k tensors of shape (n,), fp32) and each member's weight (samples). ``weighted_mean`` is the plain
average; ``centered_clip`` is the Byzantine-robust one (Karimireddy, He, Jaggi 2021, "Learning from History for
Byzantine Robust Optimization", Alg. 2; the aggregator of BTARD, Gorbunov et al. 2022, Sec. 3).

Robustness bound of ``centered_clip`` (derived here for this implementation; the test in
tests/averaging/test_robust.py checks it). Let H be the honest contributions with total weight W_h, B the others with
total weight W_b, W = W_h + W_b, m_h the honest weighted mean, e_t = v_t - m_h. If ``tau`` is at least the distance
of every honest x_i to every iterate v_t (no honest contribution is clipped), one iteration gives

    e_{t+1} = (W_b / W) e_t + (1 / W) sum_{j in B} w_j clip_tau(x_j - v_t),   so
    ||e_T|| <= (W_b / W)^T ||e_0|| + tau * W_b / W_h.

With one attacker of the same weight in a group of k: ||result - honest mean|| <= tau / (k - 1) + (1/k)^T ||e_0||,
whatever the attacker sends (sign-flipped, scaled by 1e6, ...). Contributions with NaN/Inf are dropped first, so
they do not count in B. The start v_0 is the coordinate-wise median, which with fewer than k/2 attackers lies inside
the honest per-coordinate range, so ||e_0|| <= ||max_h x_h - min_h x_h|| (coordinate-wise max and min). Choose
``tau`` a bit above the honest spread: ``median_distance_tau(parts, center)`` (factor x the median distance to the
median) is one robust choice; a fixed tau below the honest spread clips honest peers and slows convergence.

The reducers' robust aggregator, ``bucketing.robust_aggregate``, builds on these: collusion discount, bucketing,
rejection of far contributions, and ``centered_clip`` with that data-driven radius.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_NETWORK_MAX_K = 32  # up to this many contributions, a min/max sorting network beats torch.sort along dim 0
_CHUNK_NUM_ELEMENTS = 1 << 18  # columns per chunk of the median: k chunks of 1 MiB stay in cache


class NoValidContribution(ValueError):
    """Every contribution was dropped (non-finite values) or the remaining weights sum to zero."""


@dataclass(frozen=True)
class ClipResult:
    """The outcome of ``centered_clip``.

    Attributes:
        value: the robust aggregate, fp32, shape (n,).
        clipped: indices (into the caller's list) of contributions clipped in the last iteration (for logging and
            for a ban policy: an honest peer is clipped only if tau is below the honest spread).
        dropped: indices of contributions dropped because they held NaN or Inf.
        num_iters: iterations run (fewer than asked if ``tolerance`` stopped early).
        distances: ||x_i - v|| of each contribution to the last iteration's start point, by index (NaN if dropped).
    """

    value: torch.Tensor
    clipped: tuple[int, ...]
    dropped: tuple[int, ...]
    num_iters: int
    distances: tuple[float, ...]


def check_parts(parts: Sequence[torch.Tensor], weights: Sequence[float] | None = None) -> list[float]:
    """Validate k contributions (1-D fp32 CPU, one shape) and their weights; return the weights as floats.

    Raises:
        ValueError: no parts, a shape/dtype/device mismatch, a weight count mismatch, or a non-finite or negative
            weight. TypeError: a part is not a tensor.
    """
    if len(parts) == 0:
        raise ValueError("need at least one contribution")
    shape = parts[0].shape
    for i, p in enumerate(parts):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"contribution {i} is a {type(p).__name__}, not a tensor")
        if p.dtype != torch.float32 or p.dim() != 1 or p.shape != shape or p.device.type != "cpu":
            raise ValueError(f"contribution {i} is {tuple(p.shape)} {p.dtype}; all must be 1-D fp32 CPU {tuple(shape)}")
    if weights is None:
        return [1.0] * len(parts)
    if len(weights) != len(parts):
        raise ValueError(f"{len(weights)} weights for {len(parts)} contributions")
    out = [float(w) for w in weights]
    for i, w in enumerate(out):
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"weight {i} is {w}; weights must be finite and >= 0")
    return out


def weighted_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum_i (w_i / W) x_i with W = sum_i w_i, in list order, in fp32 (w_i / W is computed in float64).

    Every operation is elementwise (one multiply and one add per contribution), so the result is
    bit-identical for identical inputs on any IEEE-754 machine and any thread count. Pass contributions in an order
    every peer agrees on (e.g. sorted by peer id).

    Args:
        parts: k tensors, fp32, shape (n,) each. Values are not checked (see ``validation.validate_part``).
        weights: k weights (samples), finite and >= 0.

    Returns:
        A new fp32 tensor of shape (n,).

    Raises:
        ValueError: no parts, mismatched shapes/dtypes, non-finite or negative weights, or zero total weight.
    """
    w = check_parts(parts, weights)
    total = math.fsum(w)
    if not total > 0:
        raise ValueError("total weight is zero")
    acc = torch.mul(parts[0], w[0] / total)  # normalised weights: no overflow unless the mean itself overflows
    tmp = torch.empty_like(acc)
    for p, wi in zip(parts[1:], w[1:], strict=True):
        acc.add_(torch.mul(p, wi / total, out=tmp))
    return acc


def _network_median(cols: list[torch.Tensor]) -> torch.Tensor:
    """Median of k same-shape tensors by odd-even transposition sort of min/max (exact, no reduction)."""
    xs, k = [c.clone() for c in cols], len(cols)
    for r in range(k):
        for i in range(r % 2, k - 1, 2):
            lo = torch.minimum(xs[i], xs[i + 1])
            torch.maximum(xs[i], xs[i + 1], out=xs[i + 1])
            xs[i] = lo
    return xs[k // 2] if k % 2 else _midpoint(xs[k // 2 - 1], xs[k // 2])


def _midpoint(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / 2 + b / 2 (never overflows, unlike (a + b) / 2); overwrites ``a``."""
    return a.mul_(0.5).add_(b * 0.5)


def coordinate_median(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Coordinate-wise median of k finite tensors (mean of the two middle values for even k).

    Args:
        parts: k tensors, fp32, shape (n,) each, all finite.

    Returns:
        A new fp32 tensor of shape (n,); deterministic (only comparisons, two halvings and one add).
    """
    check_parts(parts)
    k, n = len(parts), parts[0].numel()
    out = torch.empty(n, dtype=torch.float32)
    for start in range(0, n, _CHUNK_NUM_ELEMENTS):
        cols = [p[start : start + _CHUNK_NUM_ELEMENTS] for p in parts]
        if k <= _NETWORK_MAX_K:
            out[start : start + _CHUNK_NUM_ELEMENTS] = _network_median(cols)
        else:
            s = torch.sort(torch.stack(cols), dim=0).values  # (k, chunk)
            out[start : start + _CHUNK_NUM_ELEMENTS] = s[k // 2] if k % 2 else _midpoint(s[k // 2 - 1], s[k // 2])
    return out


def is_finite(x: torch.Tensor) -> bool:
    """True if every element of ``x`` is finite (one min/max pass; NaN propagates into both)."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)  # NaN propagates into both
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def median_distance_tau(parts: Sequence[torch.Tensor], center: torch.Tensor, factor: float = 2.0) -> float:
    """A clipping radius: ``factor`` x the median over contributions of ||x_i - center|| (finite ones only).

    Fewer than half of the contributions cannot move the median distance beyond the honest distances, so attackers
    cannot inflate tau. Returns 0.0 if all finite contributions equal ``center``. Raises NoValidContribution if none
    is finite.
    """
    if not factor > 0:
        raise ValueError(f"factor must be > 0, got {factor}")
    dists = sorted(float(torch.linalg.vector_norm(p - center)) for p in parts if is_finite(p))
    if not dists:
        raise NoValidContribution("no finite contribution")
    mid = len(dists) // 2
    return factor * (dists[mid] if len(dists) % 2 else 0.5 * (dists[mid - 1] + dists[mid]))


def centered_clip(
    parts: Sequence[torch.Tensor],
    weights: Sequence[float],
    tau: float,
    num_iters: int,
    init: torch.Tensor | None = None,
    tolerance: float = 0.0,
) -> ClipResult:
    """CenteredClip (Karimireddy, He, Jaggi 2021, Alg. 2), weighted, with NaN/Inf contributions dropped first.

    v <- v + sum_i w_i * (x_i - v) * min(1, tau / ||x_i - v||) / sum_i w_i, ``num_iters`` times, starting from the
    coordinate-wise median of the kept contributions (or ``init``). See the module docstring for the error bound.

    Args:
        parts: k tensors, fp32, shape (n,) each, in an order every peer agrees on.
        weights: k weights (samples), finite and >= 0. Weights count in the bound: cap them before (validation).
        tau: clipping radius (L2 norm over the whole part, same units as the values), > 0.
        num_iters: iterations, >= 1 (each costs ~4 passes over every kept contribution).
        init: start point, fp32 shape (n,), finite; None = coordinate-wise median.
        tolerance: stop early once an iteration moves v by at most ``tolerance * tau`` (0 = run all iterations).

    Returns:
        ClipResult. Bit-identical for identical inputs on the same machine and torch thread count (the L2 norms are
        reductions whose summation order depends on the thread count).

    Raises:
        ValueError: bad shapes/dtypes/weights/tau/num_iters/init.
        NoValidContribution: every contribution is non-finite, or the finite ones have zero total weight.
    """
    w = check_parts(parts, weights)
    if not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"tau must be finite and > 0, got {tau}")
    if not isinstance(num_iters, int) or num_iters < 1:
        raise ValueError(f"num_iters must be an int >= 1, got {num_iters!r}")
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be finite and >= 0, got {tolerance}")
    dropped = tuple(i for i, p in enumerate(parts) if not is_finite(p))
    kept = [i for i in range(len(parts)) if i not in dropped]
    total = math.fsum(w[i] for i in kept)
    if not kept or not total > 0:
        raise NoValidContribution(f"{len(dropped)} of {len(parts)} contributions non-finite, kept weight {total}")
    if init is None:
        v = coordinate_median([parts[i] for i in kept])
    else:
        check_parts([parts[0], init])
        if not is_finite(init):
            raise ValueError("init must be finite")
        v = init.clone()
    diff, delta = torch.empty_like(v), torch.empty_like(v)
    dists = [math.nan] * len(parts)
    iters_run = 0
    for _ in range(num_iters):
        iters_run += 1
        delta.zero_()
        for i in kept:
            torch.sub(parts[i], v, out=diff)
            dists[i] = float(torch.linalg.vector_norm(diff))
            scale = 1.0 if dists[i] <= tau else tau / dists[i]  # an overflowing norm (inf) gives scale 0
            if scale > 0:  # skipping also avoids 0 * inf when x_i - v overflowed
                delta.add_(diff, alpha=w[i] * scale / total)
        v.add_(delta)
        if tolerance > 0 and float(torch.linalg.vector_norm(delta)) <= tolerance * tau:
            break
    clipped = tuple(i for i in kept if dists[i] > tau)
    return ClipResult(value=v, clipped=clipped, dropped=dropped, num_iters=iters_run, distances=tuple(dists))
