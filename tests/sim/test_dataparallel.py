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


def test_more_peers_than_one_group_end_every_epoch_on_one_state() -> None:
    """20 peers in rows of at most 12 or 8 (2 or 3 rows): one declaration per epoch and the two-stage all-reduce
    (``averaging.hierarchical``), so every peer commits every epoch with the same θ: no drift, no fork, nothing
    discarded. Each peer sends at most about twice what one group of 20 would (rows, then columns)."""
    one = _summary(tiny())
    for rows in (12, 8):
        s = _summary(tiny(averaging={"target_group_size": rows}))
        assert s["group_size_max"] == 20 and s["outer_steps_done"] == 3
        assert s["drift_max"] < 1e-12 and s["committed_sample_share"] == 1.0 and s["discarded_sample_share"] == 0.0
        assert s["downloads"] == 0 and s["committed_states_max"] == 1
        assert one["bytes_per_peer_per_step"] < s["bytes_per_peer_per_step"] <= 2.2 * one["bytes_per_peer_per_step"]


def _declarations_of(group_size: int, **tables) -> dict:
    """The summary of a run whose declarations hold at most ``group_size`` members: the engine's ``MAX_MEMBERS``
    (4,096) scaled down, so that 20 peers reach what more than 4,096 do."""
    sim = DataParallelSim(tiny(**tables, averaging={"target_group_size": group_size}))
    sim.rounds.max_members = group_size
    s = dict(sim.run().summary)
    s.pop("wall_s")
    return s


def test_two_declarations_per_epoch_end_on_one_state_the_outweighed_one_downloads() -> None:
    """Past MAX_MEMBERS ready peers an epoch forms several declarations (here 20 peers, declarations of at most 12).
    Production refuses a round whose contributors do not outweigh the live trainers of their epoch, or one past it,
    outside it (``round_policy.group_holds_the_epoch``, the averager's ``accept``): the declaration of 8 is refused
    beside the 12, its members download the 12's state and drop their pseudo-gradients. So the swarm keeps one state
    per epoch (before the simulator modelled the rule it showed two, and the smaller one downloading afterwards)."""
    s = _declarations_of(12)
    assert s["group_size_max"] == 12 and s["outer_steps_done"] == 3
    assert s["committed_states_max"] == 1 and s["drift_max"] < 1e-12
    assert s["decisions"]["round.refused_outweighed"] > 0 and s["downloads"] > 0
    # the price: the refused declaration's samples (8 of 20 peers) are not in the model the swarm keeps
    assert 0.3 < s["lost_sample_shares"]["dropped by a resync"] < 0.45
    assert s["committed_sample_share"] + s["lost_sample_shares"]["dropped by a resync"] > 0.99


def test_three_declarations_per_epoch_commit_every_epoch_on_one_state() -> None:
    """Declarations of 8 for 20 peers: 8, 8 and 4 at every epoch. Before the rule was modelled they each committed
    and drifted apart for good; with it alone no declaration outweighed the other two and 600 simulated seconds passed
    with no outer step (marked as an expected failure until 2026-12-01). Now the declarations of an epoch are ranked
    (``matchmaking.EpochGroups``: more members, then the smaller smallest peer ID): the first commits, the others are
    refused and follow its result (``went_ahead``). The price: their samples, dropped by the download."""
    s = _declarations_of(8, sim={"outer_steps": 3, "max_sim_s": 600.0})
    assert s["outer_steps_done"] == 3 and s["committed_states_max"] == 1 and s["drift_max"] < 1e-12
    assert s["decisions"]["round.refused_outweighed"] > 0 and s["downloads"] > 0
    assert 0.4 < s["committed_sample_share"] < 0.6  # one declaration of 8 of 20 peers per epoch, and a little more
    assert s["committed_sample_share"] + s["lost_sample_shares"]["dropped by a resync"] > 0.99


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


def test_a_donor_cap_spreads_a_flash_crowd_over_more_donors() -> None:
    """30 joiners at once onto 20 peers (a 100 MB state: 7 chunks, so up to 7 donors per download): uncapped, the
    fastest links serve most of the crowd at once; with ``download.max_downloaders = 1`` a donor at its cap is
    skipped ("busy"), joiners wait for a free one when none is left, and the busiest donor serves a fraction of the
    share of the crowd's bytes it did. Every joiner still gets the state (each downloads again whenever it falls an
    epoch behind: waiting for a free donor makes that more frequent, so the share is compared, not the bytes). The
    crowd comes after the swarm's first outer step (~100 s), so every joiner needs the state: one that arrives during
    epoch 0 trains for it, its round held for it (``group_holds_the_epoch``), and downloads nothing."""

    def crowd(cap: int) -> tuple[dict, int, int]:
        sc = tiny(sim={"outer_steps": 8, "model_bytes": 50_000_000}, flash_crowd={"num_joiners": 30, "at_s": 120.0},
                  download={"max_downloaders": cap}, averaging={"round_timeout_s": 600.0})  # fmt: skip
        sim = DataParallelSim(sc)
        peak = [0]
        serve = sim.rounds.download_cost

        def watched(slot, donors, concurrent):  # the load on each donor as each download starts, this one included
            peak[0] = max(peak[0], int(concurrent.max()))
            return serve(slot, donors, concurrent)

        sim.rounds.download_cost = watched
        m = sim.run()
        joiners = len({d["slot"] for d in m.downloads if d["flash"]})
        share = m.summary["flash_max_donor_bytes"] / sum(m.flash_donor_bytes.values())
        return m.summary | {"busy": m.decisions.get("download.all_donors_busy", 0), "share": share}, peak[0], joiners

    free, free_peak, free_joiners = crowd(0)
    capped, capped_peak, capped_joiners = crowd(1)
    # every joiner got the state (one may be in a later download when the run ends: the swarm's epochs are short)
    assert free_joiners == capped_joiners == 30
    assert capped_peak == 1 < free_peak
    assert capped["busy"] > 0 and free["busy"] == 0
    assert capped["share"] < 0.5 * free["share"]


def test_a_member_leaving_mid_round_costs_only_its_own_samples_in_one_group() -> None:
    """Issue 23, item 2, as the averaging round now does it (``averaging.allreduce``): in one group a leaver is dropped
    and the others commit; all-or-nothing (``drop_failed = false``), every departure mid-round failed the round for
    all. 20 peers with 15 min sessions and a 100 MB pseudo-gradient (2 min rounds), 4 outer steps or 4,000 simulated
    seconds: members are dropped and the swarm commits most of what it computed in ~4.6 min per outer step; all or
    nothing, it never commits an outer step (2026-11-29 session 17: 0.52 against 0.0, 57 rounds failed for a death).
    Before slices were kept across attempts (a loss after the scatter cost a whole gather) the tolerant swarm
    committed 0.45."""
    churn = {"session": "exponential", "mean_session_s": 900.0}
    sim = {"model_bytes": 100_000_000, "outer_steps": 4, "max_sim_s": 4000.0}
    # a 100 MB round on home links takes ~2 min; equal slices, so that only the drop semantics differ (cut by upload
    # rate, the strict swarm's smaller retry groups run faster rounds and lose fewer: 0.67, session 22)
    fits = {"round_timeout_s": 600.0, "bandwidth_slices": False}
    one = _summary(tiny(sim=sim, churn=churn, averaging={**fits, "drop_failed": True}))
    strict = _summary(tiny(sim=sim, churn=churn, averaging={**fits, "drop_failed": False}))
    assert one["decisions"]["round.members_dropped"] > 10 and "round_failed.member died" not in one["decisions"]
    assert one["outer_steps_done"] == 4 and one["time_per_outer_step_s"] < 400
    assert strict["decisions"]["round_failed.member died"] > 10
    assert one["committed_sample_share"] > 0.4 > strict["committed_sample_share"]


def test_rounds_cut_by_measured_upload_rates_are_faster_on_uneven_home_links() -> None:
    """8 peers on home links of 10-100 Mbit/s up, a 100 MB pseudo-gradient: each round sends enough per link to measure
    upload rates, so production cuts its slices by them (``averaging.bandwidth_slices``) and the slowest uplink stops
    setting the round's time: 74 s per outer step against 120 s with equal slices (2026-11-30 session 22). 20 peers
    send too little per link to measure a rate (4 socket buffers per link): equal slices either way."""

    def step_s(num_peers: int, by_rate: bool) -> float:
        sim = {"num_peers": num_peers, "model_bytes": 100_000_000, "outer_steps": 3}
        s = _summary(tiny(sim=sim, averaging={"round_timeout_s": 600.0, "bandwidth_slices": by_rate}))
        assert s["outer_steps_done"] == 3 and s["committed_sample_share"] == 1.0
        return s["time_per_outer_step_s"]

    assert step_s(8, True) < 0.75 * step_s(8, False)
    assert step_s(20, True) == step_s(20, False)


def test_joiners_arriving_during_a_round_wait_for_it_instead_of_training_for_it(monkeypatch) -> None:
    """Rounds of a 20 MB model take ~45 s, so joiners under 10 min sessions often finish their download while their
    epoch's round is under way. They wait for it (``round_under_way``, as the trainer does) and train for the next
    epoch: no matchmaking answer is "late" and no sample is dropped by a resync. With the rule switched off, the same
    swarm's joiners train for a round they cannot join and drop those samples (fewer since a phase ends once most
    peers committed its round, ``schedule.decide_phase_end``: 0.6% of the samples instead of 2%, dev/LOG.md
    2026-11-30 session 22)."""
    scenario = tiny(
        churn={"session": "exponential", "mean_session_s": 600.0},
        sim={"model_bytes": 20_000_000, "outer_steps": 4},
        averaging={"round_timeout_s": 600.0},
    )
    waited = DataParallelSim(scenario).run()
    assert waited.decisions["round_wait"] > 0
    assert waited.decisions["round_failed.late"] == 0
    assert "dropped by a resync" not in waited.summary["lost_sample_shares"]
    assert waited.summary["outer_steps_done"] == 4 and waited.summary["committed_states_max"] == 1
    monkeypatch.setattr("hivetrain.sim.state_sync.round_under_way", lambda *args: False)
    trained = DataParallelSim(scenario).run()
    assert trained.decisions["round_failed.late"] > 0
    assert trained.summary["lost_sample_shares"]["dropped by a resync"] > 0.0
    assert waited.summary["committed_sample_share"] > trained.summary["committed_sample_share"]


def test_a_departed_leader_is_found_gone_after_the_declare_grace_as_followers_probe_it():
    """``Matchmaker.match``: a follower that waited on its leader's declaration past the declare grace probes the
    leader's data port and drops a leader that is gone. The simulator marks a departed peer whose entry would lead
    gone once it left that long ago (+ the 1 s probe); a live waiting peer ahead of it in id order leads instead."""
    from hivetrain.sim.rounds import RoundKey
    from hivetrain.sim.swarm_state import READY

    sim = DataParallelSim(tiny())
    st, engine = sim.state, sim.rounds
    for _ in range(4):
        sim._new_peer(READY)
    order = sorted(range(4), key=lambda s: st.peer_ids[s])
    ghost, follower, other = order[0], order[2], order[1]
    key = RoundKey(0)
    engine.keys[0] = key
    engine.store([ghost, follower, other], 10.0)
    st.i["status"][ghost], st.f["leaves_at"][ghost] = ABSENT, 11.0
    key.waiting.pop(ghost)
    me = key.waiting[follower]
    grace = engine.avg.declare_grace_s + 1.0
    entries = list(key.entries.values())
    assert engine._gone_leaders(key, entries, me, 11.0 + grace - 0.5) == frozenset()  # not probed yet
    assert engine._gone_leaders(key, entries, me, 11.0 + grace) == {st.peer_ids[ghost]}
    # a departed peer behind a live waiting one in id order leads nothing: nothing to probe
    late_ghost = order[3]
    engine.store([late_ghost], 10.0)
    st.i["status"][late_ghost], st.f["leaves_at"][late_ghost] = ABSENT, 11.0
    key.waiting.pop(late_ghost)
    assert st.peer_ids[late_ghost] not in engine._gone_leaders(key, list(key.entries.values()), me, 100.0)


def test_matchmaking_reads_are_bounded_by_the_read_budget_and_the_run_trains_the_same() -> None:
    """``averaging.matchmaking_read_kib_s`` in the simulator, as ``Matchmaker`` spaces its reads: a waiting peer reads
    its round key (20 entries, ~31 KB) at most that many KiB per second instead of every poll interval, so its
    matchmaking reads per outer step stay under budget x the time of an outer step; groups still form through the
    pushes, and the run trains the same."""
    free = _summary(tiny())
    tight = _summary(tiny(averaging={"matchmaking_read_kib_s": 1.0}))
    read = lambda s: s["dht_read_bytes_per_peer_per_step_by_key"]["matchmaking"]  # noqa: E731
    assert read(tight) <= 1024 * tight["time_per_outer_step_s"]
    assert read(tight) < read(free) / 50  # polled at 10 reads/s: ~31 KB each
    for s in (free, tight):
        assert s["outer_steps_done"] == 3 and s["committed_sample_share"] == 1.0 and s["committed_states_max"] == 1


def test_a_peer_told_late_withdraws_its_entry_and_leads_no_later_group():
    """``Matchmaker.match`` withdraws our entry on every failure verdict; so does the simulated peer. Before, a peer
    told "late" kept a live entry at its key until its deadline; with the smallest id it led every later group there,
    never declared one (it was not waiting), and its followers failed "no_group" after the grace (16,301 such verdicts
    in ``dp-1000-churn``, 8 outer steps)."""
    from hivetrain.averaging.matchmaking import GroupDeclaration, make_round_id
    from hivetrain.sim.rounds import RoundKey
    from hivetrain.sim.swarm_state import READY

    sim = DataParallelSim(tiny())
    st, engine = sim.state, sim.rounds
    for _ in range(3):
        sim._new_peer(READY)
    late, a, b = sorted(range(3), key=lambda s: st.peer_ids[s])
    key = RoundKey(0)
    engine.keys[0] = key
    engine.store([a, b], 10.0)
    members = tuple(sorted((key.waiting.pop(a), key.waiting.pop(b)), key=lambda e: e.peer_id))
    key.declare(GroupDeclaration.model_construct(
        leader=members[0].peer_id, round_key="e0", round_id=make_round_id("sim", "e0", members), members=members,
        declared_at=11.0, reason="window", signature=b"s" * 256))  # fmt: skip
    engine.announce([late], 12.0)  # the epoch's group closed before it announced
    assert sim.metrics.decisions["decide.late"] == 1 and late not in key.waiting
    assert key.entries[st.peer_ids[late]].deadline == 0.0  # withdrawn
    engine.store([a], 13.0)  # a's round failed and it announced again: that group is over, the epoch open again
    d = engine._decide(key, key.waiting[a], 13.5)
    assert d.action == "wait" and d.leader.peer_id == st.peer_ids[a]  # not the late peer's entry
