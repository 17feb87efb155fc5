"""RoundRunner: one round with its retries, against a scripted averager (no network).

All-or-nothing: a failed round returns no state and leaves the caller's state untouched; members given the same
average build bit-identical states; a contribution that did not commit is handed back, never dropped.
"""

import threading

import pytest
import torch
from hivemind.utils import get_dht_time

from hivetrain.averaging.base import RoundFailed, RoundResult
from hivetrain.config import RunConfig
from hivetrain.diloco.outer import outer_step
from hivetrain.diloco.rounds import Contribution, RoundRunner, expected_peers, patience_for
from hivetrain.diloco.state import TrainingState
from hivetrain.faults import NO_FAULTS, FaultInjector
from hivetrain.testing.byzantine import arm_byzantine
from tests.records import peer_record

CONFIG = RunConfig.from_dict({"averaging": {"max_retries": 1, "round_timeout_s": 20.0}})


def rec(peer, epoch, phase_epoch=None, digest="h"):
    phase_epoch = epoch if phase_epoch is None else phase_epoch
    return peer_record(peer, epoch, get_dht_time(), phase_epoch=phase_epoch, state_hash=digest)


class FakeView:
    def __init__(self, records, view_ok=True):
        self._records, self.view_ok, self.view_age_s, self.coverage = records, view_ok, 0.0, 1.0

    @property
    def records(self):
        return list(self._records)

    def refresh(self):
        return list(self._records)


class ScriptedAverager:
    """Returns or raises the scripted outcomes in order; records what it was called with. Like ``GroupAverager``
    (butterfly), a result is first offered to ``accept`` as one flat tensor; a refusal raises RoundFailed("refused")."""

    data_address = None  # no data port

    def __init__(self, *outcomes):
        self.outcomes, self.calls, self.patience, self.expected = list(outcomes), [], [], []

    def average(self, tensors, weight, epoch, timeout_s, expected_peers=frozenset(), accept=None, patience_s=0.0):
        self.expected.append(expected_peers)  # as given: a set, or a function asked at each matchmaking decision
        self.calls.append((weight, epoch, expected_peers() if callable(expected_peers) else expected_peers))
        self.patience.append(patience_s)
        outcome = self.outcomes.pop(0)
        if callable(outcome):
            outcome = outcome()
        if isinstance(outcome, Exception):
            raise outcome
        flat = torch.cat([t.reshape(-1) for t in outcome.tensors])
        refusal = accept(flat, tuple(sorted(outcome.group))) if accept is not None else ""
        if refusal:
            raise RoundFailed("refused", refusal)
        return outcome


def state() -> TrainingState:
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 2, generator=g)}
    return TrainingState(epoch=4, params=params, momentum={"w": torch.zeros(3, 2)})


def runner(averager, records, events=None, view_ok=True, faults=NO_FAULTS, config=CONFIG):
    emit = (lambda event, **f: events.append((event, f))) if events is not None else (lambda event, **f: None)
    return RoundRunner(
        "me",
        averager,
        FakeView(records, view_ok),
        config,
        faults,
        emit,
        threading.Event(),
        stale_after_s=30.0,
        dht_lost_after_s=60.0,
    )


def contribution(samples=80):
    return Contribution([torch.full((3, 2), 0.5)], samples, epoch=4)


def test_a_committed_round_builds_the_same_next_state_on_every_member():
    avg = [torch.full((3, 2), 0.25)]
    results = []
    for _ in range(2):  # two members given the same averaged bytes
        done = RoundResult(tensors=[a.clone() for a in avg], group=("a", "me"), total_weight=160.0, round_id="x")
        s = state()
        out = runner(ScriptedAverager(done), [rec("a", 4)]).run(s, s.state_hash(), contribution())
        assert out.policy.action == "apply" and out.state.epoch == 5
        assert out.state_hash == out.state.state_hash()
        results.append(out.state_hash)
    expected = outer_step(state(), avg, CONFIG.diloco.outer_lr, CONFIG.diloco.outer_momentum).state_hash()
    assert results[0] == results[1] == expected


def test_a_round_input_fault_changes_what_is_averaged_never_our_contribution():
    """A byzantine sign_flip peer (armed as a ``diloco.round_input`` call fault) averages -100 Δ at its own weight;
    the contribution it keeps (and would carry) is its honest Δ."""
    sent = []

    class Capturing(ScriptedAverager):
        def average(self, tensors, weight, epoch, timeout_s, expected_peers=frozenset(), accept=None, patience_s=0.0):
            sent.append(([t.clone() for t in tensors], weight))
            return super().average(tensors, weight, epoch, timeout_s, expected_peers, accept)

    faults = FaultInjector()
    (flip,) = arm_byzantine("sign_flip", faults, environ={})
    done = RoundResult([torch.zeros(3, 2)], ("a", "me"), 160.0, "x")
    mine, s = contribution(), state()
    out = runner(Capturing(done), [rec("a", 4)], faults=faults).run(s, s.state_hash(), mine)
    assert out.policy.action == "apply" and flip.fired == 1
    torch.testing.assert_close(sent[0][0][0], torch.full((3, 2), -50.0))
    assert sent[0][1] == 80.0
    torch.testing.assert_close(mine.delta[0], torch.full((3, 2), 0.5))


def test_after_a_stall_matchmaking_expects_whom_a_fresh_read_shows_not_the_view_from_before_it():
    """A peer woken from a SIGSTOP held a view from before it, showing the others at its epoch: it waited a whole round
    timeout for them while they committed 10 epochs (chaos pause-twice). A view older than two heartbeats is reread."""

    class StalledView(FakeView):
        def refresh(self):
            self._records = [rec("a", 6), rec("b", 6)]  # they moved on while we slept
            return list(self._records)

    done = RoundResult([torch.zeros(3, 2)], ("me",), 80.0, "x")
    for age, expected in ((0.0, frozenset({"a", "b"})), (16.0, frozenset())):
        avg = ScriptedAverager(done)
        run = runner(avg, [rec("a", 4), rec("b", 4)])
        run.view = StalledView([rec("a", 4), rec("b", 4)])
        run.view.view_age_s = age
        s = state()
        run.run(s, s.state_hash(), contribution())
        assert avg.calls[0][2] == expected


def test_matchmaking_asks_who_is_expected_from_the_view_as_it_is_then_not_as_it_was_at_the_start():
    """The refresh after a SIGSTOP can fail and keep the view from before it (a failed read keeps the last one): the
    woken peer expected two peers at its epoch and waited a whole round timeout for them while they ran 6 epochs
    ahead (chaos pause-twice beside 2 hogs, 1 in 20 runs). Matchmaking asks again at every decision; the heartbeat's
    next read shows them ahead, and they are no longer waited for."""
    avg = ScriptedAverager(RoundResult([torch.zeros(3, 2)], ("a", "b", "me"), 240.0, "x"))
    run = runner(avg, [rec("a", 4), rec("b", 4)])
    s = state()
    run.run(s, s.state_hash(), contribution())
    expected = avg.expected[0]
    assert callable(expected) and expected() == frozenset({"a", "b"})
    run.view._records = [rec("a", 10), rec("b", 10)]  # the heartbeat's next read
    assert expected() == frozenset()


def test_expected_peers_are_the_live_trainers_of_our_epoch():
    avg = ScriptedAverager(RoundResult([torch.zeros(3, 2)], ("a", "me"), 160.0, "x"))
    s = state()
    runner(avg, [rec("a", 4), rec("b", 3), rec("c", 5), rec("d", 2)]).run(s, s.state_hash(), contribution())
    assert avg.calls[0] == (80.0, 4, frozenset({"a", "b"}))  # b may not have published its epoch 4 yet
    # the group waits one step of the slowest of them (records: 1 sample/s, a step of 8 windows: 8 s), at most a
    # quarter of the round timeout
    timeout = CONFIG.averaging.round_timeout_s
    assert avg.patience[0] == patience_for([rec("a", 4), rec("b", 3)], frozenset("ab"), 4, 8, timeout) == timeout / 4
    assert expected_peers([rec("me", 4)], "me", 4, get_dht_time(), 30.0) == frozenset()


def test_the_group_waits_one_step_of_the_slowest_expected_peer_still_computing_at_most_the_cap():
    def peer(pid, throughput, done_epoch=0, done_samples=0):
        return rec(pid, 4).model_copy(
            update={"throughput": throughput, "phase_epoch": 4, "done_epoch": done_epoch, "done_samples": done_samples}
        )

    records = [peer("fast", 80.0), peer("starved", 2.0), peer("unknown", 0.0), peer("stranger", 0.5)]
    expected = frozenset({"fast", "starved", "unknown"})
    assert patience_for(records, expected, 4, 8, 30.0) == 4.0  # starved: 8 samples at 2 per second
    assert patience_for(records, expected, 4, 8, 12.0) == 3.0  # a claim of a slow step is bounded: 12 s / 4
    # a peer whose phase for epoch 4 ended only has to announce: the DHT grace covers that
    records[1] = peer("starved", 2.0, done_epoch=4, done_samples=8)
    assert patience_for(records, expected, 4, 8, 30.0) == 0.1
    assert patience_for(records, frozenset(), 4, 8, 30.0) == 0.0


def test_a_paused_peer_is_not_expected_but_one_whose_throughput_is_not_measured_yet_is():
    # A peer that just started (first phase, throughput 0 until a few steps are measured) will come: the group must
    # not close without it (an e2e run with 0.2 s phases lost a third peer that way, then its epoch). A peer whose
    # volunteer paused it will not.
    fresh = rec("fresh", 4).model_copy(update={"throughput": 0.0})
    paused = rec("paused", 4).model_copy(update={"throughput": 0.0, "paused": True})
    assert expected_peers([fresh, paused], "me", 4, get_dht_time(), 30.0) == frozenset({"fresh"})


def test_a_failed_round_applies_nothing_and_hands_the_contribution_back_when_others_moved_on():
    s = state()
    before = s.state_hash()
    events = []
    avg = ScriptedAverager(RoundFailed("not_in_group", "group of a closed before we announced"))
    out = runner(avg, [rec("a", 5, digest="h5"), rec("b", 5, digest="h5")], events).run(s, before, contribution())
    assert out.policy.action == "resync" and out.state is None and out.result is None
    assert s.state_hash() == before
    assert [e for e, _ in events] == ["round_failed"] and events[0][1]["reason"] == "not_in_group"


def test_a_late_peer_follows_the_group_that_closed_without_it_and_the_trainer_remembers_it():
    """As many peers behind at epoch 4 as ahead at 5: no quorum backs epoch 5. The engine's "late" names the group
    that closed without us; once its members hold epoch 5 we follow them (``decide_sync``'s closed_without_us), and
    the trainer's downloads learn of the group through ``note_closed_without_us``."""
    s = state()
    records = [rec(p, 5, digest="h5") for p in ("a", "b")] + [rec(p, 4, digest=s.state_hash()) for p in ("c", "d")]
    noted = []
    late = RoundFailed("not_in_group", "group of a closed before we announced", closed_without_us=frozenset("ab"))
    run = runner(ScriptedAverager(late), records)
    run.note_closed_without_us = lambda epoch, members: noted.append((epoch, members))
    out = run.run(s, s.state_hash(), contribution())
    assert out.policy.action == "resync" and "went on without us" in out.policy.reason
    assert noted == [(4, frozenset("ab"))]


def test_retries_then_carries_when_nobody_else_is_at_our_epoch():
    s = state()
    avg = ScriptedAverager(RoundFailed("peer_failed"), RoundFailed("peer_failed"))
    out = runner(avg, []).run(s, s.state_hash(), contribution())
    assert out.policy.action == "carry" and out.attempts == 2 and len(avg.calls) == 2


def test_a_round_of_one_is_not_applied_while_another_peer_computes_for_our_epoch():
    # with overlap, a peer whose state is still at epoch 3 may be computing its pseudo-gradient for round 4
    s = state()
    alone = RoundResult([torch.zeros(3, 2)], ("me",), 80.0, "x")
    r = runner(None, [rec("a", 3, phase_epoch=4)])

    def stop_waiting():  # past the retries the peer keeps waiting for it until the deadline: stop it here
        r.stop.set()
        return RoundFailed("no_group")

    r.averager = avg = ScriptedAverager(alone, alone, alone, stop_waiting)
    out = r.run(s, s.state_hash(), contribution())
    assert out.policy.action == "stop" and out.state is None and len(avg.calls) == 4
    assert r.rounds_failed == 4 and "no_group" in r.last_failure


def voted_failure(tensors, group=("a", "b", "me")):
    exc = RoundFailed("peer_failed", "waiting for votes: b closed the connection")
    exc.voted = RoundResult(tensors=tensors, group=group, total_weight=240.0, round_id="r")
    return exc


def test_a_round_that_failed_after_our_vote_is_applied_once_a_member_shows_it_committed():
    # The two-phase-commit gap: a and b received every vote and committed, our last vote never came. a's record at
    # epoch 5 carries the hash of the state the result we voted for gives: we apply it (no fork, no download).
    avg = [torch.full((3, 2), 0.25)]
    committed = outer_step(state(), avg, CONFIG.diloco.outer_lr, CONFIG.diloco.outer_momentum)
    events = []
    r = runner(ScriptedAverager(voted_failure(avg)), [rec("a", 5, digest=committed.state_hash())], events)
    s = state()
    out = r.run(s, s.state_hash(), contribution())
    assert out.policy.action == "apply" and out.attempts == 1
    assert out.state_hash == committed.state_hash() == out.state.state_hash() and out.state.epoch == 5
    assert out.result.round_id == "r" and r.rounds_failed == 0
    assert [e for e, _ in events] == ["round_recovered"]


def test_a_voted_round_without_evidence_of_a_commit_is_not_applied():
    # Nobody in the group shows the hash: only a peer outside it claims it, and b shows it at the wrong epoch.
    # Nothing is applied; the usual policy retries (c, at our epoch, keeps the lone-peer "unbacked" resync out).
    avg = [torch.full((3, 2), 0.25)]
    good = outer_step(state(), avg, CONFIG.diloco.outer_lr, CONFIG.diloco.outer_momentum).state_hash()
    records = [rec("outsider", 5, digest=good), rec("b", 3, digest=good), rec("c", 4)]
    r = runner(None, records)

    def stop_retrying():
        r.stop.set()
        return RoundFailed("no_group")

    r.averager = ScriptedAverager(voted_failure(avg), stop_retrying)
    s = state()
    out = r.run(s, s.state_hash(), contribution())
    assert out.state is None and out.policy.action == "stop" and out.attempts == 2
    assert r.rounds_failed == 2 and s.state_hash() == state().state_hash()


def test_merged_contributions_average_pseudo_gradients_by_samples_sum_weights_and_keep_the_older_epoch():
    old = Contribution([torch.ones(2)], 8, epoch=3)
    new = Contribution([torch.full((2,), 2.0)], 16, epoch=4)
    merged = new.merged(old)
    torch.testing.assert_close(merged.delta[0], torch.full((2,), (8 * 1.0 + 16 * 2.0) / 24))
    assert merged.samples == 24 and merged.epoch == 3 and merged.phases == (old, new)
    assert new.merged(None) is new
    assert merged.without_oldest(1) is new and merged.without_oldest(2) is None


def test_a_non_finite_pseudo_gradient_is_refused_before_it_is_sent():
    s = state()
    bad = Contribution([torch.full((3, 2), float("nan"))], 8, epoch=4)
    moshpit = RunConfig.from_dict({"averaging": {"strategy": "moshpit", "target_group_size": 2}})
    r = runner(ScriptedAverager(), [])
    r.config, r.exact_average = moshpit, False
    with pytest.raises(ValueError, match="not finite"):
        r.run(s, s.state_hash(), bad)


def test_an_update_50x_the_recent_median_is_refused_like_a_failed_round_and_applied_nowhere():
    """The bound on every outer step (``update_bound``): with 3 committed norms of 1 in the history, a round whose
    averaged Δ̄ has norm 50 is refused inside the averager's commit (``accept``): nothing is applied, the failure is
    logged with reason "refused" and the numbers, the history is unchanged; a normal round then applies and reports
    its norm."""
    events = []
    r = runner(None, [rec("a", 4)], events)
    for _ in range(3):
        r.norms.add(1.0)
    huge = RoundResult(tensors=[torch.full((3, 2), 50.0 / 6**0.5)], group=("a", "me"), total_weight=160.0, round_id="x")

    def stop_retrying():
        r.stop.set()
        return RoundFailed("no_group")

    r.averager = ScriptedAverager(huge, stop_retrying)
    s = state()
    out = r.run(s, s.state_hash(), contribution())
    assert out.state is None and out.policy.action == "stop" and s.state_hash() == state().state_hash()
    failed = [f for e, f in events if e == "round_failed"]
    assert failed[0]["reason"] == "refused" and "50.0x the median 1 of the last 3" in failed[0]["detail"]
    assert failed[0]["next"] == "retry" and r.norms.history == (1.0, 1.0, 1.0)

    r.stop.clear()
    sane = RoundResult(tensors=[torch.full((3, 2), 2.0 / 6**0.5)], group=("a", "me"), total_weight=160.0, round_id="y")
    r.averager = ScriptedAverager(sane)
    out = r.run(s, s.state_hash(), contribution())
    assert out.policy.action == "apply" and out.update_norm == pytest.approx(2.0)
    assert r.norms.history == pytest.approx((1.0, 1.0, 1.0, 2.0))


def test_moshpit_bounds_each_peers_own_applied_step():
    """Moshpit/gossip: groups end with different θ, so each peer checks its own step θ_new − θ_old and, refusing it,
    keeps its θ (a failed round for it alone)."""
    moshpit = RunConfig.from_dict({"averaging": {"strategy": "moshpit", "target_group_size": 2, "max_retries": 0}})
    events = []
    r = runner(None, [], events, config=moshpit)
    r.exact_average = False
    for _ in range(3):
        r.norms.add(1.0)
    s = state()
    far = RoundResult(tensors=[s.params["w"] + 100.0], group=("a", "me"), total_weight=160.0, round_id="x")
    r.averager = ScriptedAverager(far)
    out = r.run(s, s.state_hash(), contribution())
    assert out.state is None and out.policy.action == "carry"
    assert [f["reason"] for e, f in events if e == "round_failed"] == ["refused"]
    near = RoundResult(tensors=[s.params["w"] + 0.1], group=("a", "me"), total_weight=160.0, round_id="y")
    r.averager = ScriptedAverager(near)
    out = r.run(s, s.state_hash(), contribution())
    assert out.policy.action == "apply" and out.update_norm == pytest.approx(0.1 * 6**0.5, rel=1e-5)


def test_a_round_outranked_by_another_declaration_is_refused_and_follows_that_declaration():
    """Several declarations at our epoch (``EpochGroups``): one that outranks ours refuses our result, and its members
    are whose result we follow once they hold the next epoch (``note_closed_without_us``)."""
    from hivetrain.averaging.matchmaking import EpochGroups

    records = [rec(p, 4) for p in ("a", "b", "c", "me")]
    run = runner(ScriptedAverager(), records)
    run._epoch = 4
    flat = torch.zeros(6)
    bigger = EpochGroups(frozenset({"a", "me"}), (frozenset({"b", "c", "x"}),))
    refusal = run._accept(flat, ("a", "me"), epoch_groups=bigger)
    assert "outranks ours" in refusal and run._went_ahead == {"b", "c", "x"}
    # ours ties with {b, c} in size and has the smaller smallest ID: b and c follow us, so only d is outside
    run = runner(ScriptedAverager(), [*records, rec("d", 4)])
    run._epoch = 4
    assert "outside it" in run._accept(flat, ("a", "me"))  # 2 against b, c and d
    tied = EpochGroups(frozenset({"a", "me"}), (frozenset({"b", "c"}),))
    assert run._accept(flat, ("a", "me"), epoch_groups=tied) == ""


def test_the_runner_gives_the_averager_the_views_shard_levels():
    """A ``GroupAverager`` stores and reads its matchmaking entries at the swarm's record levels (``entry_shards``):
    the runner hands it the view's, asked afresh at every call (a level change reaches the next announce)."""
    avg = ScriptedAverager()
    avg.record_levels = lambda: (0,)
    view = FakeView([])
    view.shard_levels = [4]
    RoundRunner("me", avg, view, CONFIG, NO_FAULTS, lambda event, **f: None, threading.Event(), stale_after_s=30.0,
                dht_lost_after_s=60.0)  # fmt: skip
    assert list(avg.record_levels()) == [4]
    view.shard_levels = [5, 4]
    assert list(avg.record_levels()) == [5, 4]
