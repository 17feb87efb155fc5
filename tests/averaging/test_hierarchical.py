"""The two-stage all-reduce (issue 23): rows and columns, one bit-identical mean for more peers than one group, and
what one leaver costs."""

from __future__ import annotations

import hashlib

import pytest
import torch

from hivetrain.averaging import AveragingConfig, RoundFailed, RoundResult
from hivetrain.averaging.groups import hierarchy
from hivetrain.averaging.hierarchical import FAILED, read_confirm, settle
from hivetrain.averaging.reduce import RoundOutcome
from hivetrain.faults import Fault, FaultInjector

from .conftest import run_threads
from .test_engine import SLOW_OK, _inputs, _weighted_mean


def ids(n: int) -> list[str]:
    return [f"peer{i:02d}" for i in range(n)]


@pytest.mark.parametrize(
    ("n", "k", "sizes"), [(7, 3, [3, 2, 2]), (9, 3, [3, 3, 3]), (10, 4, [4, 3, 3]), (65, 64, [33, 32])]
)
def test_rows_are_near_equal_and_every_column_holds_one_member_of_every_row(n, k, sizes):
    rows, columns = hierarchy(ids(n), k, "seed")
    assert [len(r) for r in rows] == sizes and sorted(p for r in rows for p in r) == ids(n)
    assert all(r == sorted(r) for r in rows)
    assert len(columns) == max(sizes)
    for column in columns:
        assert [next(i for i, r in enumerate(rows) if p in r) for p in column] == list(range(len(rows)))
    for row in rows:  # every member stands for its row in one column, or two in a short row
        counts = [sum(column.count(p) for column in columns) for p in row]
        assert sum(counts) == len(columns) and set(counts) <= {1, 2}


def test_the_grid_depends_only_on_the_participants_and_the_seed():
    a = hierarchy(ids(9), 3, "round-1")
    assert hierarchy(list(reversed(ids(9))), 3, "round-1") == a
    assert hierarchy(ids(9), 3, "round-2") != a
    assert hierarchy(ids(3), 3, "x") == ([ids(3)], [])
    with pytest.raises(ValueError):
        hierarchy(ids(3), 1, "x")


def _average_all(avgs, inputs, weights, timeout_s=40.0):
    everyone = frozenset(a.node.peer_id for a in avgs)  # as a trainer passes the live peers it sees at the epoch
    calls = [
        lambda a=a, x=x, w=w: a.average(x, w, 0, timeout_s, expected_peers=everyone)
        for a, x, w in zip(avgs, inputs, weights, strict=True)
    ]
    return run_threads(calls, timeout_s=timeout_s + 15)


def _digest(result: RoundResult) -> str:
    return hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for t in result.tensors)).hexdigest()


@pytest.mark.parametrize(("num", "target", "compression"), [(7, 3, "none"), (7, 3, "int8"), (3, 2, "none")])
def test_more_peers_than_one_group_hold_one_bit_identical_mean(make_averagers, num, target, compression):
    """7 in rows of 3 (3, 2, 2) and 3 columns: before, the epoch ended with 3 states, one per group. 3 in rows of 2:
    a row of one, whose member stands for it in both columns."""
    config = AveragingConfig(target_group_size=target, compression=compression, **SLOW_OK)
    avgs = make_averagers(num, config)
    inputs, weights = _inputs(num), [float(2 * i + 1) for i in range(num)]
    results = _average_all(avgs, inputs, weights)
    assert all(isinstance(r, RoundResult) for r in results), results
    assert len({_digest(r) for r in results}) == 1
    assert len({r.round_id for r in results}) == 1
    everyone = tuple(sorted(a.node.peer_id for a in avgs))
    expected = _weighted_mean(inputs, weights)
    scale = max(float(t.abs().max()) for x in inputs for t in x)
    atol = 1e-5 if compression == "none" else 0.1 * scale
    own = dict(zip((a.node.peer_id for a in avgs), weights, strict=True))
    for r in results:
        assert r.group == everyone and r.total_weight == pytest.approx(sum(weights))
        assert 1 <= len(r.weights) <= target and all(own[p] == w for p, w in r.weights)  # its row's agreed weights
        for got, want in zip(r.tensors, expected, strict=True):
            torch.testing.assert_close(got, want, atol=atol, rtol=0)


@pytest.mark.parametrize("stage", ["row", "column"])
def test_with_drop_failed_off_a_member_failing_in_one_stage_leaves_nothing_applied_anywhere(make_averagers, stage):
    """``drop_failed = false``: one member raises before voting in its row round, or in its column round (its second
    round): that row or column fails, every column (or every row's confirm) shows it, and no participant returns a
    result (the caller retries without it)."""
    breaker = FaultInjector()
    breaker.arm(Fault("averaging.before_commit", "raise", when={"stage": stage}))
    config = AveragingConfig(target_group_size=3, drop_failed=False, **SLOW_OK)
    avgs = make_averagers(7, config, faults=[None] * 6 + [breaker])
    results = _average_all(avgs, _inputs(7), [1.0] * 7)
    assert breaker.fired_count("averaging.before_commit") == 1
    assert all(isinstance(r, RoundFailed) for r in results), results


def _grid_of_8_with_a_breaker(make_averagers, point: str, stage: str):
    """8 peers in 2 rows of 4 (4 columns of 2); the last raises at ``point`` in its ``stage`` round. Returns (results,
    inputs, weights) after checking that the fault fired once."""
    breaker = FaultInjector()
    breaker.arm(Fault(point, "raise", when={"stage": stage}))
    avgs = make_averagers(8, AveragingConfig(target_group_size=4, **SLOW_OK), faults=[None] * 7 + [breaker])
    inputs, weights = _inputs(8), [float(i + 1) for i in range(8)]
    results = _average_all(avgs, inputs, weights)
    assert breaker.fired_count(point) == 1
    return results, inputs, weights


def _hold_one_mean_of(results, inputs, weights) -> None:
    assert all(isinstance(r, RoundResult) for r in results), results
    assert len({_digest(r) for r in results}) == 1
    for r in results:
        assert r.total_weight == pytest.approx(sum(weights))
        for got, want in zip(r.tensors, _weighted_mean(inputs, weights), strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_member_lost_in_its_row_costs_its_own_contribution_only(make_averagers):
    """One member fails before sending in its row round: its row commits without it, its column fails (it refuses
    it), the column-mate in the other row fetches the result from a row-mate, and the 7 others commit one
    bit-identical mean of their own contributions in this attempt."""
    results, inputs, weights = _grid_of_8_with_a_breaker(make_averagers, "averaging.before_send", "row")
    assert isinstance(results[7], RoundFailed), results[7]
    _hold_one_mean_of(results[:7], inputs[:7], weights[:7])


def test_a_column_that_fails_is_made_good_by_row_mates(make_averagers):
    """One member fails before voting in its column round: that column (2 members) fails, both its members fetch the
    result from a row-mate whose column committed, and all 8 hold one bit-identical mean of all 8 contributions:
    nobody's samples are lost."""
    results, inputs, weights = _grid_of_8_with_a_breaker(make_averagers, "averaging.before_commit", "column")
    _hold_one_mean_of(results, inputs, weights)


D1, D2 = tuple(range(16)), tuple(range(1, 17))


@pytest.mark.parametrize(
    ("digests", "me", "action", "source", "fetchers"),
    [
        ({"a": D1, "b": D1, "c": D1}, "b", "commit", "a", ()),
        ({"a": None, "b": D1, "c": D1}, "a", "fetch", "b", ("a",)),
        ({"a": None, "b": D1, "c": D1}, "b", "commit", "b", ("a",)),
        ({"a": None, "c": D1}, "a", "fetch", "c", ("a",)),  # b dropped from the confirm (died)
        ({"a": None, "b": None, "c": None}, "a", "abort", None, ()),
        ({"a": D1, "b": D2, "c": None}, "a", "abort", None, ()),  # a column computed other bytes
    ],
)
def test_settle_tolerant(digests, me, action, source, fetchers):
    s = settle(digests, ["a", "b", "c"], me, strict=False)
    assert (s.action, s.source, s.fetchers) == (action, source, fetchers), s
    assert s.digest == (D1 if action != "abort" else None)


@pytest.mark.parametrize(
    ("digests", "action"),
    [({"a": D1, "b": D1, "c": D1}, "commit"), ({"a": None, "b": D1, "c": D1}, "abort"), ({"a": D1, "c": D1}, "abort")],
)
def test_settle_strict_needs_every_member_and_one_result(digests, action):
    assert settle(digests, ["a", "b", "c"], "c", strict=True).action == action


def test_read_confirm_scales_each_slice_by_its_own_count_of_parts():
    """3 confirm members, b dropped after its part of the first slice was reduced: that slice averaged 3 parts, the
    others 2. Every present member's words come back exactly; a failed column reads None; b is absent."""
    words = {"a": torch.arange(16.0) * 4000, "b": torch.arange(16.0) + 7, "c": torch.full((16,), FAILED)}
    flat = torch.zeros(48)
    flat[:16] = (words["a"] + words["b"][:16] * 0) / 3  # slice [0, 16): a, b (zeros there) and c (zeros)
    flat[16:32] = 0.0  # b's own words were not reduced: its slice went to c after it was dropped
    flat[32:] = words["c"] / 2
    outcome = RoundOutcome(flat, ("a", "c"), ("b",), 2.0, 0, 0, slice_members=((0, 16, ("a", "b", "c")),))
    got = read_confirm(outcome, ["a", "b", "c"])
    assert got == {"a": tuple(int(v) for v in words["a"]), "c": None}


def test_a_port_nobody_listens_on_refuses_and_a_listening_one_does_not():
    """How a member tells a dead peer (its process ended: the port refuses) from a live one, for a dialer it waits
    for and a leader whose declaration it waits for."""
    import socket

    from hivetrain.averaging.transport import refuses_connections

    listening = socket.create_server(("127.0.0.1", 0))
    port = listening.getsockname()[1]
    try:
        assert not refuses_connections("127.0.0.1", port, 1.0)
    finally:
        listening.close()
    assert refuses_connections("127.0.0.1", port, 1.0)
