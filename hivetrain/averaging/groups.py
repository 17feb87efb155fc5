"""Pure group-formation and partition decisions for averaging rounds.

- ``moshpit_groups``: Moshpit SGD (Ryabinin et al. 2021, "Moshpit SGD: Communication-Efficient Decentralized Training
  on Heterogeneous Unreliable Devices", Sec. 3.1, Alg. 1). Peers sit on a virtual d-dimensional grid; in round r each
  peer averages with the peers that share all its coordinates except coordinate r % d. On a full M_1 x ... x M_d grid,
  d rounds of exact averaging give every peer the global mean.
- ``gossip_pairs``: random disjoint pairs (randomized gossip, Boyd et al. 2006).
- ``hierarchy``: the rows and columns of the two-stage all-reduce of an epoch with more peers than one group.
- ``butterfly_partition``: which contiguous slice of the flat vector each member of a butterfly all-reduce reduces;
  with bandwidths, the closed-form optimum of the load-balancing LP of hivemind's ``load_balance_peers``.
- ``max_relative_deviation``: the drift metric max_p ||x_p - mean|| / ||mean|| reported after each outer step.

Every function is a pure function of its arguments: every peer that calls it with the same peer ids, round and seed
gets the same answer (placement uses blake2b of the ids, never Python's randomized ``hash``), and the input order of
``peer_ids`` does not matter for the group functions.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

Groups = list[list[str]]


def _check_peer_ids(peer_ids: Sequence[str]) -> list[str]:
    ids = list(peer_ids)
    if any(not isinstance(p, str) or not p for p in ids):
        raise ValueError("peer ids must be non-empty strings")
    if len(set(ids)) != len(ids):
        raise ValueError("peer ids must be unique")
    return ids


def _shuffled(peer_ids: Sequence[str], seed: int | str, salt: int) -> list[str]:
    """``peer_ids`` in a pseudo-random order that depends only on (ids, seed, salt)."""

    def key(peer_id: str) -> tuple[bytes, str]:
        digest = hashlib.blake2b(f"{seed}\x00{salt}\x00{peer_id}".encode(), digest_size=16).digest()
        return digest, peer_id

    return sorted(_check_peer_ids(peer_ids), key=key)


def grid_for(num_peers: int, max_group_size: int) -> tuple[int, ...]:
    """The smallest near-cubic Moshpit grid with groups of at most ``max_group_size`` that holds ``num_peers``.

    d = ceil(log(num_peers) / log(max_group_size)) dimensions of near-equal sizes (each <= max_group_size) whose
    product is >= num_peers; e.g. (100 peers, 16) -> (10, 10), (64, 4) -> (4, 4, 4), (5, 8) -> (5,).
    Raises ValueError for num_peers < 1 or max_group_size < 2.
    """
    if num_peers < 1 or max_group_size < 2:
        raise ValueError(f"need num_peers >= 1 and max_group_size >= 2, got {num_peers}, {max_group_size}")
    if num_peers <= max_group_size:
        return (max(num_peers, 2),)
    d = 1
    while max_group_size**d < num_peers:
        d += 1
    sizes = [math.ceil(num_peers ** (1 / d) - 1e-9)] * d
    for j in range(d):  # shrink dims one by one while the grid still holds everyone
        while sizes[j] > 2 and math.prod(sizes) // sizes[j] * (sizes[j] - 1) >= num_peers:
            sizes[j] -= 1
    return tuple(min(s, max_group_size) for s in sizes)


def moshpit_groups(
    peer_ids: Sequence[str], grid: tuple[int, ...], round_index: int, seed: int | str
) -> tuple[Groups, str]:
    """Moshpit SGD groups for one round (Ryabinin et al. 2021, Sec. 3.1 / Alg. 1).

    Peers are shuffled by blake2b(seed, cycle, id), cycle = round_index // d, and the k-th peer takes cell k of the
    grid in mixed radix (coordinate 0 fastest). Within a cycle the placement is fixed, so on a full grid the rounds
    of one cycle (round_index = c*d, ..., c*d + d - 1) reach the exact global mean; each new cycle reshuffles, so the
    holes of a non-full grid move and averaging keeps contracting. In round r, peers group by all coordinates except
    r % d.

    Non-full grid (fewer peers than cells): lines along the round's dimension can be partial, and a peer alone on
    its line would idle. Lone peers join the multi-peer groups instead, one per group in line order (mixing the
    sparse part of the grid into the dense part), and any left over group among themselves (up to grid[dim] each; a
    last single one joins the smallest group). So with >= 2 peers every peer is in a group of >= 2, groups hold at
    most grid[dim] + 2 peers, and the drift still contracts: simulated with 5..7 peers on 2x2x2 or 13 on 4x4, 12 rounds
    shrink it more than 1000-fold (tests/averaging/test_groups.py). More peers than cells: the extra peers wrap around
    (cell = k mod cells), so groups grow up to ceil(N / cells) * grid[dim]; pick a bigger grid (``grid_for``).

    Args:
        peer_ids: ids of the peers in the round (unique, any order).
        grid: sizes of the d grid dimensions, each >= 2 (e.g. (2, 2, 2); see ``grid_for``).
        round_index: which round, >= 0 (e.g. the outer step).
        seed: shared by every peer of the run (e.g. the run id).

    Returns:
        (groups, reason): groups are disjoint, cover every peer, members sorted and groups sorted by first member;
        reason describes the decision for logs and the dashboard.

    Raises:
        ValueError: duplicate/empty peer ids, a bad grid, or a negative round index.
    """
    if not grid or any(not isinstance(m, int) or m < 2 for m in grid):
        raise ValueError(f"grid must be a non-empty tuple of ints >= 2, got {grid!r}")
    if not isinstance(round_index, int) or round_index < 0:
        raise ValueError(f"round_index must be an int >= 0, got {round_index!r}")
    d, num_cells = len(grid), math.prod(grid)
    dim, cycle = round_index % d, round_index // d
    order = _shuffled(peer_ids, seed, cycle)
    if not order:
        return [], "no peers"
    strides = [math.prod(grid[:j]) for j in range(d)]
    lines: dict[tuple[int, ...], list[str]] = {}
    for k, peer in enumerate(order):
        cell = k % num_cells
        coords = tuple((cell // strides[j]) % grid[j] for j in range(d) if j != dim)
        lines.setdefault(coords, []).append(peer)
    groups = [line for _, line in sorted(lines.items()) if len(line) > 1]
    lone = [line[0] for _, line in sorted(lines.items()) if len(line) == 1]
    num_joining = min(len(lone), len(groups))  # one lone peer per full group (size <= grid[dim] + 1)...
    for i, peer in enumerate(lone[:num_joining]):
        groups[i].append(peer)
    rest = lone[num_joining:]  # ...then the rest group among themselves
    regrouped = [rest[i : i + grid[dim]] for i in range(0, len(rest), grid[dim])]
    if regrouped and len(regrouped[-1]) == 1 and (len(regrouped) > 1 or groups):
        last = regrouped.pop()[0]
        min(groups + regrouped, key=len).append(last)  # the smallest group, the first one on ties
    groups = sorted((sorted(g) for g in groups + regrouped), key=lambda g: g[0])
    sizes = sorted({len(g) for g in groups})
    fill = "full" if len(order) == num_cells else ("overfull" if len(order) > num_cells else "not full")
    reason = (
        f"round {round_index}: dim {dim} of grid {'x'.join(map(str, grid))} (cycle {cycle}), {len(order)} peers in "
        f"{num_cells} cells ({fill}), {len(groups)} groups of sizes {sizes}"
        + (f", {len(lone)} lone peers regrouped" if lone else "")
    )
    return groups, reason


def hierarchy(peer_ids: Sequence[str], max_group_size: int, seed: int | str) -> tuple[Groups, Groups]:
    """Rows and columns of the two-stage (2-D) all-reduce that gives every peer of an epoch one mean however many
    groups it takes (issue 23; the row/column all-reduce of datacenter collectives, e.g. the 2-D torus all-reduce).

    Peers are shuffled by blake2b(seed, id) and cut into R = ceil(N / ``max_group_size``) rows of near-equal sizes
    (sizes differ by at most 1, each <= ``max_group_size``). Column c holds, for every row in row order, the row's
    member c mod len(row): every column has exactly R members, one per row, so every column averages the same R row
    means in the same order with the same slice cut and computes the same bytes; a member of a row shorter than the
    widest stands for it in two columns (c and c + len(row)).

    Args:
        peer_ids: the epoch's agreed participants (unique, any order).
        max_group_size: the most members of one row (``averaging.target_group_size``), >= 2.
        seed: shared by every participant (the declaration's round id).

    Returns:
        (rows, columns): rows with members sorted, in row order; columns with members in row order (the order their
        all-reduce sums in, so it must not be re-sorted). One row and no columns when N <= ``max_group_size``.

    Raises:
        ValueError: duplicate/empty peer ids, or max_group_size < 2.
    """
    if not isinstance(max_group_size, int) or max_group_size < 2:
        raise ValueError(f"max_group_size must be an int >= 2, got {max_group_size!r}")
    order = _shuffled(peer_ids, seed, 0)
    if len(order) <= max_group_size:
        return [sorted(order)], []
    num_rows = math.ceil(len(order) / max_group_size)
    base, extra = divmod(len(order), num_rows)
    rows, start = [], 0
    for r in range(num_rows):
        size = base + (1 if r < extra else 0)
        rows.append(sorted(order[start : start + size]))
        start += size
    width = max(len(row) for row in rows)
    columns = [[row[c % len(row)] for row in rows] for c in range(width)]
    return rows, columns


def gossip_pairs(peer_ids: Sequence[str], round_index: int, seed: int | str) -> tuple[Groups, str]:
    """Random disjoint pairs for one gossip round; with an odd count, one peer (a different one each round) is alone.

    Returns:
        (groups, reason): pairs (members sorted) and possibly one single-peer group, sorted by first member.

    Raises:
        ValueError: duplicate/empty peer ids or a negative round index.
    """
    if not isinstance(round_index, int) or round_index < 0:
        raise ValueError(f"round_index must be an int >= 0, got {round_index!r}")
    order = _shuffled(peer_ids, seed, round_index)
    groups = sorted((sorted(order[i : i + 2]) for i in range(0, len(order), 2)), key=lambda g: g[0])
    alone = f", {order[-1]} alone" if len(order) % 2 else ""
    return groups, f"round {round_index}: {len(order) // 2} pairs{alone}"


def _optimal_fractions(bandwidths: list[float], result_ratio: float = 1.0) -> list[float]:
    """Closed-form optimum of hivemind's load-balancing LP (``averaging/load_balancing.py: optimize_parts_lp``),
    generalised to results that travel in another encoding than the parts.

    Peer i (upload bandwidth b_i > 0) reducing a fraction f_i of a vector of N elements in a group of g uploads its
    parts of the others' slices, N (1 - f_i) part-sized elements, and its result to the g - 1 others, (g - 1) N f_i
    elements of ``result_ratio`` times the size: N (1 + c f_i) with c = (g - 1) * result_ratio - 1 (g - 2 when parts
    and results are alike). Minimise T = max_i (1 + c f_i) / b_i subject to sum f_i = 1, f_i >= 0 (b_i = 0: f_i = 0).
    At the optimum every active peer finishes at T, so f_i = (T b_i - 1) / c for the m fastest peers, with
    T = (c + m) / (b_1 + ... + b_m) and m the largest count for which T b_m >= 1 (water-filling). With c <= 0 (two
    peers with like encodings) the time does not depend on f: split equally over peers with b_i > 0.
    """
    g = len(bandwidths)
    active = [i for i, b in enumerate(bandwidths) if b > 0]
    c = (g - 1) * result_ratio - 1
    if c <= 1e-12:
        return [1.0 / len(active) if b > 0 else 0.0 for b in bandwidths]
    by_speed = sorted(active, key=lambda i: (-bandwidths[i], i))
    m, total = 0, 0.0
    for count, i in enumerate(by_speed, start=1):
        t = (c + count) / (total + bandwidths[i])
        if t * bandwidths[i] < 1:
            break
        m, total = count, total + bandwidths[i]
    t = (c + m) / total
    fractions = [0.0] * g
    for i in by_speed[:m]:
        fractions[i] = (t * bandwidths[i] - 1) / c
    return fractions


def _capped_fractions(bandwidths: list[float], result_ratio: float, max_share: float) -> list[float]:
    """``_optimal_fractions`` with every f_i <= ``max_share`` (at least 1 / the active peers): the same LP with upper
    bounds, whose optimum is f_i = clip((T b_i - 1) / c, 0, max_share) for the T at which they sum to 1, found by
    bisection (the sum grows with T)."""
    g = len(bandwidths)
    active = [i for i, b in enumerate(bandwidths) if b > 0]
    cap = max(max_share, 1.0 / len(active))
    c = (g - 1) * result_ratio - 1
    if c <= 1e-12:
        return [1.0 / len(active) if b > 0 else 0.0 for b in bandwidths]

    def shares(t: float) -> list[float]:
        return [min(max((t * b - 1) / c, 0.0), cap) if b > 0 else 0.0 for b in bandwidths]

    lo, hi = 0.0, (c + len(active)) / min(bandwidths[i] for i in active)  # at hi every active share is at its cap
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if sum(shares(mid)) < 1.0 else (lo, mid)
    fractions = shares(hi)
    total = math.fsum(fractions)
    return [f / total for f in fractions]


MAX_BANDWIDTH_RATIO = 4.0  # a claimed upload rate counts for at most this many times the group's median claim
MAX_SLICE_SHARES = 2.0  # the most equal shares of the vector one member reduces when slices follow upload rates
# a round must send this many socket buffers per link before its send time measures a member's upload rate
# (``GroupAverager._note_upload``): below that the sends return once the kernel holds the bytes
UPLOAD_SAMPLE_BUFFERS = 4


def slice_bandwidths(
    claims: Sequence[float | None], max_ratio: float = MAX_BANDWIDTH_RATIO
) -> list[float | None] | None:
    """The bandwidths a round's cut uses (``butterfly_partition``) from its members' claimed upload rates (any one
    unit; None = unknown), or None for an equal cut (nobody claimed a positive rate).

    A rate is a claim (``ReadyEntry.upload_mbps``, signed but not proven): each counts for at most ``max_ratio`` x the
    median of the positive claims, so a member that lies about its link gets a bounded share of the vector to reduce
    (a slice it could stall or, unprotected by robust aggregation, corrupt), about ``max_ratio`` equal shares at most.
    A claim of 0 is kept (a member that reduces nothing, e.g. behind NAT)."""
    known = sorted(c for c in claims if c is not None and c > 0 and math.isfinite(c))
    if not known:
        return None
    median = known[len(known) // 2] if len(known) % 2 else 0.5 * (known[len(known) // 2 - 1] + known[len(known) // 2])
    return [None if c is None else min(max(float(c), 0.0), max_ratio * median) for c in claims]


def butterfly_partition(
    num_elements: int,
    peer_ids: Sequence[str],
    weights_or_bandwidths: Sequence[float | None] | None = None,
    result_ratio: float = 1.0,
    max_share: float = 1.0,
) -> list[tuple[int, int]]:
    """Split [0, num_elements) into one contiguous slice per member, in the order of ``peer_ids``.

    Args:
        num_elements: length of the flat vector, elements (not bytes), >= 0.
        peer_ids: the group's members, in the order every member agrees on (e.g. sorted).
        weights_or_bandwidths: None = equal split (sizes differ by at most 1, the first slices get the extra
            element). Otherwise one value per member: a bandwidth (any consistent unit, e.g. Mbit/s), 0 = the
            member reduces nothing (e.g. a client behind NAT), None = unknown (the mean of the known positive ones).
            Slices then follow the optimum of hivemind's load-balancing LP (see ``_optimal_fractions``), rounded to
            integers by largest remainder (Hagenbach-Bischoff).
        result_ratio: bytes of a result element over a part element on the wire (1 for dense codecs; "topk"'s
            results keep every member's elements at 8 bits, so they weigh several times a part).
        max_share: the largest fraction of the vector one member reduces (with bandwidths; at least 1 / the members
            that reduce): a claimed rate is not proven, and the reducer of a slice decides what the others read.

    Returns:
        [(start, end)] per member: contiguous, in order, covering [0, num_elements); empty slices have start == end.

    Raises:
        ValueError: bad num_elements, duplicate/empty ids, a length mismatch, negative or non-finite bandwidths, or
            every bandwidth 0.
    """
    if not isinstance(num_elements, int) or num_elements < 0:
        raise ValueError(f"num_elements must be an int >= 0, got {num_elements!r}")
    ids = _check_peer_ids(peer_ids)
    if not ids:
        raise ValueError("need at least one peer")
    if weights_or_bandwidths is None:
        fractions = [1.0 / len(ids)] * len(ids)
    else:
        values = list(weights_or_bandwidths)
        if len(values) != len(ids):
            raise ValueError(f"{len(values)} bandwidths for {len(ids)} peers")
        known = [float(v) for v in values if v is not None]
        if any(not math.isfinite(v) or v < 0 for v in known):
            raise ValueError(f"bandwidths must be finite and >= 0, got {values}")
        positive = [v for v in known if v > 0]
        default = math.fsum(positive) / len(positive) if positive else 1.0
        resolved = [default if v is None else float(v) for v in values]
        if not any(v > 0 for v in resolved):
            raise ValueError("every bandwidth is 0: no member can reduce")
        if max_share < 1.0:
            fractions = _capped_fractions(resolved, result_ratio, max_share)
        else:
            fractions = _optimal_fractions(resolved, result_ratio)
    exact = [num_elements * f for f in fractions]
    sizes = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(ids)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in by_remainder[: num_elements - sum(sizes)]:
        sizes[i] += 1
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    assert start == num_elements, (start, num_elements)
    return bounds


def max_relative_deviation(tensors_per_peer: Sequence[torch.Tensor | Sequence[torch.Tensor]]) -> float:
    """max_p ||x_p - mean|| / ||mean||: how far the peers' models (or pseudo-gradients) have drifted apart.

    Args:
        tensors_per_peer: per peer, one tensor or a list of tensors (e.g. all parameters), same shapes on every peer;
            the norm is over all of a peer's tensors together. Computed in float64.

    Returns:
        0.0 for one peer or identical peers; ``inf`` if the mean is zero but the peers differ.

    Raises:
        ValueError: no peers, or peers with different numbers or shapes of tensors.
    """
    peers = [[t] if isinstance(t, torch.Tensor) else list(t) for t in tensors_per_peer]
    if not peers:
        raise ValueError("need at least one peer")
    for p in peers[1:]:
        if len(p) != len(peers[0]) or any(a.shape != b.shape for a, b in zip(p, peers[0], strict=True)):
            raise ValueError("every peer must hold tensors of the same shapes")
    sq_dev = [0.0] * len(peers)
    sq_mean = 0.0
    for j in range(len(peers[0])):
        mean = sum(p[j].detach().double() for p in peers) / len(peers)
        sq_mean += float(mean.square().sum())
        for i, p in enumerate(peers):
            sq_dev[i] += float((p[j].detach().double() - mean).square().sum())
    worst = math.sqrt(max(sq_dev))
    if worst == 0.0:
        return 0.0
    return worst / math.sqrt(sq_mean) if sq_mean > 0 else math.inf
