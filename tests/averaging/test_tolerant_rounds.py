"""Rounds that go on without members that fail (``averaging.drop_failed``): when their declaration stops being the
epoch's (``matchmaking.over_because`` with ``tolerant_rows``), and what a member dropped from one does next."""

from __future__ import annotations

from hivetrain.averaging.groups import hierarchy
from hivetrain.averaging.matchmaking import GroupDeclaration, over_because, rival_groups

from .test_matchmaking import TTL, declaration, entry, ids, run


def _again(decl: GroupDeclaration, peers: str, at: float = 110.0) -> dict[str, float]:
    """``newest`` for ``over_because``: ``peers`` announced again at ``at``, the other members did not."""
    return {m.peer_id: (at if m.peer_id in peers else m.announced_at) for m in decl.members}


def test_one_tolerant_group_is_over_only_once_those_that_announced_again_leave_no_strict_majority() -> None:
    """``drop_failed``: a member that was dropped and announced again leaves its group committing without it. The
    group's round is over only once the members that left are half of it or more (``agreement.quorate``); an
    all-or-nothing round (``tolerant_rows`` 0) is over at the first. The round timeout ends it either way."""
    decl = declaration([entry(p) for p in "ABCDE"], 105.0)
    assert over_because(decl, _again(decl, "E"), 111.0, TTL) == "E announced again after it"
    for left, over in (("E", False), ("DE", False), ("CDE", True), ("ABCDE", True)):
        why = over_because(decl, _again(decl, left), 111.0, TTL, tolerant_rows=8)
        assert bool(why) == over, (left, why)
    assert "no strict majority" in over_because(decl, _again(decl, "CDE"), 111.0, TTL, tolerant_rows=8)
    # min_group_size counts too: 3 left of 5 is a majority, but not the 4 a round needs
    assert over_because(decl, _again(decl, "DE"), 111.0, TTL, tolerant_rows=8, min_group_size=4)
    assert "ago" in over_because(decl, _again(decl, "E"), 105.0 + TTL + 1, TTL, tolerant_rows=8)
    pair = declaration([entry("A"), entry("B")], 105.0)  # a pair that lost one has no majority left
    assert over_because(pair, _again(pair, "B"), 111.0, TTL, tolerant_rows=8)


def test_a_tolerant_grid_is_over_once_a_row_lost_its_majority_or_every_column_a_member() -> None:
    """The two-stage grid (``hierarchical``, rows of at most ``tolerant_rows``): every column needs every row's
    mean, and a column is all-or-nothing. 9 members in rows of 3: 3 rows, 3 columns of 3."""
    decl = declaration([entry(p) for p in "ABCDEFGHI"], 105.0)
    rows, columns = hierarchy(decl.member_ids(), 3, decl.round_id)
    assert len(rows) == 3 and len(columns) == 3

    def over(left: list[str]) -> str:
        return over_because(decl, _again(decl, "".join(left)), 111.0, TTL, tolerant_rows=3)

    assert not over([rows[0][0]])
    assert not over(list(columns[0][:2]))  # two rows lose one each, one column fails: the other two commit
    assert "row" in over(list(rows[1][:2]))  # a row of 3 that lost 2: no column can finish
    diagonal = [rows[0][0], rows[1][1], rows[2][2]]  # each row keeps a majority, but every column lost a member
    assert all(set(diagonal) & set(c) for c in columns)
    assert "every one of its 3 columns" in over(diagonal)
    assert not over(diagonal[:2])


def test_a_member_dropped_from_a_round_that_may_commit_follows_it_and_latecomers_are_late() -> None:
    """Session 30's dp-1000-churn: a member dropped from the epoch's round announced again while the others were
    committing, which ended the declaration for everyone, and it and the latecomers declared a rival round of the
    same epoch. Now the dropped member is "not_in_group", naming the round whose result it follows
    (``RoundFailed.closed_without_us``), and a latecomer is "late"; once the round can no longer commit, both are
    free to form the epoch's next group."""
    first = {p: entry(p, 1) for p in "ABCDE"}
    decl = declaration(list(first.values()), 105.0)
    e2, f = entry("E", 2, at=110.0), entry("F", 1, at=110.5)
    entries = [*first.values(), e2, f]
    d = run(e2, entries, [decl], now=111.0, tolerant_rows=8)
    assert d.action == "not_in_group" and d.declaration == decl and "earlier session" in d.reason
    d = run(f, entries, [decl], now=111.0, tolerant_rows=8)
    assert d.action == "late" and d.declaration == decl
    # all-or-nothing rounds: E's return ended the round, as before
    assert run(e2, entries, [decl], now=111.0).action == "wait"
    assert run(f, entries, [decl], now=111.0).action == "wait"
    # C and D failed too: A and B are no majority of 5, the round cannot commit
    c2, d2 = entry("C", 2, at=110.2), entry("D", 2, at=110.3)
    entries += [c2, d2]
    assert run(f, entries, [decl], now=111.0, tolerant_rows=8).action == "wait"
    d = run(c2, entries, [decl], now=116.0, tolerant_rows=8)  # C's window (110.2 + 5) closed
    assert d.action == "declare" and ids(d) == ["C", "D", "E", "F"]


def test_a_member_back_first_from_a_round_that_failed_for_all_waits_for_the_others_still_expected() -> None:
    """A round of 3 that failed for every member (``averaging.before_commit`` on a loaded machine): the first back
    must not be told "not_in_group" while the others, still at this epoch (``expected``), may come back too; once
    they announce again the round is over and they re-form. A member that moved on (committed: no longer expected)
    or went stale holds nobody: then the round may have committed, and it follows its result."""
    first = {p: entry(p, 1) for p in "ABC"}
    decl = declaration(list(first.values()), 105.0)
    a2 = entry("A", 2, at=110.0)
    entries = [*first.values(), a2]
    d = run(a2, entries, [decl], now=110.5, tolerant_rows=3, expected=frozenset("BC"))
    assert d.action == "wait" and "may still come back" in d.reason, d
    d = run(a2, entries, [decl], now=110.5, tolerant_rows=3, expected=frozenset("C"), banned=frozenset("C"))
    assert d.action == "not_in_group" and d.declaration == decl, d  # B moved on, C is banned: nobody to wait for
    assert run(a2, entries, [decl], now=110.5, tolerant_rows=3).action == "not_in_group"
    b2 = entry("B", 2, at=110.4)  # B is back too: 1 of 3 left, no majority, the round is over
    d = run(a2, [*entries, b2], [decl], now=116.1, tolerant_rows=3, expected=frozenset("BC"))
    assert d.action == "declare" and ids(d) == ["A", "B"], d  # A's window and the grace for C ran out: A and B


def test_a_rival_that_may_still_commit_stays_a_rival() -> None:
    """``rival_groups`` with the same rules: a rival declaration of 5 that lost one member may still commit."""
    ours = declaration([entry("A"), entry("B")], 101.0)
    rival = declaration([entry(p) for p in "CDEFG"], 101.0)
    again = entry("G", 2, at=103.0)
    assert rival_groups(ours, [again], [ours, rival], 104.0, TTL) == ()
    assert rival_groups(ours, [again], [ours, rival], 104.0, TTL, tolerant_rows=8) == (frozenset("CDEFG"),)


# ---- expected peers: no idle window -----------------------------------------------------------------------------
