"""The two-stage all-reduce (issue 23): rows and columns, one bit-identical mean for more peers than one group, and
all-or-nothing across the whole grid."""

from __future__ import annotations

import hashlib

import pytest
import torch

from hivetrain.averaging import AveragingConfig, RoundFailed, RoundResult
from hivetrain.averaging.groups import hierarchy
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
    for r in results:
        assert r.group == everyone and r.total_weight == pytest.approx(sum(weights))
        for got, want in zip(r.tensors, expected, strict=True):
            torch.testing.assert_close(got, want, atol=atol, rtol=0)


@pytest.mark.parametrize("stage", ["row", "column"])
def test_a_member_failing_in_one_stage_leaves_nothing_applied_anywhere(make_averagers, stage):
    """One member raises before voting in its row round, or in its column round (its second round): that row or
    column fails, every column (or every row's confirm) shows it, and no participant returns a result (the caller
    retries without it)."""
    breaker = FaultInjector()
    breaker.arm(Fault("averaging.before_commit", "raise", skip=0 if stage == "row" else 1))
    avgs = make_averagers(7, AveragingConfig(target_group_size=3, **SLOW_OK), faults=[None] * 6 + [breaker])
    results = _average_all(avgs, _inputs(7), [1.0] * 7)
    assert breaker.fired_count("averaging.before_commit") == 1
    assert all(isinstance(r, RoundFailed) for r in results), results


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
