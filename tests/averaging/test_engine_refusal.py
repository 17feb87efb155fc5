"""The bound on every outer step inside the round's two-phase commit (``Averager.average(accept=...)``, issue 22): a
member whose check refuses the full result votes against it, so every member fails and nobody commits, whatever the
others' own checks said (a joiner has no history of update norms), and nobody holds a ``voted`` result to apply."""

from __future__ import annotations

import pytest
import torch

from hivetrain.averaging import AveragingConfig, RoundFailed, RoundResult
from hivetrain.diloco.update_bound import l2_norm, update_bound

from .conftest import run_threads

CONFIG = AveragingConfig(target_group_size=3, matchmaking_time_s=3.0, part_timeout_s=5.0, commit_timeout_s=5.0,
                         connect_timeout_s=2.0)  # fmt: skip
HISTORY = (1.0, 1.1, 0.9, 1.05)  # norms of the run's recent committed averaged updates: median 1.025
SHAPES = [(300, 7), (50,)]


def _unit(seed: int) -> list[torch.Tensor]:
    """An honest pseudo-gradient: norm 1 over all its tensors."""
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(s, generator=g) for s in SHAPES]
    norm = l2_norm(x)
    return [t / norm for t in x]


class Check:
    """An ``accept`` callback with a fixed history (``RoundRunner._accept``); counts its calls and refusals."""

    def __init__(self, history: tuple[float, ...], max_ratio: float = 10.0):
        self.history, self.max_ratio = history, max_ratio
        self.calls, self.refusals, self.contributors = 0, [], []

    def __call__(self, flat: torch.Tensor, contributors: tuple[str, ...], epoch_groups=None) -> str:
        assert flat.dtype == torch.float32 and flat.dim() == 1
        self.epoch_groups = epoch_groups
        self.calls += 1
        self.contributors.append(contributors)
        ok, why = update_bound(l2_norm([flat]), self.history, self.max_ratio, min_history=3)
        if not ok:
            self.refusals.append(why)
        return "" if ok else why


def _average(avgs, inputs, checks, epoch: int = 0, timeout_s: float = 20.0) -> list:
    everyone = frozenset(a.node.peer_id for a in avgs)  # as a trainer passes the live peers it sees at the epoch
    calls = [
        lambda a=a, x=x, c=c: a.average(x, 1.0, epoch, timeout_s, accept=c, expected_peers=everyone)
        for a, x, c in zip(avgs, inputs, checks, strict=True)
    ]
    return run_threads(calls, timeout_s=timeout_s + 15)


def _assert_nobody_committed(results: list, inputs: list, kept: list) -> None:
    for r in results:
        assert isinstance(r, RoundFailed), r
        assert r.reason in ("refused", "aborted"), r
        assert r.voted is None, f"a refused round left a voted result: {r}"
    for x, k in zip(inputs, kept, strict=True):  # inputs untouched
        assert all(torch.equal(a, b) for a, b in zip(x, k, strict=True))


def test_an_update_50x_the_recent_median_is_refused_on_every_member_and_applied_nowhere(make_averagers) -> None:
    """Three members with the same history; one sends 148x an honest Δ, so the mean is ~50x the recent median: every
    member's check refuses it before voting, every member fails, nobody returns a result."""
    avgs = make_averagers(3, CONFIG)
    inputs = [_unit(0), _unit(1), [150.0 * t for t in _unit(2)]]
    kept = [[t.clone() for t in x] for x in inputs]
    checks = [Check(HISTORY) for _ in avgs]
    results = _average(avgs, inputs, checks)
    _assert_nobody_committed(results, inputs, kept)
    assert all(c.calls == 1 and len(c.refusals) == 1 for c in checks)
    assert all(c.contributors == [tuple(sorted(a.node.peer_id for a in avgs))] for c in checks)
    # each check also got the epoch's declarations, read from the DHT: ours (every member), no rival
    everyone = frozenset(a.node.peer_id for a in avgs)
    assert all(c.epoch_groups is not None and c.epoch_groups.ours == everyone for c in checks)
    assert all(c.epoch_groups.rivals == () for c in checks)
    assert all(r.reason == "refused" for r in results)  # each refused it itself
    ratio = float(checks[0].refusals[0].split(" is ")[1].split("x")[0])
    assert 40 < ratio < 60, checks[0].refusals[0]


def test_one_member_with_a_history_refuses_for_a_group_whose_others_have_none(make_averagers) -> None:
    """Only member 2 holds a history (0 and 1 just joined: their checks accept anything): its refusal still aborts
    the round on 0 and 1 ("aborted", votes differ), with nothing to apply. The next, honest round commits."""
    avgs = make_averagers(3, CONFIG)
    inputs = [_unit(0), _unit(1), [150.0 * t for t in _unit(2)]]
    kept = [[t.clone() for t in x] for x in inputs]
    checks = [Check(()), Check(()), Check(HISTORY)]
    results = _average(avgs, inputs, checks)
    _assert_nobody_committed(results, inputs, kept)
    assert [r.reason for r in results] == ["aborted", "aborted", "refused"], results
    assert "differ" in results[0].detail and "differ" in results[1].detail
    assert [len(c.refusals) for c in checks] == [0, 0, 1]

    honest = [_unit(3), _unit(4), _unit(5)]
    again = _average(avgs, honest, [Check(()), Check(()), Check(HISTORY)], epoch=1)
    assert all(isinstance(r, RoundResult) for r in again), again
    assert len({tuple(t.sum().item() for t in r.tensors) for r in again}) == 1


def test_a_round_of_one_is_checked_too(make_averagers) -> None:
    (avg,) = make_averagers(1, AveragingConfig(matchmaking_time_s=1.0))
    check = Check(HISTORY)
    with pytest.raises(RoundFailed) as failed:
        avg.average([50.0 * t for t in _unit(0)], 1.0, 0, 10.0, accept=check)
    assert failed.value.reason == "refused" and failed.value.voted is None and check.calls == 1
    result = avg.average(_unit(0), 1.0, 1, 10.0, accept=check)
    assert result.group == (avg.node.peer_id,) and check.calls == 2 and len(check.refusals) == 1
    assert check.contributors == [(avg.node.peer_id,)] * 2
