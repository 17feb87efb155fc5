"""The calibration's pure parts (``sim.calibrate``) on hand-made event logs; a scenario's per-peer speed list."""

from __future__ import annotations

import numpy as np
import pytest

from hivetrain.sim import calibrate as cal
from hivetrain.sim.config import PeerDistribution, parse_scenario
from hivetrain.sim.dataparallel import DataParallelSim
from tests.sim.conftest import tiny

T0 = 1_000.0


def _events(peer: int, speed: float) -> list[dict]:
    """A real peer's events: starts at T0 + peer, two rounds of a 2-peer group; phase r of 80 samples ends at
    T0 + 10 (r + 1), takes 80 / speed compute seconds; its round takes 0.5 s (peer 0) or 0.2 s (peer 1), the commit
    is logged 0.1 s after the round ends, and the next phase starts 0.3 s after it."""
    events = [{"event": "start", "time": T0 + peer, "epoch": 0}]
    round_s = 0.5 if peer == 0 else 0.2
    for r in range(2):
        end = T0 + 10 * (r + 1)
        compute_s = 80 / speed
        wall_s = end - (T0 + 10 * r + round_s + 0.4) if r else compute_s
        events.append({"event": "inner_phase", "time": end, "epoch": r, "round_key": r, "samples": 80,
                       "compute_s": compute_s, "wall_s": wall_s})  # fmt: skip
        events.append({"event": "outer_step", "time": end + round_s + 0.1, "epoch": r + 1, "samples": 80,
                       "group_size": 2, "state_hash": f"h{r}", "round_s": round_s})  # fmt: skip
    events.append({"event": "round_failed", "time": T0 + 25, "epoch": 2, "reason": "not_in_group",
                   "detail": "not_in_group (group of Qm1 closed at 1024.00 before we announced)"})  # fmt: skip
    events.append({"event": "round_failed", "time": T0 + 25.5, "epoch": 2, "reason": "not_in_group",
                   "detail": "not_in_group (Qm1 closed its window at 1025.00 without us)"})  # fmt: skip
    events.append({"event": "state_downloaded", "time": T0 + 26, "epoch": 3})
    return events


def test_real_log_reads_round_keys_and_times_after_the_first_start() -> None:
    log = cal.real_log([_events(0, 40.0), _events(1, 20.0)])
    assert log.starts_s == [0.0, 1.0]
    assert [(c.peer, c.round_key, c.group) for c in log.commits[:2]] == [(0, 0, "h0"), (0, 1, "h1")]
    assert [c.time_s for c in log.commits[:2]] == pytest.approx([10.6, 20.6])
    # the engine reports decide's "late" as "not_in_group"; its detail tells them apart
    assert [(f.round_key, f.reason) for f in log.failures[:2]] == [(2, "late"), (2, "not_in_group")]
    assert [t for _, t in log.downloads] == pytest.approx([26.0, 26.0])
    with pytest.raises(ValueError, match="peer0 has no start"):
        cal.real_log([[{"event": "inner_phase", "time": 1.0}]])


def test_figures_over_the_compared_rounds() -> None:
    log = cal.real_log([_events(0, 40.0), _events(1, 20.0)])
    f = cal.figures(log, num_rounds=2)
    end = (20.6 + 20.3) / 2  # median commit of round key 1
    assert f["window_s"] == pytest.approx(end)
    assert f["outer_steps_per_peer"] == 2 and f["committed_samples"] == 320
    assert f["committed_samples_per_peer"] == [160, 160]
    assert f["time_per_outer_step_s"] == pytest.approx(10.0)
    assert f["group_size_mean"] == 2
    assert f["failed_rounds"] == 0 and f["state_downloads"] == 0  # both after the window / past its rounds
    assert f["utilization"] == pytest.approx(((4.0 / end) + (8.0 / (end - 1.0))) / 2)  # 2 x 80 / speed each
    later = cal.figures(log, num_rounds=3)  # round key 2 has no commit: the window runs to the last commit
    assert later["failed_rounds"] == 4 and later["late_verdicts"] == 2


def test_fits_speed_outer_step_and_round_cost() -> None:
    log = cal.real_log([_events(0, 40.0), _events(1, 20.0)])
    busy = [80 / speed + 10 - round_s - 0.4 for speed, round_s in ((40.0, 0.5), (20.0, 0.2))]  # phases' wall_s
    assert cal.fit_speeds(log) == pytest.approx([160 / b for b in busy])
    assert cal.fit_outer_step_s(log) == pytest.approx(0.4)  # 0.1 s to the commit event + 0.3 s to the next phase
    assert cal.fit_round_s(log) == pytest.approx(0.2)  # the shorter call of each group
    empty = cal.RunLog(1, [0.0])
    assert cal.fit_outer_step_s(empty) == 0.0 and cal.fit_round_s(empty) == 0.0
    with pytest.raises(ValueError, match="inner steps"):
        cal.fit_speeds(empty)


def test_tolerances_and_compare() -> None:
    assert cal.within(100.0, 109.0, cal.Tolerance("rel", 0.1))
    assert not cal.within(100.0, 111.0, cal.Tolerance("rel", 0.1))
    assert cal.within(3.0, 4.0, cal.Tolerance("abs", 1.0)) and not cal.within(3.0, 5.0, cal.Tolerance("abs", 1.0))
    each = cal.Tolerance("rel_each", 0.25)
    assert cal.within([100.0, 40.0], [120.0, 31.0], each)
    assert not cal.within([100.0, 40.0], [120.0, 29.0], each)
    assert not cal.within([100.0], [100.0, 1.0], each)
    rows = cal.compare({"a": 10.0, "b": 1.0}, {"a": 10.5, "b": 3.0},
                       {"a": cal.Tolerance("rel", 0.1), "b": cal.Tolerance("abs", 1.0)})  # fmt: skip
    assert [(r.name, r.tolerance, r.ok) for r in rows] == [("a", "±10%", True), ("b", "±1", False)]


def test_speed_list_is_validated_and_given_to_peers_in_order() -> None:
    with pytest.raises(ValueError, match="samples_per_s is required"):
        PeerDistribution(compute="list")
    with pytest.raises(ValueError, match="samples_per_s is required"):
        PeerDistribution(samples_per_s=(1.0,))
    with pytest.raises(ValueError, match="> 0"):
        PeerDistribution(compute="list", samples_per_s=(1.0, 0.0))
    with pytest.raises(ValueError, match="2 speed"):
        parse_scenario({"sim": {"num_peers": 3}, "peers": {"compute": "list", "samples_per_s": [1.0, 2.0]}})
    speeds = [float(k + 1) for k in range(20)]
    sim = DataParallelSim(tiny(peers={"compute": "list", "samples_per_s": speeds, "outer_step_s": 0.5}))
    sim.run()
    np.testing.assert_array_equal(sim.state.f["samples_per_s"][:20], speeds)


def test_speed_jitter_is_fitted_from_phase_speeds_and_varies_simulated_phases() -> None:
    log = cal.RunLog(1, [0.0], phases=[cal.Phase(0, 0, 8.0, 80, 8.0, 8.0), cal.Phase(0, 1, 10.0, 80, 2.0, 2.0)])
    assert cal.fit_speed_jitter(log) == pytest.approx(np.log(4) / 2)  # speeds 10 and 40 around 160 / 10 = 16
    speeds = [4.0] * 20
    steady = DataParallelSim(tiny(peers={"compute": "list", "samples_per_s": speeds}))
    steady.run()
    np.testing.assert_array_equal(steady.state.f["samples_per_s"][:20], speeds)
    jittery = DataParallelSim(tiny(peers={"compute": "list", "samples_per_s": speeds, "speed_jitter": 0.3}))
    jittery.run()
    np.testing.assert_array_equal(jittery.state.f["base_samples_per_s"][:20], speeds)
    assert len(set(jittery.state.f["samples_per_s"][:20].tolist())) == 20  # each phase drew its own speed


def test_median_figures_over_seeds() -> None:
    runs = [{"a": 1.0, "l": [1.0, 9.0]}, {"a": 5.0, "l": [2.0, 7.0]}, {"a": 3.0, "l": [3.0, 8.0]}]
    assert cal.median_figures(runs) == {"a": 3.0, "l": [2.0, 8.0]}
    with pytest.raises(ValueError):
        cal.median_figures([])
