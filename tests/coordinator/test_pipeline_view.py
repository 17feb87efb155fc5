"""The coordinator's pipeline view: claimed counters are credited only as bounded increases (pure, time injected),
and the observer folds stage records, trainer reports and rebalance reports into stages, totals and reasons."""

from __future__ import annotations

import pytest

from hivetrain.coordinator.pipeline import Baseline, CreditLimits, PipelineObserver, credit_claim
from hivetrain.swarm.announce import StageRecord
from hivetrain.swarm.reports import Move, RebalanceReport, TrainerReport

NOW = 1_800_000_000.0
FP = "f" * 16


def test_an_increase_is_credited_in_full_within_the_rate():
    base = Baseline(value=100, seen_at=NOW, started_at=NOW - 50)
    credited, new = credit_claim(base, 130, NOW - 50, NOW + 2, max_rate_per_s=100, max_first_sight_s=60)
    assert credited == 30
    assert new == Baseline(130, NOW + 2, NOW - 50)


def test_an_increase_beyond_rate_times_elapsed_is_cut_and_the_excess_never_credited_later():
    base = Baseline(value=100, seen_at=NOW, started_at=NOW - 50)
    credited, new = credit_claim(base, 10**9, NOW - 50, NOW + 2, max_rate_per_s=100, max_first_sight_s=60)
    assert credited == 200  # 100/s x 2 s
    again, _ = credit_claim(new, 10**9, NOW - 50, NOW + 10, max_rate_per_s=100, max_first_sight_s=60)
    assert again == 0  # the lie is the new baseline: nothing more of it is credited by waiting


def test_the_same_claim_seen_twice_is_credited_once():
    credited, base = credit_claim(None, 40, NOW - 10, NOW, max_rate_per_s=100, max_first_sight_s=60)
    assert credited == 40
    assert credit_claim(base, 40, NOW - 10, NOW + 5, 100, 60)[0] == 0


def test_first_sight_is_bounded_by_the_claimed_age_and_by_max_first_sight():
    assert credit_claim(None, 1000, NOW - 3, NOW, 100, 60)[0] == 300  # started 3 s ago: at most 300
    assert credit_claim(None, 10**9, NOW - 10**6, NOW, 100, 60)[0] == 6000  # an old start is worth 60 s at most
    assert credit_claim(None, 50, NOW + 100, NOW, 100, 60)[0] == 0  # a start in the future earns nothing


def test_a_decrease_or_new_start_is_a_restart_counted_from_zero_within_the_rate():
    base = Baseline(value=500, seen_at=NOW, started_at=NOW - 100)
    assert credit_claim(base, 20, NOW - 100, NOW + 1, 100, 60)[0] == 20  # counter went down: restarted
    assert credit_claim(base, 700, NOW + 0.5, NOW + 1, 100, 60)[0] == 100  # new start: 700 from 0, cut to 1 s
    credited, new = credit_claim(base, 0, NOW + 0.5, NOW + 1, 100, 60)
    assert credited == 0 and new.value == 0


def test_a_clock_going_backwards_credits_nothing():
    base = Baseline(value=10, seen_at=NOW, started_at=NOW - 100)
    assert credit_claim(base, 50, NOW - 100, NOW - 5, 100, 60)[0] == 0


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="max_microbatches_per_s"):
        CreditLimits(max_microbatches_per_s=0)


def _stage(peer: str, stage: int, throughput: float, load: float = 0.5, **kw) -> StageRecord:
    return StageRecord(
        peer_id=peer,
        run_id="r",
        model_fingerprint=kw.pop("fingerprint", FP),
        stage=stage,
        num_stages=3,
        throughput=throughput,
        load=load,
        queue_len=kw.pop("queue_len", 1),
        updated_at=kw.pop("updated_at", NOW),
        **kw,
    )


def _trainer(peer: str, at: float, started_at: float = NOW - 1, **counters) -> TrainerReport:
    return TrainerReport(
        peer_id=peer, run_id="r", model_fingerprint=FP, started_at=started_at, updated_at=at, **counters
    )


def _moves(peer: str, at: float, rebalances: int, moves=(), decision: str = "") -> RebalanceReport:
    return RebalanceReport(
        peer_id=peer,
        run_id="r",
        model_fingerprint=FP,
        stage=1,
        started_at=NOW - 1,
        rebalances=rebalances,
        moves=moves,
        last_decision=decision,
        last_decision_at=at if decision else 0.0,
        updated_at=at,
    )


def test_the_view_has_every_stage_its_servers_and_the_bottleneck():
    obs = PipelineObserver(3, 4, FP)
    stages = [
        _stage("s0a", 0, 2.0),
        _stage("s0b", 0, 3.0, load=1.0),
        _stage("s2a", 2, 1.5),
        _stage("x", 1, 9, fingerprint="other"),
    ]
    obs.observe(stages, [], [], NOW + 1)
    view = obs.view(NOW + 1)
    assert [len(s.servers) for s in view.stages] == [2, 0, 1]  # the other model's server is left out
    assert [s.throughput_mb_per_s for s in view.stages] == [5.0, 0.0, 1.5]
    assert [s.bottleneck for s in view.stages] == [False, True, False]  # nobody serves stage 1
    assert view.pipeline_throughput_mb_per_s == 0.0 and view.num_servers == 3
    assert view.stages[0].mean_load == pytest.approx(0.75)
    row = view.stages[0].servers[1]
    assert (row.peer_id, row.throughput_mb_per_s, row.load, row.queue_len, row.last_seen_s_ago) == (
        "s0b",
        3.0,
        1.0,
        1,
        1.0,
    )


def test_totals_and_rate_come_from_credited_increases_and_survive_a_trainer_leaving():
    obs = PipelineObserver(3, 4, FP, CreditLimits(max_microbatches_per_s=50, window_s=60))
    obs.observe([], [_trainer("t1", NOW, microbatches=0), _trainer("t2", NOW, microbatches=0)], [], NOW)
    obs.observe([], [_trainer("t1", NOW + 2, microbatches=40, reroutes=3, replays=1, deaths=1)], [], NOW + 2)
    obs.observe(
        [], [_trainer("t1", NOW + 4, microbatches=10**6), _trainer("t2", NOW + 4, microbatches=20)], [], NOW + 4
    )
    view = obs.view(NOW + 4)
    t1 = next(t for t in view.trainers if t.peer_id == "t1")
    assert t1.microbatches == 40 + 100  # the lie is cut to 50/s x 2 s
    assert (view.microbatches_total, view.reroutes_total, view.replays_total, view.deaths_total) == (160, 3, 1, 1)
    assert view.microbatches_per_s == pytest.approx(160 / 4)
    obs.observe([], [], [], NOW + 6)  # both trainers' reports expired: totals stay
    assert obs.view(NOW + 6).microbatches_total == 160 and obs.view(NOW + 6).trainers == ()


def test_rate_is_measured_over_the_window_only():
    obs = PipelineObserver(1, 4, FP, CreditLimits(window_s=10))
    for i in range(0, 41, 2):  # 5 microbatches/s for 20 s, then nothing for 20 s
        obs.observe([], [_trainer("t", NOW + i, microbatches=min(i, 20) * 5)], [], NOW + i)
    assert obs.view(NOW + 40).microbatches_per_s == 0.0
    assert obs.view(NOW + 40).microbatches_total == 100


def test_rebalances_are_shown_with_reasons_only_as_far_as_credited():
    obs = PipelineObserver(3, 4, FP, CreditLimits(max_rebalances_per_s=0.1))
    obs.observe([_stage("s", 1, 1.0)], [], [_moves("s", NOW, 0, decision="stage 1 is the bottleneck")], NOW)
    move = Move(at=NOW + 9, from_stage=0, to_stage=1, reason="stage throughputs [3, 1, 2]: moving 0 -> 1 (+50%)")
    obs.observe([_stage("s", 1, 1.0)], [], [_moves("s", NOW + 10, 1, (move,), "moved")], NOW + 10)
    view = obs.view(NOW + 10)
    assert view.rebalances_total == 1 and len(view.rebalances) == 1
    assert (view.rebalances[0].from_stage, view.rebalances[0].to_stage) == (0, 1)
    assert "+50%" in view.rebalances[0].reason
    assert view.stages[1].servers[0].rebalances == 1 and view.stages[1].servers[0].last_decision == "moved"
    forged = tuple(Move(at=NOW + 10.5 + i, from_stage=2, to_stage=1, reason="fake") for i in range(3))
    obs.observe([], [], [_moves("s", NOW + 11, 99, (move, *forged))], NOW + 11)
    view = obs.view(NOW + 11)
    assert view.rebalances_total == 1 and len(view.rebalances) == 1  # 0.1/s x 1 s credits no further move


def test_reasons_are_cleaned_and_capped():
    obs = PipelineObserver(1, 4, FP)
    reason = "stage 0 \x1b[31mQmEvil\u202e: " + "x" * 270  # under the schema's 300, over the page's 200
    obs.observe([], [_trainer("t", NOW, last_reasons=(reason,), left_reason="finished")], [], NOW)
    row = obs.view(NOW).trainers[0]
    assert "\x1b" not in row.last_reasons[0] and "\u202e" not in row.last_reasons[0]
    assert len(row.last_reasons[0]) <= 200 and row.left_reason == "finished"
