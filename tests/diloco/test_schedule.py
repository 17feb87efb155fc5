"""The swarm's schedule (pure): when a peer ends its inner phase, from the progress others publish."""

import time

from hivetrain.diloco.schedule import (
    PhasePlan,
    decide_phase_end,
    failed_rounds,
    round_failed_since,
    round_to_wait_for,
    round_under_way,
)
from tests.records import peer_record

NOW = 1000.0
SWARM = PhasePlan(schedule="swarm", inner_steps=10, batch_size=8, stale_after_s=30.0, max_extrapolation_s=15.0)


def rec(peer, phase_epoch=3, samples=0, throughput=0.0, age=0.0, role="trainer", left=""):
    return peer_record(
        peer,
        phase_epoch,
        NOW - age,
        role=role,
        throughput=throughput,
        phase_epoch=phase_epoch,
        phase_samples=samples,
        left_reason=left,
    )


def test_fixed_steps_end_after_h_steps_whatever_the_others_do():
    plan = PhasePlan(schedule="steps", inner_steps=10, batch_size=8)
    assert decide_phase_end(plan, "me", 3, 72, 8.0, [rec("a", samples=10_000)], NOW).action == "continue"
    assert decide_phase_end(plan, "me", 3, 80, 8.0, [], NOW).action == "end"


def test_alone_the_swarm_schedule_runs_h_steps():
    assert decide_phase_end(SWARM, "me", 3, 72, 8.0, [], NOW).action == "continue"
    d = decide_phase_end(SWARM, "me", 3, 80, 8.0, [], NOW)
    assert d.action == "end" and d.target_samples == 80 and d.num_peers == 1


def test_a_fast_peer_keeps_going_while_a_slow_peer_has_done_little():
    # 3 peers at epoch 3: target 240 samples. We did 100 (one H plus), the slow ones 20 and 40: the swarm is at 160.
    records = [rec("slow", samples=20, throughput=2.0), rec("mid", samples=40, throughput=4.0)]
    d = decide_phase_end(SWARM, "me", 3, 100, 8.0, records, NOW)
    assert d.action == "continue" and d.target_samples == 240 and d.num_peers == 3
    assert abs(d.swarm_samples - 160) < 1e-9 and abs(d.eta_s - 80 / 14) < 1e-9


def test_a_slow_peer_ends_when_the_swarm_reaches_the_target_not_after_its_own_h():
    records = [rec("fast", samples=200, throughput=16.0)]
    d = decide_phase_end(SWARM, "me", 3, 8, 2.0, records, NOW)  # one step of ours; the fast peer did the rest
    assert d.action == "end" and d.target_samples == 160


def test_progress_is_extrapolated_from_the_record_time_by_throughput_but_bounded():
    # The record is 5 s old: 40 + 5 * 8 = 80 samples now; with ours (40) the swarm is at 120 of 160.
    d = decide_phase_end(SWARM, "me", 3, 40, 8.0, [rec("a", samples=40, throughput=8.0, age=5.0)], NOW)
    assert abs(d.swarm_samples - 120) < 1e-9 and d.action == "continue"
    # 25 s old: extrapolation stops at 15 s (a peer that vanished is not counted as training on for ever)
    d = decide_phase_end(SWARM, "me", 3, 8, 8.0, [rec("a", samples=0, throughput=8.0, age=25.0)], NOW)
    assert abs(d.swarm_samples - (8 + 120)) < 1e-9


def test_stale_left_other_epoch_and_non_trainer_records_do_not_count():
    records = [
        rec("stale", samples=500, throughput=8.0, age=40.0),
        rec("left", samples=500, left="interrupted"),
        rec("behind", phase_epoch=2, samples=500),
        rec("coord", samples=500, role="coordinator"),
    ]
    d = decide_phase_end(SWARM, "me", 3, 8, 8.0, records, NOW)
    assert d.num_peers == 1 and d.target_samples == 80 and d.action == "continue"


def test_one_peer_claims_count_for_at_most_the_per_peer_bound():
    plan = PhasePlan(schedule="swarm", inner_steps=10, batch_size=8, max_samples_per_peer=100)
    d = decide_phase_end(plan, "me", 3, 8, 8.0, [rec("liar", samples=10**9, throughput=1e9)], NOW)
    assert d.action == "continue" and d.swarm_samples == 108  # target 160: the liar cannot end the epoch alone


def test_a_fixed_target_overrides_the_automatic_one():
    plan = PhasePlan(schedule="swarm", inner_steps=10, batch_size=8, target_samples_per_epoch=1000)
    assert decide_phase_end(plan, "me", 3, 500, 8.0, [rec("a", samples=400)], NOW).action == "continue"
    assert decide_phase_end(plan, "me", 3, 600, 8.0, [rec("a", samples=400)], NOW).action == "end"


def test_end_before_a_step_that_would_finish_after_the_swarm():
    # 1 sample short of the target with the other peer producing 100 samples/s: ETA 0.01 s, our step takes 4 s.
    d = decide_phase_end(SWARM, "me", 3, 8, 2.0, [rec("fast", samples=151, throughput=100.0)], NOW)
    assert d.action == "end" and "before our next step" in d.reason


def test_before_the_first_step_an_unknown_pace_or_being_alone_runs_a_step():
    # our pace unknown (the first phase): nothing says our step would outlast the others' phase
    d = decide_phase_end(SWARM, "me", 3, 0, 0.0, [rec("a", samples=100, throughput=8.0)], NOW)
    assert d.action == "continue"
    d = decide_phase_end(SWARM, "me", 3, 0, 2.0, [], NOW)  # alone: nobody else computes the epoch
    assert d.action == "continue" and d.reason == "no inner step yet"


def test_before_the_first_step_a_step_that_would_outlast_the_others_phase_is_not_started():
    # Target 160; the other peer is at 100 and makes 100 samples/s: it is done in 0.6 s, our step takes 4 s (2/s).
    d = decide_phase_end(SWARM, "me", 3, 0, 2.0, [rec("fast", samples=100, throughput=100.0)], NOW)
    assert d.action == "end" and "before our next step" in d.reason
    # the same peer far from the target (10 of 160 at 8/s): our 4 s step ends long before it does
    d = decide_phase_end(SWARM, "me", 3, 0, 2.0, [rec("a", samples=10, throughput=8.0)], NOW)
    assert d.action == "continue"


def test_before_the_first_step_others_that_ended_their_phase_are_joined_at_once():
    # a starved peer (chaos cpu-starve): both others ended epoch 3 with their share and wait for us in matchmaking
    records = [done("a", samples=120), done("b", samples=120)]
    d = decide_phase_end(SWARM, "me", 3, 0, 1.0, records, NOW)
    assert d.action == "end" and d.num_peers == 3
    # ... and when two ended short of their share too: they wait one step of ours, not for the rest of the target
    # (they counted on progress of ours that our starved steps never made)
    d = decide_phase_end(SWARM, "me", 3, 0, 1.0, [done("a", samples=40), done("b", samples=40)], NOW)
    assert d.action == "end" and "they wait for us" in d.reason
    # ... but not one peer alone that ended short of its share: a lone claim of being done must claim its share
    d = decide_phase_end(SWARM, "me", 3, 0, 1.0, [done("a", samples=40)], NOW)
    assert d.action == "continue"


def done(peer, epoch=3, samples=0, phase_epoch=None, throughput=8.0):
    """The record of a peer whose phase for ``epoch`` ended with ``samples`` (now in ``phase_epoch``'s phase)."""
    r = rec(peer, phase_epoch=epoch if phase_epoch is None else phase_epoch, samples=0, throughput=throughput)
    # its state is still ``epoch``'s: the round of ``epoch`` has not committed (with overlap its next phase runs)
    return r.model_copy(update={"epoch": epoch, "done_epoch": epoch, "done_samples": samples})


def test_peers_whose_phase_ended_count_with_their_final_samples_after_moving_to_the_next_epoch():
    # Overlap: the two fast peers ended their phase for epoch 3 (the swarm had 240 of 240 by their count) and run
    # epoch 4's. The slow peer's step ended just after: it must see the epoch as done, not count itself alone.
    records = [done("fast", samples=150, phase_epoch=4), done("mid", samples=70, phase_epoch=4)]
    d = decide_phase_end(SWARM, "me", 3, 24, 2.0, records, NOW)
    assert d.action == "end" and d.num_peers == 3 and d.target_samples == 240 and d.swarm_samples == 244
    # with 16 samples the swarm is 4 short, and none of theirs is extrapolated; but both wait for us: a step of ours
    # (4 s at 2 samples/s) would only hold them up, or make us miss their group
    d = decide_phase_end(SWARM, "me", 3, 16, 2.0, records, NOW)
    assert d.action == "end" and d.swarm_samples == 236 and "they wait for us" in d.reason
    # while one of them still runs, the swarm's count decides as before
    d = decide_phase_end(SWARM, "me", 3, 16, 2.0, [*records, rec("slow", samples=0, throughput=0.5)], NOW)
    assert d.action == "continue"


def test_a_phase_for_a_round_that_most_peers_already_committed_ends_at_once():
    # chaos cpu-starve beside 2 hogs: the starved peer downloaded epoch 3 while its round was committing; the others
    # now hold epoch 4 and compute for it. Nobody computes for epoch 3 any more: alone by the swarm's count, it would
    # run all its H steps for a finished round.
    ahead = [rec("a", phase_epoch=4, samples=40, throughput=8.0), rec("b", phase_epoch=4, samples=40, throughput=8.0)]
    d = decide_phase_end(SWARM, "me", 3, 8, 2.0, ahead, NOW)
    assert d.action == "end" and "the round of epoch 3 is over: 2 live peer(s) committed it" in d.reason
    d = decide_phase_end(SWARM, "me", 3, 0, 2.0, ahead, NOW)  # before the first step: no step at all
    assert d.action == "end"
    # one record claiming an epoch ahead is no evidence (a liar could cut every phase of ours short) ...
    d = decide_phase_end(SWARM, "me", 3, 8, 2.0, ahead[:1], NOW)
    assert d.action == "continue"
    # ... nor are two when as many live peers still compute for (or wait in) our epoch's round
    here = [rec("c", samples=16, throughput=2.0), done("d", samples=40)]
    assert decide_phase_end(SWARM, "me", 3, 8, 2.0, [*ahead, *here], NOW).action == "continue"
    # paused peers ahead do not count (they train nothing; their state is old news)
    paused = [r.model_copy(update={"paused": True}) for r in ahead]
    assert decide_phase_end(SWARM, "me", 3, 8, 2.0, paused, NOW).action == "continue"
    # a peer that committed our round and shows its phase for it ended counts, before its next phase shows
    committed = [done("a", samples=40).model_copy(update={"epoch": 4}), done("b").model_copy(update={"epoch": 4})]
    assert decide_phase_end(SWARM, "me", 3, 8, 2.0, committed, NOW).action == "end"


def test_records_that_claim_a_later_epoch_while_computing_for_ours_do_not_end_our_phase():
    # chaos ahead-liars-2v2 beside 2 hogs: two colluding identities claim epoch 4 while their records' phases still
    # compute for round 3 (or an earlier one), beside one honest peer computing for it: "2 live peers committed it,
    # 1 did not" ended our phase before its first step. No honest peer publishes that: at a later epoch it computes
    # for a later round, or its record shows its phase for ours ended.
    liars = [rec(p, samples=40, throughput=8.0).model_copy(update={"epoch": 4, "done_epoch": 2}) for p in "xy"]
    honest = rec("h", samples=16, throughput=8.0)
    for phase_samples in (0, 8):
        d = decide_phase_end(SWARM, "me", 3, phase_samples, 2.0, [*liars, honest], NOW)
        assert d.action == "continue" and "is over" not in d.reason, d.reason


def test_a_peer_waiting_for_the_round_is_not_extrapolated():
    # Without overlap a peer that ended its phase stays at phase_epoch 3 and still publishes a throughput.
    d = decide_phase_end(SWARM, "me", 3, 8, 8.0, [done("a", samples=40, phase_epoch=3, throughput=100.0)], NOW)
    assert d.swarm_samples == 48 and d.action == "continue"  # it waits for us, but did only 40 of its 80 samples
    d = decide_phase_end(SWARM, "me", 3, 8, 8.0, [done("a", samples=80, phase_epoch=3, throughput=100.0)], NOW)
    assert d.swarm_samples == 88 and d.action == "end" and "they wait for us" in d.reason  # its share: we end


def test_a_finished_phase_claim_is_bounded_like_progress():
    plan = PhasePlan(schedule="swarm", inner_steps=10, batch_size=8, max_samples_per_peer=60)
    d = decide_phase_end(plan, "me", 3, 8, 8.0, [done("liar", samples=10**9, phase_epoch=4)], NOW)
    assert d.action == "continue" and d.swarm_samples == 68  # counted 60: short of its 80-sample share of 160


def test_a_peer_that_committed_our_epoch_but_has_not_published_its_new_phase_counts_from_zero():
    # "slow" committed epoch 3 (its record says epoch 3) and still shows its phase for epoch 2 with 136 samples: it
    # has begun phase 3 and not published yet. It counts (target 240 for 3 peers, not 160 for 2), from 0 samples
    # extrapolated by its throughput since its record, not from its old phase's 136.
    lagging = rec("slow", phase_epoch=2, samples=136, throughput=2.0, age=1.0).model_copy(update={"epoch": 3})
    d = decide_phase_end(SWARM, "me", 3, 100, 8.0, [lagging, rec("mid", samples=40, throughput=4.0)], NOW)
    assert d.action == "continue" and d.num_peers == 3 and d.target_samples == 240
    assert abs(d.swarm_samples - (100 + 40 + 2.0)) < 1e-9


def test_a_sample_of_a_sharded_swarm_stands_for_the_whole_swarm():
    # 20 trainers at 30 samples each, throughput 3; an explicit target of 2000. Seeing all of them, or every other one
    # at coverage 0.5, gives the same estimate of the swarm's samples, peers and rate.
    plan = PhasePlan(schedule="swarm", inner_steps=10, batch_size=8, target_samples_per_epoch=2000)
    everyone = [rec(f"p{i:02d}", samples=30, throughput=3.0) for i in range(20)]
    full = decide_phase_end(plan, "me", 3, 30, 3.0, everyone, NOW)
    half = decide_phase_end(plan, "me", 3, 30, 3.0, everyone[::2], NOW, coverage=0.5)
    assert full.num_peers == half.num_peers == 21 and abs(full.swarm_samples - half.swarm_samples) < 1e-9
    assert abs(full.eta_s - half.eta_s) < 1e-9 and full.action == half.action == "continue"
    # without the scale the sample would look like half the swarm: an explicit target then ends far too late
    blind = decide_phase_end(plan, "me", 3, 30, 3.0, everyone[::2], NOW)
    assert blind.num_peers == 11 and blind.eta_s > 2 * full.eta_s


def _at(peer, epoch, done_epoch=0, done_samples=0, age=0.0, paused=False, role="trainer", phase_epoch=None):
    phase_epoch = epoch if phase_epoch is None else phase_epoch
    r = peer_record(peer, epoch, NOW - age, role=role, phase_epoch=phase_epoch, paused=paused)
    return r.model_copy(update={"done_epoch": done_epoch, "done_samples": done_samples})


def test_a_round_is_under_way_without_us_once_most_trainers_at_our_epoch_ended_their_phase_for_it():
    done = [_at("a", 3, 3, 80), _at("b", 3, 3, 40)]
    assert round_under_way("me", 3, done, NOW, 30.0)
    # a straggler still computing for epoch 3 (its last phase ended at epoch 2) is itself late: it holds nobody back
    assert round_under_way("me", 3, [*done, _at("c", 3, 2, 80)], NOW, 30.0)
    # but while as many still compute for it as ended (or more), the epoch's group is not formed yet
    assert not round_under_way("me", 3, [*done, _at("c", 3, 2, 80), _at("d", 3, 2, 80)], NOW, 30.0)
    # a peer that committed epoch 2 and is about to start its phase for 3 computes for it
    assert not round_under_way("me", 3, [*done, _at("c", 3), _at("d", 3)], NOW, 30.0)
    # a peer at epoch 3 whose phase is for epoch 4 (waiting out this round too, or overlapping it) does not compute
    # for 3: two joiners waiting side by side must not hold each other back
    assert round_under_way("me", 3, [*done, _at("other joiner", 3, phase_epoch=4)], NOW, 30.0)
    assert not round_under_way("me", 3, [_at("other joiner", 3, phase_epoch=4), _at("c", 3, phase_epoch=4)], NOW, 30.0)


def test_a_lone_peer_that_ended_its_phase_waits_for_us_rather_than_averaging_without_us():
    # a run of two: the other ended its phase and waits for us in matchmaking (it never forms a group of one beside a
    # live trainer), so a round "without us" cannot happen: we train and join it
    assert not round_under_way("me", 3, [_at("a", 3, 3, 80)], NOW, 30.0)
    assert round_under_way("me", 3, [_at("a", 3, 3, 80), _at("b", 3, 3, 80)], NOW, 30.0)
    # nor below the run's min_group_size
    assert not round_under_way("me", 3, [_at("a", 3, 3, 80), _at("b", 3, 3, 80)], NOW, 30.0, min_group_size=3)


def test_no_round_is_under_way_with_nobody_else_at_our_epoch():
    assert not round_under_way("me", 3, [], NOW, 30.0)
    # others at another epoch (ahead: we download; behind: they download) and our own record do not count
    assert not round_under_way("me", 3, [_at("a", 4, 3, 80), _at("b", 2, 2, 80)], NOW, 30.0)
    assert not round_under_way("me", 3, [_at("me", 3, 3, 80)], NOW, 30.0)


def test_stale_paused_and_non_trainer_records_do_not_count_either_way():
    done = [_at("a", 3, 3, 80), _at("b", 3, 3, 80)]
    # a stale record of a peer still training, a paused peer, the coordinator: none of them holds the round back
    others = [_at("old", 3, 2, 80, age=31.0), _at("paused", 3, 2, 80, paused=True), _at("coord", 3, role="coordinator")]
    assert round_under_way("me", 3, done + others, NOW, 30.0)
    # and alone they make no round
    assert not round_under_way("me", 3, others, NOW, 30.0)


def test_the_round_to_wait_for_is_the_newest_epochs_when_we_are_behind():
    under_way = [_at("a", 3, 3, 80), _at("b", 3, 3, 80)]
    assert round_to_wait_for("me", 3, under_way, NOW, 30.0) == 3
    assert round_to_wait_for("me", 0, under_way, NOW, 30.0) == 3  # a joiner: not a state about to be replaced
    computing = [_at("a", 3, 2, 80), _at("b", 3, 2, 80)]
    assert round_to_wait_for("me", 0, computing, NOW, 30.0) is None
    # a stale record's epoch is not the swarm's
    assert round_to_wait_for("me", 0, [_at("old", 7, 7, 80, age=31.0), *under_way], NOW, 30.0) == 3


def test_a_failed_attempt_is_news_only_from_a_trainer_at_the_epoch_and_only_past_the_baseline():
    now = time.time()
    before = [peer_record("a", 3, now, rounds_failed=2), peer_record("b", 3, now)]
    baseline = failed_rounds(before)
    assert baseline == {"a": 2, "b": 0}
    assert not round_failed_since(baseline, 3, before)
    assert round_failed_since(baseline, 3, [peer_record("a", 3, now, rounds_failed=3)])
    assert not round_failed_since(baseline, 3, [peer_record("a", 4, now, rounds_failed=3)])  # it committed, moved on
    assert not round_failed_since(baseline, 3, [peer_record("c", 3, now, rounds_failed=5)])  # new: no baseline
    coordinator = peer_record("k", 3, now, role="coordinator", rounds_failed=9)
    assert not round_failed_since(failed_rounds([]), 3, [coordinator])
