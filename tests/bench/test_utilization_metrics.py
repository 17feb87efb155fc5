"""The utilization bench's figures from made-up metrics events (scripts/bench/_utilization_metrics.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
import _utilization_metrics as m  # noqa: E402 - a bench module, not part of the package

T0 = 1_000.0


def inner(t, epoch, samples=800, **fields):
    return {"event": "inner_phase", "time": T0 + t, "epoch": epoch, "samples": samples, **fields}


def outer(t, epoch, **fields):
    return {"event": "outer_step", "time": T0 + t, "epoch": epoch, **fields}


def test_window_runs_from_first_phase_start_to_last_phase_end_and_counts_duty_cycle_rest_as_busy():
    # duty 0.5: each phase is 10 s of compute in 20 s of wall time; 5 s waiting on a round between them
    events = [
        inner(20, 0, compute_s=10.0, wall_s=20.0, steps=100, round_key=0),
        outer(25, 1, samples=800, round_s=5.0),
        inner(45, 1, compute_s=10.0, wall_s=20.0, steps=100, round_key=1),
    ]
    phases = m.phases(events, seq_len=64, batch_size=8, duty_cycle=0.5, stop_time=T0 + 100)
    assert [(p.start_s, p.end_s) for p in phases] == [(T0, T0 + 20), (T0 + 25, T0 + 45)]
    usage = m.peer_usage("p", phases, m.commits(events, T0 + 100, phases), 0.5, last_round_key=0)
    assert usage.window_s == 45.0 and usage.compute_s == 20.0
    assert usage.utilization == pytest.approx(20.0 / (45.0 * 0.5))
    assert usage.idle_s == pytest.approx(5.0)
    # round 1 is still open at the stop: its phase is neither committed nor lost
    assert (usage.samples_resolved, usage.samples_committed) == (800, 800)


def test_older_events_get_defaults_from_tokens_per_s_and_epochs():
    events = [inner(10, 0, tokens_per_s=6400.0), outer(12, 1), inner(22, 1, tokens_per_s=6400.0)]
    phases = m.phases(events, seq_len=64, batch_size=8, duty_cycle=1.0, stop_time=T0 + 100)
    assert [(p.compute_s, p.wall_s, p.steps, p.round_key) for p in phases] == [(8.0, 8.0, 100, 0), (8.0, 8.0, 100, 1)]
    commits = m.commits(events, T0 + 100, phases)
    assert [(c.round_key, c.samples, c.epoch) for c in commits] == [(0, 800, 1)]


def test_lost_phases_of_resolved_rounds_lower_the_share_and_events_after_the_stop_are_ignored():
    fast = [inner(10, 0, round_key=0), outer(15, 1, samples=800), inner(25, 1, round_key=1), outer(30, 2, samples=800)]
    slow = [inner(20, 0, round_key=0), inner(40, 1, round_key=1), outer(41, 2, samples=800)]  # round 0 missed
    stop = T0 + 35  # slow's commit of round 1 comes after the stop
    usages = []
    for name, events in (("fast", fast), ("slow", slow)):
        phases = m.phases(events, 64, 8, 1.0, stop)
        usages.append(m.peer_usage(name, phases, m.commits(events, stop, phases), 1.0, last_round_key=1))
    assert [(u.samples_resolved, u.samples_committed) for u in usages] == [(1600, 1600), (800, 0)]
    assert m.arm_figures(usages)["committed_sample_share"] == pytest.approx(1600 / 2400)
    assert m.arm_figures([])["committed_sample_share"] is None


def test_last_eval_takes_the_newest_epoch_and_rounds_are_measured_at_the_last_arrival():
    a = m.commits([outer(10, 1, round_s=9.0, eval_loss=2.5), outer(30, 2, round_s=4.0, eval_loss=2.2)], T0 + 99)
    b = m.commits([outer(10, 1, round_s=3.0, eval_loss=2.5), outer(31, 2, round_s=6.0)], T0 + 99)
    assert m.last_eval(a + b).eval_loss == 2.2
    phases = [inner(5, 0, wall_s=10.0, compute_s=10.0), inner(25, 1, wall_s=14.0, compute_s=14.0)]
    fastest = m.phases(phases, 64, 8, 1.0, T0 + 99)
    round_s, phase_s, ratio = m.round_vs_phase({"a": a, "b": b}, fastest)
    assert (round_s, phase_s) == (3.5, 12.0)  # rounds: min(9, 3) = 3 and min(4, 6) = 4
    assert ratio == pytest.approx(3.5 / 12.0)


def test_a_peer_that_waits_after_its_last_phase_until_the_stop_is_idle_beyond_one_phase():
    """fp32 on a 2.5 Mbit/s link: two phases, then 180 s waiting on a round that never completed before the stop.
    Up to one phase of the tail counts as work (a phase half done leaves no event), the rest as waiting."""
    events = [
        inner(60, 0, compute_s=60.0, wall_s=60.0, steps=100, round_key=0),
        inner(120, 1, compute_s=60.0, wall_s=60.0, steps=100, round_key=1),
    ]
    phases = m.phases(events, seq_len=64, batch_size=8, duty_cycle=1.0, stop_time=T0 + 300)
    usage = m.peer_usage("p", phases, [], 1.0, last_round_key=-1, stop_time=T0 + 300)
    assert usage.window_s == 300.0 and usage.compute_s == 180.0
    assert usage.utilization == pytest.approx(0.6) and usage.idle_s == pytest.approx(120.0)
    short = m.peer_usage("p", phases, [], 1.0, last_round_key=-1, stop_time=T0 + 150)  # a phase half done: busy
    assert short.utilization == pytest.approx(1.0)
