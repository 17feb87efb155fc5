"""The data-parallel simulation: reproducible, driven by the production schedule, and churn really churns."""

from __future__ import annotations

import numpy as np
import pytest

from hivetrain.sim.dataparallel import DataParallelSim
from hivetrain.sim.swarm_state import ABSENT
from tests.sim.conftest import tiny


def _summary(scenario) -> dict:
    s = dict(DataParallelSim(scenario).run().summary)
    s.pop("wall_s")
    return s


def test_same_seed_same_report_other_seed_other_report() -> None:
    a = _summary(tiny(churn={"session": "exponential", "mean_session_s": 300.0}))
    b = _summary(tiny(churn={"session": "exponential", "mean_session_s": 300.0}))
    c = _summary(tiny(sim={"seed": 4}, churn={"session": "exponential", "mean_session_s": 300.0}))
    assert a == b
    assert a != c


def test_aggregate_schedule_model_runs_the_same_swarm_as_the_real_function() -> None:
    """The whole simulation with every decision from ``decide_phase_end`` equals the one with the vectorised model
    (checked on 3 sampled peers per tick as well)."""
    real = _summary(tiny(sim={"schedule_model": "real"}))
    model = _summary(tiny(sim={"schedule_model": "aggregate", "schedule_probes": 3}))
    assert model["schedule_probes"] > 0 and model["schedule_divergences"] == 0
    for key in ("schedule_model", "schedule_probes", "schedule_divergences"):
        real.pop(key), model.pop(key)
    assert real == model


def test_one_exact_group_commits_every_sample_and_keeps_peers_identical() -> None:
    s = _summary(tiny())
    assert s["outer_steps_done"] == 3
    assert s["committed_sample_share"] == 1.0
    assert s["group_size_max"] == 20
    assert s["drift_max"] < 1e-12  # butterfly: every member applies the same average


def test_two_butterfly_groups_fork_and_the_later_group_downloads() -> None:
    """Groups of at most 12 for 20 peers: each exact group commits its own state at the epoch (drift), and the
    group that commits second finds itself forked (``decide_sync`` before its next phase, as the trainer's
    ``sync_state``) and downloads the first group's state: the swarm ends on one state. A real swarm of 6 with
    groups of 3 did the same (dev/LOG.md, 2026-11-26 session 7)."""
    s = _summary(tiny(averaging={"target_group_size": 12}))
    assert s["group_size_max"] == 12
    assert s["drift_max"] > 1e-6
    assert s["decisions"]["decide_sync.download"] > 0 and s["downloads"] > 0
    assert s["drift_final"] < 1e-12
    # the price: the smaller group's round, committed, is not in the model the swarm keeps (8 of 20 peers)
    assert s["committed_sample_share"] == 1.0 and 0.3 < s["discarded_sample_share"] < 0.45


def test_three_butterfly_groups_per_epoch_drift_apart_for_good() -> None:
    """Groups of 8 for 20 peers: no group's state is a majority, so nobody downloads, and averaging Δ never
    averages θ: peers drawn from different groups into one group stay apart after its commit (their hashes
    differ), and the drift grows epoch after epoch. (The simulator still forms independent groups; the real averager
    runs the two-stage all-reduce, ``averaging.hierarchical``.)"""
    short = _summary(tiny(averaging={"target_group_size": 8}, sim={"outer_steps": 3}))
    long = _summary(tiny(averaging={"target_group_size": 8}, sim={"outer_steps": 8}))
    assert short["drift_final"] > 1e-3 and long["drift_final"] > 2 * short["drift_final"]


def test_churn_removes_and_adds_peers() -> None:
    sim = DataParallelSim(tiny(churn={"session": "exponential", "mean_session_s": 120.0}))
    m = sim.run()
    st = sim.state
    gone = np.flatnonzero(st.i["status"][: st.size] == ABSENT)
    assert m.departures > 0 and m.arrivals > 0
    assert len(gone) == m.departures
    assert (st.f["leaves_at"][gone] <= m.summary["sim_s"]).all()  # nobody left before its session ended...
    assert st.size == 20 + m.arrivals  # ...and every arrival is a new peer
    assert m.summary["downloads"] > 0  # joiners after epoch 0 download the state


@pytest.mark.parametrize(
    "churn",
    [
        {"session": "exponential", "mean_session_s": 120.0},
        # with seed 3 the run ends on peers training on samples carried from a failed round: undecided, not lost
        {"session": "weibull", "weibull_shape": 0.5, "mean_session_s": 60.0},
    ],
)
def test_every_lost_sample_has_a_reason(churn) -> None:
    """Under churn, computed - committed samples is exactly the sum of ``lost_sample_shares``' reasons (the
    accounting closes; samples carried into a phase the end cut off are not yet decided), departures lose samples
    mid-phase, and a churn-free run loses none."""
    churned = _summary(tiny(churn=churn, sim={"outer_steps": 4, "seed": 3}))
    lost = churned["lost_sample_shares"]
    assert abs(lost.pop("unaccounted")) < 1e-9
    assert lost["left mid-phase"] > 0
    assert abs(1 - churned["committed_sample_share"] - sum(lost.values())) < 1e-9
    calm = _summary(tiny())
    assert calm["committed_sample_share"] == 1.0 and calm["lost_sample_shares"] == {"unaccounted": 0.0}


def test_peers_waiting_past_their_round_deadline_give_up_and_the_swarm_keeps_training() -> None:
    """Phases of very uneven length (speed jitter 2): the first ready peers of an epoch are half of it or fewer when
    their window closes, so ``decide`` keeps them waiting for the others (the minority rule). A peer still waiting at
    its round deadline gives up ("no_group", as the real matchmaker's call deadline does) and retries or carries;
    meanwhile the entries of waiting peers stay candidates until that deadline. The run reaches every outer step and
    commits nearly every sample (before: the waiting peers' entries went stale at their window's close and nobody
    ever declared again: 1 outer step in 100,000 simulated seconds under 10 min sessions)."""
    jittery = DataParallelSim(tiny(peers={"speed_jitter": 2.0}, sim={"num_peers": 10, "outer_steps": 4})).run()
    assert jittery.decisions["round_failed.no_group"] > 0
    assert jittery.summary["outer_steps_done"] == 4 and jittery.summary["committed_sample_share"] > 0.9
    churned = DataParallelSim(tiny(churn={"session": "exponential", "mean_session_s": 600.0})).run().summary
    assert churned["outer_steps_done"] == 3 and churned["sim_s"] < 300
