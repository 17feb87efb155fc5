"""The vectorised schedule model decides as ``diloco.schedule.decide_phase_end`` does, on random swarms."""

from __future__ import annotations

import numpy as np
import pytest

from hivetrain.diloco.schedule import PhasePlan, decide_phase_end
from hivetrain.sim.dht import RecordBoard
from hivetrain.sim.schedule_model import aggregate_phase_ends, real_phase_ends


def _random_board(rng: np.random.Generator, n: int, now: float) -> RecordBoard:
    board = RecordBoard(n)
    for s in range(n):
        if rng.random() < 0.1:
            continue  # never published
        epoch = int(rng.integers(3, 6))
        phase_epoch = epoch if rng.random() < 0.8 else epoch - 1
        done_epoch = int(rng.integers(2, 6)) if rng.random() < 0.4 else 0
        board.publish(
            s, f"p{s:04d}", "h",
            epoch=epoch, phase_epoch=phase_epoch, phase_samples=int(rng.integers(0, 400)),
            throughput=float(rng.choice([0.0, rng.uniform(0.5, 20)])), done_epoch=done_epoch,
            done_samples=int(rng.integers(0, 600)) if done_epoch else 0,
            updated_at=now - float(rng.uniform(0, 40)),
        )  # fmt: skip
    return board


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("target", [False, True])
def test_aggregate_model_matches_decide_phase_end(seed: int, target: bool) -> None:
    rng = np.random.default_rng(seed)
    now = 1000.0
    n = 120
    board = _random_board(rng, n, now)
    slots = rng.permutation(n)[:60]  # some deciders have records, some do not
    phase_epochs = rng.integers(3, 6, size=len(slots))
    my_samples = rng.integers(0, 600, size=len(slots))
    my_rates = np.where(rng.random(len(slots)) < 0.1, 0.0, rng.uniform(0.5, 20, size=len(slots)))
    cap = int(rng.choice([500, 1_000_000]))
    ext = float(rng.choice([5.0, 15.0]))
    # put the target in the middle of what the peers see, so that both decisions occur
    probe = PhasePlan("swarm", inner_steps=1, batch_size=8, max_samples_per_peer=cap, max_extrapolation_s=ext)
    seen = [
        decide_phase_end(probe, board.peer_ids[int(s)] or "x", int(e), int(m), float(r), board.records(), now)
        for s, e, m, r in zip(slots, phase_epochs, my_samples, my_rates, strict=True)
    ]
    mid_total = float(np.median([d.swarm_samples for d in seen]))
    mid_peers = float(np.median([d.num_peers for d in seen]))
    if target:
        plan = PhasePlan("swarm", 1, 8, int(mid_total), cap, max_extrapolation_s=ext)
    else:
        plan = PhasePlan("swarm", max(1, round(mid_total / (8 * mid_peers))), 8, 0, cap, max_extrapolation_s=ext)
    real = real_phase_ends(plan, board, slots, phase_epochs, my_samples, my_rates, now)
    model = aggregate_phase_ends(plan, board, slots, phase_epochs, my_samples, my_rates, now)
    assert 0 < real.sum() < len(real), "the case must contain both decisions to test anything"
    np.testing.assert_array_equal(model, real)


@pytest.mark.parametrize("seed", range(4))
def test_small_swarms_match_too_where_the_others_wait_for_us(seed: int) -> None:
    """Swarms of 2-6 peers, where "every other live peer ended its phase: they wait for us" and decisions before the
    first step (0 samples) are common; in the large random swarms above they almost never occur."""
    rng = np.random.default_rng(100 + seed)
    now, reasons = 1000.0, set()
    for _ in range(150):
        n = int(rng.integers(2, 7))
        board = RecordBoard(n)
        for s in range(1, n):  # slot 0 decides, without a record of its own
            done = rng.random() < 0.6
            board.publish(
                s, f"p{s}", "h", epoch=4, phase_epoch=4, phase_samples=int(rng.integers(0, 200)),
                throughput=float(rng.uniform(1, 20)), done_epoch=4 if done else 0,
                done_samples=int(rng.integers(1, 400)) if done else 0, updated_at=now - float(rng.uniform(0, 3)),
            )  # fmt: skip
        plan = PhasePlan("swarm", inner_steps=int(rng.integers(5, 40)), batch_size=8, max_extrapolation_s=5.0)
        slots, epochs = np.zeros(1, np.int64), np.full(1, 4)
        mine, rate = np.array([int(rng.choice([0, 8, 64, 200]))]), np.array([float(rng.uniform(1, 20))])
        real = real_phase_ends(plan, board, slots, epochs, mine, rate, now)
        model = aggregate_phase_ends(plan, board, slots, epochs, mine, rate, now)
        np.testing.assert_array_equal(model, real)
        records = board.records()
        reasons.add(decide_phase_end(plan, "me", 4, int(mine[0]), float(rate[0]), records, now).reason.split(" ")[0])
    assert {"every", "swarm"} <= reasons, reasons  # the wait-for-us rule and the target rules both decided cases


def test_steps_schedule_matches() -> None:
    board = RecordBoard(4)
    plan = PhasePlan("steps", inner_steps=10, batch_size=4)
    slots = np.arange(4)
    samples = np.array([0, 39, 40, 41])
    args = (plan, board, slots, np.zeros(4, np.int64), samples, np.ones(4), 0.0)
    np.testing.assert_array_equal(aggregate_phase_ends(*args), real_phase_ends(*args))
    assert list(real_phase_ends(*args)) == [False, False, True, True]
