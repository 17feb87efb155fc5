"""Probing persistent unbacked claims ahead of us (issue 28): when a claim is probed, and what a probe does."""

import torch

from hivetrain.diloco.adoption import Adoption
from hivetrain.diloco.probe import ProbePolicy, Prober, ProbeView, note_ahead, probe_target
from hivetrain.diloco.state import TrainingState
from tests.records import peer_record

NOW = 1000.0
POLICY = ProbePolicy(settle_s=10.0, every_s=30.0, vouch_s=600.0, stale_after_s=30.0)


def rec(peer, epoch, digest, age=0.0):
    return peer_record(peer, epoch, NOW - age, state_hash=digest)


def seen_since(peers, t):
    return dict.fromkeys(peers, t)


def test_two_liars_one_epoch_ahead_are_probed_once_they_persisted():
    records = [rec("b", 6, "h6"), rec("x", 7, "poison"), rec("y", 7, "poison")]
    fresh = ProbeView(ahead_since=seen_since("xy", NOW - 3))
    assert probe_target("me", 6, "h6", records, fresh, NOW, POLICY) is None, "seen ahead for 3 s: not yet"
    settled = ProbeView(ahead_since=seen_since("xy", NOW - 11))
    d = probe_target("me", 6, "h6", records, settled, NOW, POLICY)
    assert d is not None and d.action == "download"
    assert (d.target_epoch, d.state_hash, d.donors) == (7, "poison", ("x", "y"))


def test_one_probe_per_claim_none_for_vouched_holders_and_a_rate_limit():
    records = [rec("x", 7, "poison"), rec("y", 7, "poison")]
    base = dict(ahead_since=seen_since("xy", NOW - 60))
    assert probe_target("me", 6, "h6", records, ProbeView(**base), NOW, POLICY) is not None
    assert (
        probe_target("me", 6, "h6", records, ProbeView(**base, probed=frozenset({(7, "poison")})), NOW, POLICY) is None
    )
    vouched = ProbeView(**base, vouched={"y": NOW - 100})
    assert probe_target("me", 6, "h6", records, vouched, NOW, POLICY) is None
    expired = ProbeView(**base, vouched={"y": NOW - 700})
    assert probe_target("me", 6, "h6", records, expired, NOW, POLICY) is not None
    assert probe_target("me", 6, "h6", records, ProbeView(**base, last_probe=NOW - 5), NOW, POLICY) is None


def test_banned_stale_and_behind_claims_are_not_probed():
    records = [rec("x", 7, "poison", age=40), rec("y", 7, "poison"), rec("z", 5, "old")]
    view = ProbeView(banned=frozenset({"y"}), ahead_since=seen_since("xyz", NOW - 60))
    assert probe_target("me", 6, "h6", records, view, NOW, POLICY) is None


def test_the_newest_most_held_claim_is_probed():
    records = [rec("x", 8, "a"), rec("y", 8, "b"), rec("z", 8, "b"), rec("w", 7, "c")]
    view = ProbeView(ahead_since=seen_since("xyzw", NOW - 60))
    d = probe_target("me", 6, "h6", records, view, NOW, POLICY)
    assert d is not None and (d.target_epoch, d.state_hash, d.donors) == (8, "b", ("y", "z"))


def test_note_ahead_keeps_the_first_time_and_forgets_peers_behind_us_or_gone():
    since: dict[str, float] = {"gone": NOW - 50}
    note_ahead(since, "me", 6, [rec("x", 7, "p"), rec("b", 6, "h6"), rec("c", 5, "h5")], NOW - 20, 30.0)
    assert since == {"x": NOW - 20, "b": NOW - 20}
    # we committed epoch 7; x's record has not caught up (at our epoch): its wait goes on
    note_ahead(since, "me", 7, [rec("x", 7, "p"), rec("y", 8, "p"), rec("b", 6, "h6")], NOW - 5, 30.0)
    assert since == {"x": NOW - 20, "y": NOW - 5}


class FakeAdopter:
    """Stands in for ``StateAdopter``: passes or fails every state, counting the calls."""

    def __init__(self, passes: bool):
        self.passes, self.calls = passes, []

    def adopt(self, decision, records, ours, exclude):
        self.calls.append((decision, set(exclude)))
        if self.passes:
            return Adoption(ours)
        return Adoption(None, "state refused: far", ((decision.donors, "served a state far from ours"),))


def test_a_failed_probe_names_the_holders_to_ban_and_is_not_repeated():
    ours = TrainingState(epoch=6, params={"w": torch.zeros(2)}, momentum={"w": torch.zeros(2)})
    records = [rec("x", 7, "poison"), rec("y", 7, "poison")]
    adopter = FakeAdopter(passes=False)
    prober = Prober("me", adopter, POLICY)
    assert prober.maybe_probe(records, ours, "h6", frozenset(), NOW - 20) is None  # first seen ahead now
    result = prober.maybe_probe(records, ours, "h6", frozenset(), NOW)
    assert result is not None and not result.passed
    assert result.adoption.bans == ((("x", "y"), "served a state far from ours"),)
    assert adopter.calls[0][1] >= {"me", "x", "y"}
    banned = frozenset({"x", "y"})  # the caller banned them
    assert prober.maybe_probe(records, ours, "h6", banned, NOW + 100) is None, "probed once"
    assert len(adopter.calls) == 1


def test_a_colluder_that_shows_the_refuted_claim_later_is_banned_without_a_download():
    """Chaos ahead-liars-2v2, idle: one liar's record was live when the claim was probed and refused, its colluder's
    only later; the claim (epoch, sha256) names the refused bytes, so the colluder is banned as soon as it is seen."""
    ours = TrainingState(epoch=6, params={"w": torch.zeros(2)}, momentum={"w": torch.zeros(2)})
    adopter = FakeAdopter(passes=False)
    prober = Prober("me", adopter, POLICY)
    prober.maybe_probe([rec("x", 7, "poison")], ours, "h6", frozenset(), NOW - 20)
    assert prober.maybe_probe([rec("x", 7, "poison")], ours, "h6", frozenset(), NOW).decision.donors == ("x",)
    later = [rec("x", 7, "poison"), rec("y", 7, "poison"), rec("z", 7, "other")]
    caught = prober.maybe_probe(later, ours, "h6", frozenset({"x"}), NOW + 1)  # y first seen now: no settling
    assert caught is not None and not caught.passed and caught.decision.donors == ("y",)
    assert caught.adoption.bans[0][0] == ("y",) and "refused" in caught.adoption.bans[0][1]
    assert len(adopter.calls) == 1, "no second download"
    assert prober.maybe_probe(later, ours, "h6", frozenset({"x", "y"}), NOW + 2) is None  # z: not settled yet


def test_a_claim_that_yielded_no_evidence_bans_nobody_who_shows_it_later():
    ours = TrainingState(epoch=6, params={"w": torch.zeros(2)}, momentum={"w": torch.zeros(2)})

    class Unavailable(FakeAdopter):
        def adopt(self, decision, records, ours, exclude):
            self.calls.append((decision, set(exclude)))
            return Adoption(None, "state download failed: no donor answered", (((), ""),))

    prober = Prober("me", Unavailable(passes=False), POLICY)
    prober.maybe_probe([rec("x", 7, "h7")], ours, "h6", frozenset(), NOW - 20)
    assert not prober.maybe_probe([rec("x", 7, "h7")], ours, "h6", frozenset(), NOW).passed
    assert prober.maybe_probe([rec("x", 7, "h7"), rec("y", 7, "h7")], ours, "h6", frozenset(), NOW + 1) is None


def test_after_a_failed_probe_a_colluders_claim_is_probed_after_retry_s_not_every_s():
    ours = TrainingState(epoch=6, params={"w": torch.zeros(2)}, momentum={"w": torch.zeros(2)})
    records = [rec("x", 7, "poison"), rec("y", 7, "poison"), rec("z", 7, "poison-b")]
    adopter = FakeAdopter(passes=False)
    prober = Prober("me", adopter, POLICY)
    prober.maybe_probe(records, ours, "h6", frozenset(), NOW - 20)
    assert prober.maybe_probe(records, ours, "h6", frozenset(), NOW).decision.donors == ("x", "y")
    left = [r for r in records if r.peer_id == "z"]  # x and y are banned now
    assert prober.maybe_probe(left, ours, "h6", frozenset({"x", "y"}), NOW + 3) is None
    again = prober.maybe_probe(left, ours, "h6", frozenset({"x", "y"}), NOW + 6)
    assert again is not None and again.decision.donors == ("z",)


def test_a_passed_probe_vouches_for_its_holders_and_adopts_nothing():
    ours = TrainingState(epoch=6, params={"w": torch.zeros(2)}, momentum={"w": torch.zeros(2)})
    adopter = FakeAdopter(passes=True)
    prober = Prober("me", adopter, POLICY)
    prober.maybe_probe([rec("a", 7, "h7")], ours, "h6", frozenset(), NOW - 20)
    result = prober.maybe_probe([rec("a", 7, "h7")], ours, "h6", frozenset(), NOW)
    assert result is not None and result.passed and result.adoption.bans == ()
    later = [rec("a", 8, "h8")]  # the same honest minority, one epoch on: vouched for, not downloaded again
    assert prober.maybe_probe(later, ours, "h6", frozenset(), NOW + 40) is None
    assert len(adopter.calls) == 1


class RunNow:
    """Stands in for the ``LoopThread``: runs a coroutine to completion."""

    def run(self, coro, timeout_s=None):
        import asyncio

        return asyncio.run(coro)


def adopter_serving(state, steps, losses):
    """A ``StateAdopter`` whose download returns ``state`` and whose evaluation reads ``losses`` (id -> loss)."""
    from hivetrain.diloco.adoption import StateAdopter
    from hivetrain.diloco.drift import ParamSketcher
    from hivetrain.faults import NO_FAULTS

    return StateAdopter(
        RunNow(),
        lambda: None,
        "run",
        published=lambda: {},
        claims=lambda peers: {},
        evaluate=lambda s: losses["new" if s is state else "ours"],
        timeout_s=1.0,
        faults=NO_FAULTS,
        admits=None,
        join_check=None,
        sketcher=ParamSketcher({"w": (4,)}, 1),
        steps=steps,
        max_step_ratio=5.0,
        step_min_history=3,
    )


def test_the_adoption_refuses_a_state_far_beyond_one_step_from_ours_and_names_its_donors(monkeypatch):
    """θ moved by random weights x5 is refused on the step alone (before any evaluation), its donors named for a ban;
    a state one ordinary step on is adopted with its step reported. Without history the bound does not apply."""
    from hivetrain.diloco import adoption as module
    from hivetrain.diloco.sync_policy import SyncDecision
    from hivetrain.diloco.update_bound import UpdateNorms

    ours = TrainingState(epoch=6, params={"w": torch.zeros(4)}, momentum={"w": torch.zeros(4)})
    gen = torch.Generator().manual_seed(0)
    poison = TrainingState(epoch=7, params={"w": torch.randn(4, generator=gen) * 5}, momentum={"w": torch.zeros(4)})
    honest = TrainingState(epoch=7, params={"w": torch.full((4,), 0.05)}, momentum={"w": torch.zeros(4)})
    decision = SyncDecision("download", 7, ("x", "y"), "probe", state_hash="h")
    history = UpdateNorms(16)
    for norm in (0.1, 0.12, 0.09):
        history.add(norm)
    for served, refused in ((poison, True), (honest, False)):

        async def download(*args, served=served, **kwargs):
            return served

        monkeypatch.setattr(module, "download_state", download)
        got = adopter_serving(served, history, {"new": 2.0, "ours": 2.0}).adopt(decision, [], ours, {"me"})
        if refused:
            assert got.state is None and "per-epoch step to epoch 7" in got.failure
            assert (
                ("x", "y"),
                "served a state far from ours: " + got.failure.removeprefix("state refused: "),
            ) in got.bans
        else:
            assert got.state is honest and got.step == torch.full((4,), 0.05).norm().item()
    no_history = adopter_serving(poison, UpdateNorms(16), {"new": 2.0, "ours": 2.0})

    async def serve_poison(*args, **kwargs):
        return poison

    monkeypatch.setattr(module, "download_state", serve_poison)
    assert no_history.adopt(decision, [], ours, {"me"}).state is poison, "no history: the loss check decides"
    worse = adopter_serving(poison, UpdateNorms(16), {"new": 641.0, "ours": 2.7}).adopt(decision, [], ours, {"me"})
    assert worse.state is None and any("far worse than ours" in why for _, why in worse.bans)


def test_a_lie_at_our_own_epoch_is_probed_with_butterfly_only():
    """Right after our commit a liar's record still shows the epoch it claimed, now ours, with its poisoned hash."""
    records = [rec("b", 7, "h7"), rec("x", 7, "poison"), rec("y", 7, "poison")]
    view = ProbeView(ahead_since=seen_since("bxy", NOW - 60))
    d = probe_target("me", 7, "h7", records, view, NOW, POLICY)
    assert d is not None and (d.target_epoch, d.state_hash, d.donors, d.probe) == (7, "poison", ("x", "y"), True)
    assert probe_target("me", 7, "h7", records, view, NOW, POLICY, exact_average=False) is None
    assert probe_target("me", 7, "h7", [rec("b", 7, "h7")], view, NOW, POLICY) is None, "our own state"


def test_a_probe_accepts_only_the_hash_it_probes():
    from hivetrain.diloco.sync_policy import SyncDecision, download_hashes

    d = SyncDecision("download", 7, ("x",), "probe", state_hash="poison", probe=True)
    assert download_hashes({7: "h7", 6: "h6"}, d) == {7: "poison"}
    # the holder committed meanwhile and claims one epoch further with a new poisoned hash: that claim is signed too
    assert download_hashes({7: "h7"}, d, {8: "poison8"}) == {7: "poison", 8: "poison8"}


def test_a_probe_without_evidence_lets_the_next_claim_be_probed_sooner():
    """The holders moved on (their manifest no longer matches) or did not answer: that claim is not probed again,
    but the next one may be after ``retry_s`` instead of ``every_s``."""
    ours = TrainingState(epoch=6, params={"w": torch.zeros(2)}, momentum={"w": torch.zeros(2)})

    class NoAnswer(FakeAdopter):
        def adopt(self, decision, records, ours, exclude):
            self.calls.append((decision, set(exclude)))
            return Adoption(None, "none of 2 donor(s) offered a state whose hash peers published", (((), "x"),))

    adopter = NoAnswer(passes=False)
    prober = Prober("me", adopter, POLICY)
    prober.maybe_probe([rec("x", 7, "p7")], ours, "h6", frozenset(), NOW - 20)
    assert prober.maybe_probe([rec("x", 7, "p7")], ours, "h6", frozenset(), NOW) is not None
    assert prober.maybe_probe([rec("x", 7, "p7")], ours, "h6", frozenset(), NOW + 6) is None, "that claim: once"
    assert prober.maybe_probe([rec("x", 8, "p8")], ours, "h6", frozenset(), NOW + 3) is None, "not before retry_s"
    assert prober.maybe_probe([rec("x", 8, "p8")], ours, "h6", frozenset(), NOW + 6) is not None


def test_a_lagging_liars_claim_behind_us_still_contradicts_the_state_we_held_there():
    """Beside 2 hogs the liars' own epochs lag ours, so their "one epoch ahead" claims fall behind us at times: a
    hash other than the one we held at that epoch is still a claim to probe, and the liar's wait goes on."""
    history = {5: "h5", 6: "h6"}
    records = [rec("x", 5, "poison5"), rec("b", 5, "h5")]
    since: dict[str, float] = {}
    note_ahead(since, "me", 7, records, NOW - 20, 30.0, history)
    assert since == {"x": NOW - 20}, "b holds what we held at 5: not a claim"
    view = ProbeView(history=history, ahead_since=since)
    d = probe_target("me", 7, "h7", records, view, NOW, POLICY)
    assert d is not None and (d.target_epoch, d.state_hash, d.donors) == (5, "poison5", ("x",))
    assert "claim epoch 5 (poison5) where we held h5" in d.reason
    assert probe_target("me", 7, "h7", records, view, NOW, POLICY, exact_average=False) is None


def test_a_vouched_state_whose_loss_rose_is_adopted_and_an_unvouched_one_refused(monkeypatch):
    """Session 13, chaos ``pause-twice``: a peer asleep 15 s came back 6 epochs behind a swarm whose eval loss had
    really risen (2.325 on its windows against its stale 1.891). The coordinator and its seniors vouched for that
    state; the loss check refused it, banned both honest peers and the peer forked. A vouched state needs the step
    bound or the loss check; an unvouched one (a joiner's plain quorum, a probe, "unbacked") still needs both."""
    from hivetrain.diloco import adoption as module
    from hivetrain.diloco.sync_policy import SyncDecision
    from hivetrain.diloco.update_bound import UpdateNorms

    ours = TrainingState(epoch=10, params={"w": torch.zeros(4)}, momentum={"w": torch.zeros(4)})
    swarm = TrainingState(epoch=16, params={"w": torch.full((4,), 0.3)}, momentum={"w": torch.zeros(4)})
    far = TrainingState(epoch=16, params={"w": torch.full((4,), 30.0)}, momentum={"w": torch.zeros(4)})
    history = UpdateNorms(16)
    for norm in (0.1, 0.12, 0.09):
        history.add(norm)
    vouched = SyncDecision("download", 16, ("a", "coord"), "behind", state_hash="h16", vouched="the run's coordinator")
    plain = SyncDecision("download", 16, ("a", "b"), "behind", state_hash="h16")

    def adopt(served, decision, losses, steps=history):
        async def download(*args, **kwargs):
            return served

        monkeypatch.setattr(module, "download_state", download)
        return adopter_serving(served, steps, losses).adopt(decision, [], ours, {"me"})

    rose = {"new": 2.325, "ours": 1.891}
    got = adopt(swarm, vouched, rose)
    assert got.state is swarm and not any(donors for donors, _ in got.bans), "vouched, one step per epoch: adopted"
    refused = adopt(swarm, plain, rose)
    assert refused.state is None and (("a", "b"), refused.bans[-1][1]) in refused.bans
    assert "far worse than ours" in refused.bans[-1][1]
    # vouched but far beyond one step per epoch: the loss check decides, and a far worse state is refused and banned
    assert adopt(far, vouched, {"new": 1.8, "ours": 1.891}).state is far
    poisoned = adopt(far, vouched, {"new": 641.0, "ours": 2.7})
    assert poisoned.state is None and "per-epoch step" in poisoned.failure and "eval loss" in poisoned.failure
    assert poisoned.bans[-1][0] == ("a", "coord")
    # a broken state is refused even when vouched for, with or without a step history
    assert adopt(swarm, vouched, {"new": float("nan"), "ours": 1.891}).state is None
    assert adopt(swarm, vouched, {"new": float("inf"), "ours": 1.891}, UpdateNorms(16)).state is None
