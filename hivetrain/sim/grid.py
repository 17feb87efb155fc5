"""The simulator's model of one tolerant two-stage round (``averaging.hierarchical`` with ``drop_failed``): who
commits, whose pseudo-gradient is in the mean, and when. Pure: a function of the stages' costs and the members'
departure times.

The model follows the production stages:

1. **Rows** in parallel. A member that leaves before its row ends is dropped (its contribution lost) while its row
   keeps a quorum (``quorate(left, declared)``: the production ``agreement.quorate``); the row then ends
   ``part_timeout_s`` after the loss plus one slice of the round (1/k of it) more, as in ``sim.rounds``' model of
   one group. A row that loses its quorum fails, and with it every column: nobody commits.
2. **Columns** start when the last row ended (a column needs a member of every row). A column with a member gone
   before it ends fails: at once if the member was gone before it started (its data port refuses connections:
   ``connect_grace_s``), ``part_timeout_s`` after the departure otherwise. If every column fails, nobody commits.
3. **Confirm** per row once every column has ended or failed (members of a failed column come to it late); a member
   gone by its end is dropped, while the row keeps a quorum of its row-stage survivors; otherwise the confirm fails
   ``part_timeout_s`` later: members whose column committed keep its result, the others apply nothing.
4. **Fetch** in each row with survivors whose every column failed: the first row-mate holding the result sends it
   (``fetch_s(source, fetchers)`` seconds). They commit if the source stays until the fetch ends.

Members commit at the end of their row's confirm (holders) or of its fetch (fetchers); the mean is over the
members that were not dropped from their rows (a member that left after its row committed is in it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hivetrain.sim.network import StageCosts


@dataclass(frozen=True)
class GridOutcome:
    """What one tolerant two-stage round does (``grid_round``); arrays are (g,) over the declaration's members.

    Attributes:
        contributors: bool: the member's pseudo-gradient is in the mean.
        commit_at_s: when the member applies the result (NaN: it does not: gone, or failed).
        fail_at_s: when a member still present learns it applies nothing (NaN: it commits or is gone).
        fetch_rows: (row, source index, fetcher indices) of each fetch that ran, for its bytes.
        columns_failed: how many columns failed.
        reason: why nobody committed ("" if someone did).
    """

    contributors: np.ndarray
    commit_at_s: np.ndarray
    fail_at_s: np.ndarray
    fetch_rows: tuple[tuple[int, int, tuple[int, ...]], ...]
    columns_failed: int
    reason: str


def grid_round(
    stages: StageCosts,
    leaves_s: np.ndarray,
    start_s: float,
    *,
    part_timeout_s: float,
    connect_grace_s: float,
    quorate: Callable[[int, int], bool],
    fetch_s: Callable[[int, list[int]], float],
) -> GridOutcome:
    """One tolerant two-stage round (module docstring).

    Args:
        stages: the round's rows, columns and per-stage durations (``network.two_stage_stages``).
        leaves_s: (g,) when each member leaves the round (departure, or its call's deadline), seconds; <= ``start_s``
            for a member gone before the round.
        start_s: when the round starts, seconds.
        part_timeout_s / connect_grace_s: how long a silent member, or one whose port refuses, takes to notice.
        quorate: whether ``left`` of ``declared`` members of a row (or its confirm) go on without the others.
        fetch_s: seconds for a source (index) to send the result to fetchers (indices).
    """
    g = len(leaves_s)
    contributors = np.ones(g, bool)
    commit_at = np.full(g, np.nan)
    fail_at = np.full(g, np.nan)

    def fail_all(at: float, why: str) -> GridOutcome:
        present = leaves_s > at
        return GridOutcome(contributors, commit_at, np.where(present, at, np.nan), (), 0, why)

    # 1. rows
    row_end = np.zeros(len(stages.rows))
    for r, row in enumerate(stages.rows):
        end = start_s + float(stages.row_s[r])
        left = len(row)
        for m in row[np.argsort(leaves_s[row], kind="stable")]:
            if leaves_s[m] >= end:
                break
            if len(row) == 1 or not quorate(left - 1, len(row)):
                return fail_all(max(start_s, float(leaves_s[m])) + part_timeout_s, f"row {r} lost its quorum")
            contributors[m] = False
            left -= 1
            end = max(end, float(leaves_s[m]) + part_timeout_s) + float(stages.row_s[r]) / len(row)
        row_end[r] = end
    # 2. columns
    columns_start = float(row_end.max())
    column_end = columns_start + float(stages.column_s.max())
    failed_at = np.full(len(stages.columns), np.nan)
    for c, column in enumerate(stages.columns):
        gone = leaves_s[column]
        if (gone < columns_start + float(stages.column_s[c])).any():
            first = float(gone.min())
            failed_at[c] = columns_start + connect_grace_s if first <= columns_start else first + part_timeout_s
    ok = np.isnan(failed_at)
    if not ok.any():
        return fail_all(float(np.nanmax(failed_at)), "every column failed")
    holds = np.zeros(g, bool)
    for c in np.flatnonzero(ok):
        holds[stages.columns[c]] = True
    # 3. confirm, 4. fetch
    confirm_start = max(column_end, float(np.nanmax(failed_at, initial=column_end)))
    fetches = []
    for r, row in enumerate(stages.rows):
        members = row[contributors[row]]
        end = confirm_start + float(stages.confirm_s[r])
        here = members[leaves_s[members] > end]
        holders, fetchers = here[holds[here]], here[~holds[here]]
        if len(here) < len(members) and not quorate(len(here), len(members)):
            commit_at[holders] = end + part_timeout_s  # they keep their column's result, as a row of one does
            fail_at[fetchers] = end + part_timeout_s
            continue
        if len(holders) == 0:
            fail_at[here] = end
            continue
        commit_at[holders] = end
        if len(fetchers):
            source = int(holders[0])
            done = end + fetch_s(source, fetchers.tolist())
            fetches.append((r, source, tuple(int(m) for m in fetchers)))
            if leaves_s[source] > done:
                stay = fetchers[leaves_s[fetchers] > done]
                commit_at[stay] = done
            else:
                fail_at[fetchers] = float(leaves_s[source]) + part_timeout_s
            fail_at[fetchers[leaves_s[fetchers] <= done]] = np.nan  # gone: nothing to learn
    return GridOutcome(contributors, commit_at, fail_at, tuple(fetches), int((~ok).sum()), "")
