"""When simulated peers end their inner phase: the production ``decide_phase_end``, or a vectorised model of it.

``real_phase_ends`` calls ``diloco.schedule.decide_phase_end`` once per deciding peer with every stored record, as
each trainer does after each inner step. That is O(N) per call, so O(N^2) per tick for the swarm: fine for a few
hundred peers, hours for 10,000 (the trainer itself pays O(N) per inner step, which is no problem for one peer).

``aggregate_phase_ends`` evaluates the same rule for all deciding peers at once: per phase epoch, the sums over the
other peers' records are taken once, and each peer's own record is subtracted. The extrapolated progress of a
running record, ``min(samples + throughput * min(age + ahead, max_extrapolation_s), max_samples_per_peer)``, is
``c + throughput * clip(ahead, 0, k)`` in the look-ahead ``ahead``, so the sum over records is a piecewise-linear
function of ``ahead`` evaluated for every peer with one sort and ``searchsorted``. It is a model of the rule, not the
rule: ``check_against_real`` compares it with the real function on sampled peers, the simulation counts
divergences in its report, and ``tests/sim/test_schedule_model.py`` fails if the two disagree.
Sums are in a different order than the real function's, so a decision exactly at the target could flip in the last
floating-point bit; such a flip is counted as a divergence, not hidden.
"""

from __future__ import annotations

import numpy as np

from hivetrain.diloco.schedule import PhasePlan, decide_phase_end
from hivetrain.sim.dht import RecordBoard


def real_phase_ends(
    plan: PhasePlan,
    board: RecordBoard,
    slots: np.ndarray,
    phase_epochs: np.ndarray,
    my_samples: np.ndarray,
    my_rates: np.ndarray,
    now: float,
) -> np.ndarray:
    """The production decision for each deciding peer: True where it ends its phase now. Inputs are per deciding peer
    (slot, phase epoch, samples so far, samples/s); the records are the board's."""
    records = board.records()
    out = np.zeros(len(slots), bool)
    for i, slot in enumerate(slots):
        d = decide_phase_end(
            plan,
            board.peer_ids[int(slot)],
            int(phase_epochs[i]),
            int(my_samples[i]),
            float(my_rates[i]),
            records,
            now,
        )
        out[i] = d.action == "end"
    return out


def aggregate_phase_ends(
    plan: PhasePlan,
    board: RecordBoard,
    slots: np.ndarray,
    phase_epochs: np.ndarray,
    my_samples: np.ndarray,
    my_rates: np.ndarray,
    now: float,
) -> np.ndarray:
    """The same decisions as ``real_phase_ends`` (see the module docstring), vectorised. Returns a bool array."""
    slots = np.asarray(slots, np.int64)
    my_samples = np.asarray(my_samples, np.float64)
    my_rates = np.asarray(my_rates, np.float64)
    if plan.schedule == "steps":
        return my_samples >= plan.inner_steps * plan.batch_size
    out = np.zeros(len(slots), bool)
    c = board.cols
    live = board.published & (now - c["updated_at"] <= plan.stale_after_s)
    cap, ext = float(plan.max_samples_per_peer), float(plan.max_extrapolation_s)
    for epoch in np.unique(phase_epochs):
        sel = np.flatnonzero(phase_epochs == epoch)
        done = live & (c["done_epoch"] == epoch) & (c["done_samples"] > 0)
        running_now = live & (c["phase_epoch"] == epoch) & ~done
        starting = live & (c["epoch"] == epoch) & (c["phase_epoch"] < epoch) & ~done
        running = running_now | starting
        samples = np.where(starting, 0.0, c["phase_samples"])
        age = np.maximum(now - c["updated_at"], 0.0)
        thr = c["throughput"]
        # per record: extrapolated(ahead) = base + thr * clip(ahead, 0, knee)
        base = np.minimum(samples + thr * np.minimum(age, ext), cap)
        with np.errstate(divide="ignore", invalid="ignore"):
            to_cap = np.where(thr > 0, (cap - samples) / thr - age, 0.0)
        knee = np.maximum(0.0, np.minimum(ext - age, to_cap))
        knee = np.where(thr > 0, knee, 0.0)
        finished_each = np.minimum(c["done_samples"], cap)
        r_idx = np.flatnonzero(running)
        order = np.argsort(knee[r_idx], kind="stable")
        knee_sorted = knee[r_idx][order]
        thr_sorted = thr[r_idx][order]
        cum_tk = np.concatenate([[0.0], np.cumsum(thr_sorted * knee_sorted)])
        cum_t = np.concatenate([[0.0], np.cumsum(thr_sorted)])
        total_thr = cum_t[-1]
        base_sum = float(base[r_idx].sum())
        finished_sum = float(finished_each[done].sum())
        n_done, n_running = int(done.sum()), len(r_idx)

        me = slots[sel]
        # the round of ``epoch`` is over: at least 2 live peers committed it (coherently: at a later epoch, computing
        # for a later round or done with ours), more than still take part in it
        moved = live & (c["epoch"] > epoch) & ((c["phase_epoch"] > epoch) | (c["done_epoch"] >= epoch))
        still = (
            live
            & (c["epoch"] <= epoch)
            & ((c["epoch"] == epoch) | (c["phase_epoch"] == epoch) | (c["done_epoch"] == epoch))
        )
        n_moved = int(moved.sum()) - moved[me]
        over = (n_moved >= 2) & (n_moved > int(still.sum()) - still[me])
        own_done, own_running = done[me], running[me]
        mine = my_samples[sel]
        rate = my_rates[sel]
        num_peers = 1 + n_done + n_running - own_done - own_running
        finished = finished_sum - np.where(own_done, finished_each[me], 0.0)
        others_base = base_sum - np.where(own_running, base[me], 0.0)
        target = (
            np.full(len(sel), float(plan.target_samples_per_epoch))
            if plan.target_samples_per_epoch
            else float(plan.inner_steps * plan.batch_size) * num_peers
        )
        total0 = mine + finished + others_base
        with np.errstate(divide="ignore"):
            step_s = np.where(rate > 0, plan.batch_size / np.where(rate > 0, rate, 1.0), np.inf)
        ahead = 0.5 * step_s
        finite = np.isfinite(ahead)
        h = np.where(finite, ahead, 0.0)
        pos = np.searchsorted(knee_sorted, h, side="right")  # records whose knee <= h are capped at their knee
        growth = cum_tk[pos] + h * (total_thr - cum_t[pos])
        own_growth = np.where(own_running, thr[me] * np.clip(h, 0.0, knee[me]), 0.0)
        total_ahead = mine + finished + others_base + growth - own_growth
        # the real function's order: the round is over; our per-peer bound; alone before our first step: run it;
        # the target reached; every other peer done and waiting for us (their share done, or 2+ of them); the target
        # reached within half a step of ours
        others_done, others_running = n_done - own_done, n_running - own_running
        share = target * (num_peers - 1) / num_peers
        they_wait = (others_done > 0) & (others_running == 0) & ((finished >= share) | (others_done >= 2))
        first_step_alone = (mine < 1) & (num_peers == 1)
        reached = (total0 >= target) | they_wait | (finite & (total_ahead >= target))
        out[sel] = over | (mine >= cap) | (~first_step_alone & reached)
    return out


def check_against_real(
    plan: PhasePlan,
    board: RecordBoard,
    slots: np.ndarray,
    phase_epochs: np.ndarray,
    my_samples: np.ndarray,
    my_rates: np.ndarray,
    now: float,
    modelled: np.ndarray,
    picks: np.ndarray,
) -> int:
    """How many of the peers at indices ``picks`` got a modelled decision different from the real function's."""
    if len(picks) == 0:
        return 0
    real = real_phase_ends(plan, board, slots[picks], phase_epochs[picks], my_samples[picks], my_rates[picks], now)
    return int((real != modelled[picks]).sum())
