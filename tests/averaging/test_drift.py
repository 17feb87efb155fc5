"""Moshpit drift stays bounded over many outer steps (issue 3, item 2), on eight real GroupAveragers (127.0.0.1).

A synthetic DiLoCo-like process: every outer step t each peer p adds a fresh pseudo-gradient n_p(t) = g(t) + σ ξ_p(t)
(g shared by all peers, ξ its own noise) to its vector and averages it with one Moshpit round (groups of 2 on the
2x2x2 grid, ``moshpit_rounds=1``, so a step does not reach the exact mean):

    x(t+1) = A_t (x(t) + n(t))          (rows = peers; A_t averages the pairs of round t)

Bound (Ryabinin et al. 2021, "Moshpit SGD", Sec. 3.1: on a full grid, d rounds reach the exact mean). Let J average
over all peers, e(t) = (I − J) x(t) the deviations, N_s = ||(I − J) n(s)||_F the new noise of step s. Each A_t is a
symmetric doubly stochastic projection, so A_t J = J A_t = J and ||A_t v|| <= ||v||. Round index t uses dimension t % 3
of a placement fixed for the cycle t // 3, so A_{3c+2} A_{3c+1} A_{3c} = J: a cycle wipes out every deviation that
existed when it began. Unrolling from the last cycle start,

    max_p ||x_p(t) − x̄(t)||  <=  ||e(t)||_F  <=  N_{t−4} + N_{t−3} + N_{t−2} + N_{t−1}   (terms with s < 0 dropped)

and right after a cycle ends (t = 3c + 3) only N_{t−2} + N_{t−1}. The bound looks back at most 4 steps however long
the run: the drift cannot grow (without averaging it would grow like √t · N). Divided by ||x̄(t)|| it bounds
``max_relative_deviation``. The test also checks that the drift is far from 0 (one round is not the exact mean) and
that every peer's result is its pair's exact mean, so the bound is tested against what the engine really did.
"""

from __future__ import annotations

import math

import pytest
import torch

from hivetrain.averaging import AveragingConfig, RoundResult
from hivetrain.averaging.groups import grid_for, max_relative_deviation, moshpit_groups

from .conftest import run_threads

NUM_PEERS = 8
NUM_STEPS = 6  # two full cycles of the 2x2x2 grid: t = 3 and t = 6 end a cycle
NUM_ELEMENTS = 1000
SIGMA = 1.0  # per-element std of a peer's own noise ξ
# eight in-process peers on a loaded 2-core machine can start a second apart, or announce after its partner's 3 s
# matchmaking window closed (once, with other work loading the machine): generous timeouts, since this test is about
# drift, not about stall detection (a pair that fills is declared at once, so a long window costs nothing when no one
# is late). Votes are awaited until the round deadline; only a vote leaving in its last commit_timeout_s aborts.
CONFIG = dict(matchmaking_time_s=8.0, part_timeout_s=10.0, commit_timeout_s=2.0, connect_timeout_s=2.0)
ROUND_TIMEOUT_S = 20.0


def _deviation_norm(rows: list[torch.Tensor]) -> float:
    """||(I − J) X||_F for X = the stacked rows (float64)."""
    stacked = torch.stack([r.double() for r in rows])
    return float((stacked - stacked.mean(dim=0)).norm())


@pytest.mark.slow
def test_moshpit_drift_stays_bounded_over_outer_steps(make_averagers, prefix: str) -> None:
    cfg = AveragingConfig(strategy="moshpit", target_group_size=2, moshpit_rounds=1, **CONFIG)
    avgs = make_averagers(NUM_PEERS, cfg)
    ids = [a.node.peer_id for a in avgs]
    grid = grid_for(NUM_PEERS, 2)
    assert grid == (2, 2, 2)
    g = torch.Generator().manual_seed(3)
    x = [torch.full((NUM_ELEMENTS,), 10.0) for _ in range(NUM_PEERS)]  # identical start, ||x̄|| ≈ 316
    noise_norms: list[float] = []  # N_s
    bounds: list[float] = []  # bound on ||e(t)||_F
    deviations: list[float] = []  # ||e(t)||_F
    mean_norms: list[float] = []  # ||x̄(t)||
    drifts: list[float] = []  # max_relative_deviation(x(t))
    for t in range(NUM_STEPS):
        shared = 0.5 * torch.randn(NUM_ELEMENTS, generator=g)
        noise = [shared + SIGMA * torch.randn(NUM_ELEMENTS, generator=g) for _ in range(NUM_PEERS)]
        noise_norms.append(_deviation_norm(noise))
        sent = [xp + n for xp, n in zip(x, noise, strict=True)]
        calls = [  # every peer expected, as a trainer passes the live peers it sees: the round closes when all are in
            lambda a=a, y=y, t=t: a.average([y], 1.0, t, ROUND_TIMEOUT_S, expected_peers=frozenset(ids))
            for a, y in zip(avgs, sent, strict=True)
        ]
        results = run_threads(calls, timeout_s=ROUND_TIMEOUT_S + 15)
        assert all(isinstance(r, RoundResult) for r in results), f"step {t}: {results}"
        assert all(r.group == tuple(sorted(ids)) for r in results), f"step {t}: not every peer took part (full grid)"

        groups, why = moshpit_groups(ids, grid, t, prefix)  # the averager seeds the placement with its prefix
        assert sorted(len(grp) for grp in groups) == [2, 2, 2, 2], why
        for grp in groups:
            members = [ids.index(p) for p in grp]
            pair_mean = sum(sent[i].double() for i in members) / len(members)
            for i in members:
                torch.testing.assert_close(results[i].tensors[0].double(), pair_mean, atol=1e-5, rtol=1e-6)

        x = [r.tensors[0].clone() for r in results]
        window = 2 if (t + 1) % 3 == 0 else 4  # right after a full cycle only its last two steps' noise remains
        bounds.append(sum(noise_norms[max(0, t + 1 - window) :]))
        deviations.append(_deviation_norm(x))
        mean_norms.append(float(torch.stack([v.double() for v in x]).mean(dim=0).norm()))
        drifts.append(max_relative_deviation(x))

    summary = ", ".join(
        f"t={t + 1}: ||e||={e:.2f} <= {b:.2f}, drift {d:.4f}"
        for t, (e, b, d) in enumerate(zip(deviations, bounds, drifts, strict=True))
    )
    for t in range(NUM_STEPS):
        assert deviations[t] <= bounds[t] * (1 + 1e-4), f"deviation grew past the Moshpit bound at t={t + 1}: {summary}"
        assert drifts[t] <= bounds[t] / mean_norms[t] * (1 + 1e-4), summary
        # one round of pairs is not the exact mean: fp32 rounding alone would leave ~1e-8
        assert drifts[t] > 1e-3, f"drift vanished at t={t + 1}: one moshpit round reached the mean? {summary}"
    # without averaging e would be a random walk, ||e(T)|| ≈ √T · N (≈ 2.4 N here); Moshpit leaves ≈ 0.76 N
    assert deviations[-1] < 0.5 * math.sqrt(NUM_STEPS) * sum(noise_norms) / NUM_STEPS, summary
