"""Group formation: Moshpit grids (exact on full grids, contracting on partial ones), gossip pairs, butterfly
partition (equal and bandwidth-optimal, checked against hivemind's LP), and the drift metric."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hivemind.averaging.load_balancing import load_balance_peers

from hivetrain.averaging.groups import (
    butterfly_partition,
    gossip_pairs,
    grid_for,
    max_relative_deviation,
    moshpit_groups,
    slice_bandwidths,
)
from hivetrain.averaging.robust import weighted_mean


def _ids(n: int) -> list[str]:
    return [f"12D3KooPeer{i:03d}" for i in range(n)]


def _simulate(
    values: dict[str, torch.Tensor], weights: dict[str, float], grid: tuple[int, ...], rounds: range, seed: str
) -> list[float]:
    """Run Moshpit rounds in-process: each group replaces its members' tensors by their weighted mean (the real
    aggregator). Returns the drift after each round."""
    drift = []
    for r in rounds:
        groups, _ = moshpit_groups(list(values), grid, r, seed)
        assert sorted(p for g in groups for p in g) == sorted(values)  # disjoint and covering
        for group in groups:
            mean = weighted_mean([values[p] for p in group], [weights[p] for p in group])
            for p in group:
                values[p] = mean.clone()
        drift.append(max_relative_deviation(list(values.values())))
    return drift


@pytest.mark.parametrize("grid,cycle", [((2, 2, 2), 0), ((2, 2, 2), 1), ((3, 3, 3), 0), ((4, 2), 5)])
def test_moshpit_full_grid_reaches_global_mean_in_d_rounds(grid: tuple[int, ...], cycle: int) -> None:
    n, d = math.prod(grid), len(grid)
    gen = torch.Generator().manual_seed(n + cycle)
    values = {p: torch.randn(1000, generator=gen) for p in _ids(n)}
    weights = dict.fromkeys(values, 1.0)
    global_mean = weighted_mean(list(values.values()), list(weights.values()))
    drift = _simulate(values, weights, grid, range(cycle * d, cycle * d + d), seed="run-1")
    assert drift[-2] > 1e-2  # not done one round early: every dimension is needed
    for v in values.values():
        torch.testing.assert_close(v, global_mean, rtol=0, atol=1e-5)
    assert drift[-1] < 1e-5
    for r in range(cycle * d, cycle * d + d):
        groups, reason = moshpit_groups(_ids(n), grid, r, "run-1")
        assert {len(g) for g in groups} == {grid[r % d]} and "(full)" in reason


@pytest.mark.parametrize("n,grid", [(5, (2, 2, 2)), (6, (2, 2, 2)), (7, (2, 2, 2)), (13, (4, 4)), (20, (3, 3, 3))])
def test_moshpit_partial_grid_keeps_the_mean_and_contracts(n: int, grid: tuple[int, ...]) -> None:
    """With missing peers, every peer still averages in a group of 2..max(grid) + 2, the global mean is preserved,
    and drift contracts geometrically across reshuffled cycles."""
    gen = torch.Generator().manual_seed(n)
    values = {p: torch.randn(1000, generator=gen, dtype=torch.float32) for p in _ids(n)}
    weights = dict.fromkeys(values, 1.0)
    global_mean = weighted_mean(list(values.values()), list(weights.values()))
    start = max_relative_deviation(list(values.values()))
    drift = _simulate(values, weights, grid, range(12), seed="run-1")
    assert drift[-1] < 1e-3 * start
    torch.testing.assert_close(weighted_mean(list(values.values()), [1.0] * n), global_mean, rtol=0, atol=1e-5)
    for r in range(12):
        groups, reason = moshpit_groups(_ids(n), grid, r, "run-1")
        assert all(2 <= len(g) <= grid[r % len(grid)] + 2 for g in groups) and "not full" in reason


def test_moshpit_groups_are_deterministic_and_order_independent() -> None:
    ids = _ids(16)
    a, reason = moshpit_groups(ids, (4, 4), 3, "seed")
    b, _ = moshpit_groups(list(reversed(ids)), (4, 4), 3, "seed")
    assert a == b and "dim 1 of grid 4x4 (cycle 1)" in reason
    assert a != moshpit_groups(ids, (4, 4), 3, "other-seed")[0]
    assert all(g == sorted(g) for g in a) and [g[0] for g in a] == sorted(g[0] for g in a)


def test_moshpit_edge_cases() -> None:
    assert moshpit_groups([], (2, 2), 0, 0) == ([], "no peers")
    assert moshpit_groups(["solo"], (2, 2), 0, 0)[0] == [["solo"]]
    groups, reason = moshpit_groups(_ids(20), (2, 2), 0, 0)  # overfull: 20 peers, 4 cells
    assert sorted(len(g) for g in groups) == [10, 10] and "overfull" in reason
    for bad_grid in [(), (1, 2), (2, 0), (2.0, 2)]:
        with pytest.raises(ValueError, match="grid"):
            moshpit_groups(_ids(4), bad_grid, 0, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="round_index"):
        moshpit_groups(_ids(4), (2, 2), -1, 0)
    with pytest.raises(ValueError, match="unique"):
        moshpit_groups(["a", "a"], (2, 2), 0, 0)


@pytest.mark.parametrize(
    "num_peers,max_group_size,expected",
    [(100, 16, (10, 10)), (64, 4, (4, 4, 4)), (5, 8, (5,)), (1, 8, (2,)), (1001, 10, (5, 6, 6, 6)), (17, 16, (4, 5))],
)
def test_grid_for(num_peers: int, max_group_size: int, expected: tuple[int, ...]) -> None:
    grid = grid_for(num_peers, max_group_size)
    assert grid == expected and math.prod(grid) >= num_peers and max(grid) <= max_group_size


def test_gossip_pairs() -> None:
    ids = _ids(9)
    alone = set()
    for r in range(20):
        groups, reason = gossip_pairs(ids, r, "seed")
        assert sorted(p for g in groups for p in g) == sorted(ids)
        assert sorted(len(g) for g in groups) == [1, 2, 2, 2, 2] and "4 pairs" in reason
        alone.add(next(g[0] for g in groups if len(g) == 1))
        assert groups == gossip_pairs(list(reversed(ids)), r, "seed")[0]
    assert len(alone) > 3  # the odd one out changes between rounds
    four = {tuple(map(tuple, gossip_pairs(ids[:4], r, "s")[0])) for r in range(10)}
    assert len(four) == 3  # all three pairings of 4 peers occur


@pytest.mark.parametrize("num_elements,num_peers", [(10, 3), (0, 2), (7, 7), (3, 5), (1_000_003, 8)])
def test_butterfly_partition_equal_split(num_elements: int, num_peers: int) -> None:
    bounds = butterfly_partition(num_elements, _ids(num_peers))
    sizes = [e - s for s, e in bounds]
    assert bounds[0][0] == 0 and bounds[-1][1] == num_elements
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def _comm_time(sizes: list[int], bandwidths: list[float], n: int) -> float:
    """hivemind's cost model: a peer reducing s of n elements in a group of g moves n + (g - 2) s elements."""
    g = len(bandwidths)
    return max((n + (g - 2) * s) / b for s, b in zip(sizes, bandwidths, strict=True) if b > 0)


@pytest.mark.filterwarnings("ignore:.*interior-point:DeprecationWarning")  # inside hivemind's reference solver
def test_butterfly_partition_is_as_good_as_hivemind_lp() -> None:
    rng = random.Random(0)
    for _ in range(25):
        g, n = rng.randint(3, 12), rng.randint(1000, 10**6)
        bandwidths = [rng.choice([0.0, rng.uniform(1, 100), rng.uniform(1, 1000)]) for _ in range(g)]
        bandwidths[rng.randrange(g)] = rng.uniform(1, 1000)
        sizes = [e - s for s, e in butterfly_partition(n, _ids(g), bandwidths)]
        reference = list(load_balance_peers(n, bandwidths))
        assert sum(sizes) == n and all(s == 0 for s, b in zip(sizes, bandwidths, strict=True) if b == 0)
        assert _comm_time(sizes, bandwidths, n) <= _comm_time(reference, bandwidths, n) * (1 + 1e-4)


def test_butterfly_partition_bandwidth_semantics() -> None:
    # equal bandwidths -> equal split; None -> the mean of the known; 0 -> nothing; 2 peers -> equal split
    assert butterfly_partition(12, _ids(3), [5.0, 5.0, 5.0]) == [(0, 4), (4, 8), (8, 12)]
    assert butterfly_partition(12, _ids(3), [5.0, None, 5.0]) == [(0, 4), (4, 8), (8, 12)]
    assert butterfly_partition(10, _ids(3), [0.0, 1.0, 1.0])[0] == (0, 0)
    assert butterfly_partition(10, _ids(2), [1.0, 9.0]) == [(0, 5), (5, 10)]
    assert butterfly_partition(10, _ids(2), [None, None]) == [(0, 5), (5, 10)]
    fast_slow = [e - s for s, e in butterfly_partition(10_000, _ids(4), [100.0, 100.0, 100.0, 50.0])]
    assert fast_slow[3] < min(fast_slow[:3]) and max(fast_slow[:3]) - min(fast_slow[:3]) <= 1
    for bad in ([1.0, -1.0], [1.0, float("nan")], [0.0, 0.0], [1.0]):
        with pytest.raises(ValueError):
            butterfly_partition(10, _ids(2), bad)
    with pytest.raises(ValueError):
        butterfly_partition(-1, _ids(2))
    with pytest.raises(ValueError):
        butterfly_partition(10, [])


def _upload_time(fractions, rates, ratio) -> float:
    """The slowest member's upload, in vectors over its rate: its parts of the others' slices plus its results."""
    g = len(rates)
    return max((1 - f + (g - 1) * f * ratio) / b for f, b in zip(fractions, rates, strict=True) if b > 0)


@pytest.mark.parametrize("ratio", [1.0, 4.0, 10.0])
@pytest.mark.parametrize("cap", [1.0, 0.5])
def test_the_cut_minimises_the_slowest_upload_for_any_result_size(ratio: float, cap: float) -> None:
    """Against a brute-force search over every cut of 3 members on a 1/100 grid, for parts and results of unequal
    sizes (topk's results weigh ``ratio`` parts) and with a share cap."""
    rng = random.Random(int(ratio * 10 + cap * 100))
    grid = [i / 100 for i in range(101)]
    for _ in range(8):
        rates = [rng.uniform(1, 100) for _ in range(3)]
        sizes = [e - s for s, e in butterfly_partition(10**6, _ids(3), rates, ratio, max_share=cap)]
        ours = _upload_time([s / 10**6 for s in sizes], rates, ratio)
        best = min(
            _upload_time((a, b, 1 - a - b), rates, ratio)
            for a in grid
            for b in grid
            if a + b <= 1 + 1e-9 and max(a, b, 1 - a - b) <= cap + 1e-9
        )
        assert ours <= best * (1 + 1e-3) and max(sizes) <= cap * 10**6 + 1


def test_a_slow_uplink_reduces_less_and_no_member_more_than_its_cap() -> None:
    rates = [100.0] * 7 + [10.0]  # one 10 Mbit/s member among 100 Mbit/s ones
    for ratio in (1.0, 10.0):
        sizes = [e - s for s, e in butterfly_partition(80_000, _ids(8), rates, ratio, max_share=0.25)]
        assert sizes[7] < 10_000 and sum(sizes) == 80_000 and max(sizes) <= 20_000
        equal = _upload_time([1 / 8] * 8, rates, ratio)
        assert _upload_time([s / 80_000 for s in sizes], rates, ratio) < 0.8 * equal
    # a liar claiming a fast link beside honest ones reduces at most its cap (here 2 equal shares of 4)
    sizes = [e - s for s, e in butterfly_partition(100_000, _ids(4), [10.0, 10.0, 10.0, 1e6], max_share=0.5)]
    assert sizes[3] == 50_000
    assert butterfly_partition(100_000, _ids(4), [10.0, 10.0, 10.0, 1e6])[3] == (0, 100_000)  # uncapped: everything


def test_claimed_rates_count_for_at_most_four_times_the_median() -> None:
    assert slice_bandwidths([None, None]) is None  # nobody knows: the equal cut
    assert slice_bandwidths([0.0, None]) is None
    assert slice_bandwidths([10.0, 20.0, None, 0.0]) == [10.0, 20.0, None, 0.0]
    assert slice_bandwidths([10.0, 10.0, 10.0, 1e6]) == [10.0, 10.0, 10.0, 40.0]


def test_max_relative_deviation() -> None:
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([3.0, 0.0])
    assert max_relative_deviation([a, b]) == pytest.approx(0.5)  # mean (2, 0); each peer is 1 away
    assert max_relative_deviation([[a, b], [a, b]]) == 0.0
    assert max_relative_deviation([[a, a], [b, b]]) == pytest.approx(0.5)  # norm over all of a peer's tensors
    assert max_relative_deviation([a]) == 0.0
    assert max_relative_deviation([torch.tensor([1.0]), torch.tensor([-1.0])]) == math.inf
    with pytest.raises(ValueError):
        max_relative_deviation([a, torch.zeros(3)])
    with pytest.raises(ValueError):
        max_relative_deviation([])
