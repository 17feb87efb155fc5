"""Report figures and invariants computed from synthetic peer records; the plot is written and readable."""

from hivetrain.chaos.facts import PeerRun, lost_samples
from hivetrain.chaos.plot import plot_run
from hivetrain.chaos.report import build_report, format_summary
from hivetrain.chaos.scenario import parse_scenario

SCENARIO = parse_scenario(
    {
        "name": "t",
        "description": "kill one",
        "peers": 3,
        "max_duration_s": 100,
        "max_rss_growth_mb": 100,
        "run": {"diloco": {"inner_steps": 10, "outer_steps": 3}},
        "faults": [{"kind": "kill", "peer": 2, "at_s": 12}],
    }
)


def ev(kind, t, epoch, **kw):
    return {"event": kind, "t_s": t, "epoch": epoch, "state_hash": kw.pop("h", f"h{epoch}"), **kw}


def honest_peer(name, index, hashes=None, final_loss=3.0):
    hashes = hashes or {"0": "h0", "1": "h1", "2": "h2", "3": "h3"}
    events = [ev("start", 1.0, 0, eval_loss=5.0)]
    for epoch in (1, 2, 3):
        events += [ev("inner_phase", 10.0 * epoch - 2, epoch - 1, samples=80), ev("outer_step", 10.0 * epoch, epoch)]
    return PeerRun(
        name=name,
        index=index,
        exit_code=0,
        exited_at_s=31.0,
        events=events,
        summary={"epoch": 3, "state_hashes": hashes, "final_eval_loss": final_loss},
        rss=[(5.0, 100 * 2**20), (10.0, 150 * 2**20), (30.0, 160 * 2**20)],
    )


def killed_peer():
    events = [ev("start", 1.0, 0, eval_loss=5.0), ev("inner_phase", 8.0, 0, samples=80), ev("outer_step", 10.0, 1)]
    events.append(ev("inner_phase", 11.5, 1, samples=80))  # never committed: killed at 12 s
    return PeerRun(name="peer2", index=2, exit_code=-9, exited_at_s=12.2, killed=True, events=events)


def fault_log():
    return [{"index": 0, "kind": "kill", "label": "kill peer2", "fired_at_s": 12.0, "ended_at_s": None}]


def report_of(peers, **kw):
    args = dict(wall_s=35.0, timed_out=False, leftover_pids=[], checkpoints=[])
    args.update(kw)
    return build_report(SCENARIO, peers, fault_log(), **args)


def test_clean_run_passes_with_figures():
    report = report_of([honest_peer("peer0", 0), honest_peer("peer1", 1), killed_peer()])
    assert report["passed"], report["invariants"]
    fig = report["figures"]
    assert fig["outer_steps_committed"] == 3
    assert fig["longest_gap_s"] == 10.0  # start at 1 s, commits at 10, 20, 30 -> gaps 9, 10, 10
    assert report["faults"][0]["recovery_s"] == 8.0  # killed at 12 s, next commit at 20 s
    assert report["faults"][0]["samples_lost"] == 80
    assert fig["samples_lost"] == 80 and report["diverged_peers"] == []
    assert fig["rss_growth_mib"]["peer0"] == 10.0  # from the first commit at 10 s: 150 -> 160 MiB
    assert "PASSED" in format_summary(report)


def test_diverged_survivor_breaks_hash_invariants():
    forked = honest_peer("peer1", 1, hashes={"0": "h0", "1": "h1", "2": "X", "3": "h3"})
    report = report_of([honest_peer("peer0", 0), forked, honest_peer("peer3", 3)])
    assert not report["passed"]
    assert report["invariants"]["state_hashes_agree"] is False
    assert report["diverged_peers"] == ["peer1"]
    assert report["hash_disagreements"] == {"2": ["X", "h2"]}


def test_moshpit_peers_holding_different_states_are_not_diverged():
    """With moshpit groups peers of an epoch hold different states by design: no hash invariant applies there."""
    raw = SCENARIO.model_dump(mode="json")
    moshpit = parse_scenario({**raw, "run": {**raw["run"], "averaging": {"strategy": "moshpit"}}})
    apart = honest_peer("peer1", 1, hashes={"0": "h0", "1": "Y1", "2": "Y2", "3": "Y3"})
    peers = [honest_peer("peer0", 0), apart, honest_peer("peer3", 3)]
    report = build_report(moshpit, peers, fault_log(), wall_s=35.0, timed_out=False, leftover_pids=[], checkpoints=[])
    assert "state_hashes_agree" not in report["invariants"] and report["diverged_peers"] == []
    assert report_of(peers)["diverged_peers"] == ["peer1"]  # the same peers in a butterfly run: diverged


def test_byzantine_peer_is_not_counted_as_diverged():
    bad = honest_peer("peer2", 2, hashes={"0": "h0", "1": "bad", "2": "bad", "3": "bad"})
    bad.byzantine = "nan"
    report = report_of([honest_peer("peer0", 0), honest_peer("peer1", 1), bad])
    assert report["invariants"]["state_hashes_agree"] and report["diverged_peers"] == []


def test_each_invariant_can_fail():
    peers = [honest_peer("peer0", 0, final_loss=6.0), honest_peer("peer1", 1, final_loss=6.0)]
    peers[1].rss.append((31.0, 400 * 2**20))
    report = build_report(
        SCENARIO,
        peers,
        [{"index": 0, "kind": "kill", "label": "k", "fired_at_s": None, "ended_at_s": None}],
        wall_s=100.0,
        timed_out=True,
        leftover_pids=[4242],
        checkpoints=[{"path": "x", "epoch": 3, "status": "torn", "reason": "no manifest"}],
    )
    broken = {k for k, ok in report["invariants"].items() if not ok}
    assert broken == {
        "eval_loss_decreased",
        "finished",
        "no_leftover_processes",
        "no_torn_checkpoint",
        "rss_growth_bounded",
        "faults_fired",
    }
    assert not report["passed"] and "FAIL finished" in format_summary(report)


def test_lost_samples_counts_discarded_and_replaced_phases():
    peer = PeerRun(
        name="p",
        index=0,
        events=[
            ev("inner_phase", 1.0, 0, samples=10),
            ev("pseudo_gradient_discarded", 2.0, 0),
            ev("inner_phase", 3.0, 0, samples=20),
            ev("state_downloaded", 4.0, 2),
            ev("inner_phase", 5.0, 2, samples=30),
            ev("outer_step", 6.0, 3),
        ],
    )
    assert [(t, n) for t, n, _ in lost_samples([peer])] == [(2.0, 10), (4.0, 20)]


def test_plot_is_written(tmp_path):
    peers = [honest_peer("peer0", 0), honest_peer("peer1", 1), killed_peer()]
    report = report_of(peers)
    path = plot_run(report, peers, tmp_path / "plot.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000


def test_peers_that_left_are_named_with_when_and_why():
    lost = honest_peer("peer1", 1)
    lost.events = lost.events[:3]  # committed epoch 1, then lost the DHT
    lost.exit_code, lost.exited_at_s = 4, 14.26
    lost.summary = {"peer_id": "QmLost", "epoch": 1, "state_hashes": {"0": "h0", "1": "h1"}}
    lost.reason = "lost the DHT: could not read the swarm for 72s (did the p2pd daemon die?)"
    report = report_of([honest_peer("peer0", 0), lost, killed_peer()])
    assert report["peers_left"] == [
        {
            "name": "peer2",
            "peer_id": "",
            "exit_code": -9,
            "epoch": 1,
            "at_s": 12.2,
            "reason": "exit code -9 (hit by a fault on purpose)",
        },
        {"name": "peer1", "peer_id": "QmLost", "exit_code": 4, "epoch": 1, "at_s": 14.3, "reason": lost.reason},
    ]
    text = format_summary(report)
    assert "peers that left:" in text and "peer1      exit    4 at   14.3 s, epoch 1: lost the DHT" in text


ATTACK = parse_scenario(
    {
        "name": "t2",
        "description": "attacks of issue 12",
        "peers": 2,
        "max_duration_s": 100,
        "every_peer_commits": True,
        "max_join_download_s": 10,
        "run": {"diloco": {"inner_steps": 10, "outer_steps": 3}},
        "faults": [{"kind": "join", "at_s": 12}, {"kind": "forge_record", "at_s": 5, "probe_after_s": 10}],
    }
)


def joiner(download_at_s=16.0, h="h1"):
    events = [ev("start", 13.0, 0, eval_loss=5.0), ev("state_downloaded", download_at_s, 1, h=h)]
    events += [ev("inner_phase", 18.0, 1, samples=80), ev("outer_step", 20.0, 2), ev("outer_step", 30.0, 3)]
    return PeerRun(
        name="peer2",
        index=2,
        exit_code=0,
        exited_at_s=31.0,
        events=events,
        summary={"epoch": 3, "state_hashes": {"1": h, "2": "h2", "3": "h3"}, "final_eval_loss": 3.0},
    )


def probes(final_records=(), mid_ok=True):
    mid = {"at_s": 20.0, "final": False, "ok": mid_ok, "records": [{"peer_id": "Qm0", "epoch": 2, "expires_in_s": 29}]}
    end = {"at_s": 40.0, "final": True, "ok": True, "records": list(final_records)}
    return [mid if mid_ok else {"at_s": 20.0, "final": False, "ok": False, "error": "TimeoutError"}, end]


def attack_report(peers, **kw):
    args = dict(wall_s=35.0, timed_out=False, leftover_pids=[], checkpoints=[], dht_probes=probes())
    args.update(kw)
    faults = [
        {"index": 0, "kind": "join", "label": "j", "fired_at_s": 12.0, "ended_at_s": None},
        {"index": 1, "kind": "forge_record", "label": "f", "fired_at_s": 5.0, "ended_at_s": 15.0},
    ]
    return build_report(ATTACK, peers, faults, **args)


def test_attack_invariants_hold_on_a_clean_run():
    report = attack_report([honest_peer("peer0", 0), honest_peer("peer1", 1), joiner()])
    assert report["passed"], report["invariants"]
    assert {"no_unverified_state", "every_peer_kept_committing", "joiners_synced_in_time", "dht_clean"} <= set(
        report["invariants"]
    )
    assert report["join_sync_s"] == {"peer2": 3.0}
    text = format_summary(report)
    assert "joiners' state sync (s)   peer2 3.0" in text and "DHT probe at 40.000 s (end): 0 records" in text


def test_attack_invariants_are_absent_when_not_asked_for():
    report = report_of([honest_peer("peer0", 0), honest_peer("peer1", 1)])
    assert "no_unverified_state" in report["invariants"]  # always checked
    assert not {"every_peer_kept_committing", "joiners_synced_in_time", "dht_clean"} & set(report["invariants"])


def test_adopting_a_state_no_honest_peer_committed_breaks_no_unverified_state():
    lied = joiner(h="random-weights")
    report = attack_report([honest_peer("peer0", 0), honest_peer("peer1", 1), lied])
    assert report["invariants"]["no_unverified_state"] is False
    assert report["unverified_states"] == ["peer2 downloaded epoch 1 (random-weigh), which no honest peer committed"]
    far = honest_peer("peer1", 1)
    far.events.append(ev("state_downloaded", 31.0, 100_000, h="lie"))
    report = attack_report([honest_peer("peer0", 0), far, joiner()], coordinator_epochs=[1, 2, 100_000])
    assert len(report["unverified_states"]) == 3  # the download, the epoch reached, the coordinator's download
    assert "the coordinator downloaded epoch 100000" in report["unverified_states"][2]


def test_a_lie_the_byzantine_peer_itself_committed_does_not_verify_a_download():
    liar = honest_peer("peer1", 1)
    liar.byzantine = "epoch_liar"
    liar.events.append(ev("outer_step", 30.5, 1, h="random-weights"))
    report = attack_report([honest_peer("peer0", 0), liar, joiner(h="random-weights")])
    assert report["invariants"]["no_unverified_state"] is False


def test_a_peer_that_missed_an_epoch_or_resynced_breaks_every_peer_kept_committing():
    stalled = honest_peer("peer1", 1)
    stalled.events = [e for e in stalled.events if not (e["event"] == "outer_step" and e["epoch"] == 2)]
    stalled.events.append(ev("state_downloaded", 21.0, 2, reason="behind: 2 peers hold epoch 2"))
    report = attack_report([honest_peer("peer0", 0), stalled, joiner()])
    assert report["invariants"]["every_peer_kept_committing"] is False
    assert report["missed_commits"] == {
        "peer1": "epochs without a commit [2], downloaded state at epoch 2 at 21.0s (behind: 2 peers hold epoch 2)"
    }
    assert report["invariants"]["no_unverified_state"]  # it downloaded what peer0 committed


def test_a_slow_or_never_synced_joiner_breaks_joiners_synced_in_time():
    report = attack_report([honest_peer("peer0", 0), honest_peer("peer1", 1), joiner(download_at_s=24.0)])
    assert report["invariants"]["joiners_synced_in_time"] is False and report["join_sync_s"] == {"peer2": 11.0}
    never = joiner()
    never.events = never.events[:1]
    report = attack_report([honest_peer("peer0", 0), honest_peer("peer1", 1), never])
    assert report["invariants"]["joiners_synced_in_time"] is False and report["join_sync_s"] == {"peer2": None}


def test_a_forged_record_left_in_the_dht_or_an_unanswered_probe_breaks_dht_clean():
    peers = [honest_peer("peer0", 0), honest_peer("peer1", 1), joiner()]
    forged = {"peer_id": "QmBad", "epoch": 10**9, "expires_in_s": 1e9}
    report = attack_report(peers, dht_probes=probes(final_records=[forged]))
    assert report["invariants"]["dht_clean"] is False and report["dht_probes"][1]["leftovers"] == [forged]
    long_lived = {"peer_id": "QmBad", "epoch": 1, "expires_in_s": 5000.0}  # a plausible epoch, a far expiration
    assert attack_report(peers, dht_probes=probes(final_records=[long_lived]))["invariants"]["dht_clean"] is False
    assert attack_report(peers, dht_probes=probes(mid_ok=False))["invariants"]["dht_clean"] is False
    assert attack_report(peers, dht_probes=probes()[:1])["invariants"]["dht_clean"] is False  # no end-of-run probe


UNINVITED = parse_scenario(
    {
        "name": "u",
        "description": "uninvited",
        "peers": 3,
        "max_duration_s": 100,
        "run": {"diloco": {"inner_steps": 10, "outer_steps": 3}, "admission": {"mode": "token"}},
        "faults": [{"kind": "byzantine", "peer": 2, "mode": "uninvited"}],
    }
)
OUTSIDER = "QmOutsider"


def uninvited_peer(*extra, requests=()):
    events = [ev("start", 1.0, 0, peer=OUTSIDER), ev("inner_phase", 8.0, 0, samples=80, peer=OUTSIDER)]
    events += [ev("round_failed", 9.0, 0, peer=OUTSIDER), *extra]
    run = PeerRun(name="peer2", index=2, byzantine="uninvited", peer_id=OUTSIDER, events=events)
    run.state_requests_from = list(requests)
    return run


def uninvited_report(peers):
    faults = [{"index": 0, "kind": "byzantine", "label": "u", "fired_at_s": 0.5, "ended_at_s": None}]
    return build_report(UNINVITED, peers, faults, wall_s=35.0, timed_out=False, leftover_pids=[], checkpoints=[])


def members(seen=2, excluded=()):
    peers = [honest_peer("peer0", 0), honest_peer("peer1", 1)]
    for p in peers:
        for e in p.events:
            e["peers_seen"] = seen
            if e["event"] == "outer_step":
                e["excluded"] = list(excluded)
    return peers


NAMES = (
    "uninvited_peer_tried",
    "uninvited_never_grouped",
    "uninvited_record_unseen",
    "uninvited_served_no_state",
    "uninvited_got_no_state",
)


def test_uninvited_invariants_hold_when_the_outsider_is_kept_out():
    report = uninvited_report([*members(), uninvited_peer()])
    assert report["passed"], report["invariants"]
    assert set(NAMES) <= set(report["invariants"])
    assert not set(NAMES) & set(report_of([honest_peer("peer0", 0)])["invariants"])  # asked for only then


def test_each_uninvited_invariant_fails_on_the_run_it_names():
    def failed(peers):
        report = uninvited_report(peers)
        assert "uninvited" in format_summary(report)
        return {name for name in NAMES if not report["invariants"][name]}

    # a group of 2 with the outsider, seen from its side and from a member's (which excluded it)
    assert failed([*members(), uninvited_peer(ev("outer_step", 10.0, 1, group_size=2))]) == {NAMES[1]}
    assert failed([*members(excluded=[OUTSIDER]), uninvited_peer()]) == {NAMES[1]}
    # a member counted 3 trainers with 2 members launched: the outsider's record reached its view
    assert failed([*members(seen=3), uninvited_peer()]) == {NAMES[2]}
    # a member (or the coordinator) opened a state stream to it
    assert failed([*members(), uninvited_peer(requests=["peer1", "coordinator"])]) == {NAMES[3]}
    # someone (the coordinator, before 2026-11-25) served it the run's state
    assert failed([*members(), uninvited_peer(ev("state_downloaded", 9.0, 4))]) == {NAMES[4]}
    # the outsider never attacked (e.g. it exited at its refusal): nothing above would mean anything
    quiet = PeerRun(name="peer2", index=2, byzantine="uninvited", exit_code=3, events=[ev("start", 1.0, 0)])
    assert failed([*members(), quiet]) == {NAMES[0]}
    assert failed(members()) == {NAMES[0]}  # never launched
