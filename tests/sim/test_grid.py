"""The simulator's tolerant two-stage round (``sim.grid``): a leaver costs its own contribution, a failed column its
members one fetch, and only a lost row or every column failing costs the attempt."""

from __future__ import annotations

import math

import numpy as np

from hivetrain.sim.grid import grid_round
from hivetrain.sim.network import StageCosts

INF = math.inf


def grid_3x3() -> StageCosts:
    """Rows [0 1 2] [3 4 5] [6 7 8]; column c holds (c, 3 + c, 6 + c). Rows take 10 s, columns 10 s, confirms 1 s."""
    rows = [np.array([0, 1, 2]), np.array([3, 4, 5]), np.array([6, 7, 8])]
    columns = [np.array([c, 3 + c, 6 + c]) for c in range(3)]
    zeros = np.zeros(9, np.int64)
    return StageCosts(rows, columns, np.full(3, 10.0), np.full(3, 10.0), np.full(3, 1.0), zeros, zeros)


def run(leaves: list[float]):
    return grid_round(grid_3x3(), np.array(leaves, float), 0.0, part_timeout_s=5.0, connect_grace_s=1.0,
                      quorate=lambda left, declared: left >= 2 and 2 * left > declared,
                      fetch_s=lambda source, fetchers: 4.0)  # fmt: skip


def test_nobody_leaves_every_member_commits_after_three_stages():
    out = run([INF] * 9)
    assert out.reason == "" and out.contributors.all() and out.columns_failed == 0
    assert np.all(out.commit_at_s == 21.0) and np.isnan(out.fail_at_s).all() and out.fetch_rows == ()


def test_a_leaver_in_the_row_stage_costs_its_contribution_and_its_column_mates_one_fetch():
    """Member 4 leaves at 3 s: row 1 drops it (noticed at 3 + 5 s, within the row's 10 s; one slice, 10/3 s, more),
    column 1 fails at once when it starts (the port refuses), and members 1 and 7 fetch the result from their
    row-mates 0 and 6."""
    out = run([INF] * 4 + [3.0] + [INF] * 4)
    assert out.reason == "" and out.columns_failed == 1
    assert list(np.flatnonzero(~out.contributors)) == [4]
    row_end = 10.0 + 10.0 / 3
    confirm_end = row_end + 10.0 + 1.0
    assert np.isnan(out.commit_at_s[4]) and np.isnan(out.fail_at_s[4])
    holders = [0, 2, 3, 5, 6, 8]
    assert np.allclose(out.commit_at_s[holders], confirm_end)
    assert np.allclose(out.commit_at_s[[1, 7]], confirm_end + 4.0)
    assert sorted(out.fetch_rows) == [(0, 0, (1,)), (2, 6, (7,))]


def test_a_leaver_in_the_column_stage_is_in_the_mean_and_its_column_mates_fetch():
    out = run([INF] * 4 + [15.0] + [INF] * 4)  # rows end at 10 s; column 1 runs 10-20 s
    assert out.contributors.all()  # its row committed with it
    assert out.columns_failed == 1 and np.isnan(out.commit_at_s[4])
    confirm_start = 15.0 + 5.0  # the column-mates learn it part_timeout_s after the silence
    assert np.allclose(out.commit_at_s[[0, 2, 3, 5, 6, 8]], confirm_start + 1.0)
    assert np.allclose(out.commit_at_s[[1, 7]], confirm_start + 1.0 + 4.0)


def test_a_row_that_loses_its_quorum_fails_the_attempt_everywhere():
    out = run([2.0, 3.0] + [INF] * 7)  # row 0 keeps 1 of 3
    assert out.reason.startswith("row 0")
    assert np.isnan(out.commit_at_s).all()
    assert np.allclose(out.fail_at_s[2:], 3.0 + 5.0) and np.isnan(out.fail_at_s[:2]).all()


def test_every_column_failing_fails_the_attempt_everywhere():
    out = run([INF, INF, 12.0, INF, 14.0, INF, 16.0, INF, INF])  # one member of each column leaves mid-column
    assert out.reason == "every column failed" and out.columns_failed == 0
    assert np.isnan(out.commit_at_s).all()


def test_a_source_that_leaves_mid_fetch_leaves_its_fetchers_with_nothing():
    """Member 4 leaves in the row stage (column 1 fails); row 0's source, member 0, leaves during the fetch: member 1
    applies nothing (it follows the committed state later), row 2's fetch goes through."""
    confirm_end = 10.0 + 10.0 / 3 + 10.0 + 1.0
    out = run([confirm_end + 2.0, INF, INF, INF, 3.0, INF, INF, INF, INF])
    assert out.commit_at_s[0] == confirm_end  # it committed before it left
    assert np.isnan(out.commit_at_s[1]) and out.fail_at_s[1] == confirm_end + 2.0 + 5.0
    assert out.commit_at_s[7] == confirm_end + 4.0


def test_a_row_that_cannot_confirm_keeps_its_holders_results():
    """Row 0 loses members 1 and 2 during the columns: its confirm has no quorum, so member 0 (column 0 committed)
    keeps its result part_timeout_s later; nobody of row 0 is left to fetch."""
    out = run([INF, 12.0, 13.0] + [INF] * 6)
    assert out.columns_failed == 2
    assert out.commit_at_s[0] == 20.0 + 1.0 + 5.0  # the columns' end, the confirm, its part timeout
    assert sorted(out.fetch_rows) == [(1, 3, (4, 5)), (2, 6, (7, 8))]
    assert np.isnan(out.commit_at_s[1:3]).all()
