"""Fault scheduling: triggers by time and by event, churn plans and decisions (pure functions, no processes)."""

from hivetrain.chaos.scenario import parse_scenario
from hivetrain.chaos.schedule import ChurnStep, Observed, churn_decision, churn_plan, due_faults, trigger_time

BASE = {"name": "t", "description": "d", "peers": 4, "max_duration_s": 1000, "run": {"diloco": {"outer_steps": 5}}}


def make(*faults):
    return parse_scenario({**BASE, "faults": list(faults)})


def test_time_trigger_fires_exactly_at_its_time():
    s = make({"kind": "kill", "peer": 1, "at_s": 10, "delay_s": 2})
    assert due_faults([0], s, [], now_s=11.9) == []
    assert [i for i, _ in due_faults([0], s, [], now_s=12.0)] == [0]


def test_event_trigger_matches_event_peer_and_epoch():
    s = make({"kind": "kill", "peer": 1, "on_event": "inner_phase", "on_peer": 1, "on_epoch": 2, "delay_s": 0.5})
    fault = s.faults[0]
    noise = [
        Observed(0, "inner_phase", 2, 5.0),  # wrong peer
        Observed(1, "inner_phase", 1, 6.0),  # wrong epoch
        Observed(1, "outer_step", 2, 7.0),  # wrong event
        Observed(None, "inner_phase", 2, 7.5),  # churn peer
    ]
    assert trigger_time(fault, noise)[0] is None
    events = noise + [Observed(1, "inner_phase", 2, 8.0), Observed(1, "inner_phase", 2, 20.0)]
    when, reason = trigger_time(fault, events)
    assert when == 8.5 and "peer 1 emitted inner_phase at epoch 2" in reason
    # a peer that missed epoch 2 (late start, caught up by state download) triggers at its first later event
    late = noise + [Observed(1, "inner_phase", 4, 30.0), Observed(1, "inner_phase", 5, 40.0)]
    when, reason = trigger_time(fault, late)
    assert when == 30.5 and "at epoch 4" in reason
    assert due_faults([0], s, events, now_s=8.4) == []
    assert [i for i, _ in due_faults([0], s, events, now_s=8.5)] == [0]


def test_due_faults_come_in_time_order_and_only_pending_ones():
    s = make(
        {"kind": "kill", "peer": 1, "at_s": 30},
        {"kind": "kill", "peer": 2, "at_s": 10},
        {"kind": "byzantine", "peer": 3, "mode": "nan"},
    )
    assert [i for i, _ in due_faults([0, 1], s, [], now_s=40)] == [1, 0]
    assert [i for i, _ in due_faults([0], s, [], now_s=40)] == [0]


def test_churn_plan_is_seeded_and_bounded():
    fault = make(
        {"kind": "churn", "at_s": 5, "duration_s": 300, "mean_interval_s": 30, "min_peers": 2, "max_peers": 5}
    ).faults[0]
    plan = churn_plan(fault, start_s=5.0, seed=7)
    assert plan == churn_plan(fault, start_s=5.0, seed=7)
    assert plan != churn_plan(fault, start_s=5.0, seed=8)
    assert all(5.0 < step.t_s < 305.0 for step in plan)
    assert [s.t_s for s in plan] == sorted(s.t_s for s in plan)
    assert 3 <= len(plan) <= 25  # Poisson with mean 10 events
    assert {s.action for s in plan} == {"join", "kill"}


def test_churn_decision_respects_bounds_and_protects_byzantine_peers():
    kill = ChurnStep(t_s=1.0, action="kill", victim_rank=0.99)
    join = ChurnStep(t_s=1.0, action="join", victim_rank=0.0)
    assert churn_decision(kill, ["a", "b", "c"], [], 2, 5)[:2] == ("kill", "c")
    assert churn_decision(kill, ["a", "b", "c"], ["c"], 2, 5)[:2] == ("kill", "b")
    assert churn_decision(kill, ["a", "b"], [], 2, 5)[0] == "join"  # would go below min_peers
    assert churn_decision(join, ["a", "b", "c", "d", "e"], [], 2, 5)[:2] == ("kill", "a")  # at max_peers
    assert churn_decision(join, ["a"], [], 2, 5)[0] == "join"
    assert churn_decision(kill, ["a", "b", "c"], ["a", "b", "c"], 2, 5)[0] == "skip"
