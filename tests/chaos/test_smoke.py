"""CI smoke suite: a few short bundled scenarios against real processes; any broken invariant fails the test.

Each runs a coordinator and 3-4 join-swarm peers (tiny model) on 127.0.0.1 for about a minute. The runner kills every
process group it started before returning, whatever happened; the test checks that too.
"""

import json
import re

import pytest

from hivetrain.chaos.runner import run_scenario
from hivetrain.chaos.scenario import bundled_scenarios, load_scenario
from hivetrain.localswarm.summary import read_events

SMOKE = (
    "kill-one-of-four", "pause-twice", "nan-peer", "nat-peer", "record-and-flood", "lost-vote", "moshpit-hash-liar",
    "cpu-starve", "joiner-restart-2peer", "ahead-liars-2v2",
)  # fmt: skip
"""pause-twice is pause-mid-round and pause-mid-allreduce in one run, record-and-flood far-future-record and
dataplane-flood (each ~50-80 s of the suite's time, mostly starting processes); the four stay bundled.
rows-and-columns-kill (the two-stage grid with 9 peers, a member SIGKILLed while matching and one that dies in its
column round) is not in the list yet: beside 2 CPU hogs it failed 1 of 2 runs (2026-11-30 session 21), a busy peer
finishing its phase after its epoch's declaration closed; that product fix comes first."""

SMOKE_TIMEOUT_S = 330
TEARDOWN_S = 45  # the runner's teardown and report after max_duration_s (stacks, SIGTERM grace, probes, plot)


@pytest.mark.slow
@pytest.mark.timeout(SMOKE_TIMEOUT_S)
@pytest.mark.parametrize("name", SMOKE)
def test_smoke_scenario_passes(name, tmp_path):
    scenario = load_scenario(bundled_scenarios()[name])
    # the runner's own time limit must come first: it dumps every process's stacks and the report names the hang
    assert scenario.max_duration_s + TEARDOWN_S <= SMOKE_TIMEOUT_S, scenario.max_duration_s
    lines: list[str] = []
    report = run_scenario(scenario, tmp_path, log=lines.append)
    log = "\n".join(lines)
    assert report["passed"], (
        f"broken invariants {report['invariants']}\n{(tmp_path / 'summary.txt').read_text()}\n{log}\n"
        f"{_decisions(tmp_path)}"
    )
    assert json.loads((tmp_path / "report.json").read_text())["passed"] is True
    assert (tmp_path / "plot.png").stat().st_size > 20_000
    assert all(f["fired_at_s"] is not None for f in report["faults"])
    assert report["figures"]["outer_steps_committed"] == scenario.run_config().diloco.outer_steps
    assert report["diverged_peers"] == [] and report["leftover_pids"] == []
    if scenario.run_config().averaging.exact_average:  # the coordinator followed the run to its end (its events)
        adopted = [e["epoch"] for e in read_events(tmp_path / "coordinator.jsonl") if e["event"] == "state_downloaded"]
        assert adopted and max(adopted) == scenario.run_config().diloco.outer_steps, adopted
    if name == "kill-one-of-four":
        assert report["faults"][0]["recovery_s"] is not None and report["faults"][0]["recovery_s"] < 60
    if name == "nat-peer":
        _check_nat_peer(tmp_path, scenario.run_config().diloco.outer_steps)
    faults = {f["kind"]: f for f in report["faults"]}
    if name == "record-and-flood":
        # the forged record was refused, and read back from the DHT: nothing left
        assert '"stored": false' in faults["forge_record"]["detail"]
        assert report["invariants"]["dht_clean"] and len(report["dht_probes"]) == 2
        # the flood ran, and peer0 committed every epoch through it
        assert '"opened"' in faults["flood"]["detail"] and report["invariants"]["every_peer_kept_committing"]
    if name == "pause-twice":  # each sleeper came back and committed with the run again (resynced, not forked)
        for sleeper, paused_at in (("peer2", 2), ("peer1", 10)):
            epochs = [e["epoch"] for e in read_events(tmp_path / f"{sleeper}.jsonl") if e["event"] == "outer_step"]
            assert max(epochs) > paused_at + 2, (sleeper, epochs)
    if name == "lost-vote":  # the member that missed the vote applied its group's commit: no fork, no download
        assert report["figures"]["rounds_recovered"] == 1 and report["invariants"]["every_peer_kept_committing"]
    if name == "moshpit-hash-liar":  # the joiner downloaded the liar's state, refused it on the 2 honest peers'
        # sketches (a swarm too small for their median: the rule for 1-2 sketches), banned it
        events = read_events(tmp_path / "peer3.jsonl")
        refused = [e for e in events if e["event"] == "state_download_failed" and "sketches" in e["reason"]]
        # what the joiner did, and when the others reached each epoch: which state a failure had it download
        story = [
            (round(e["time"], 1), e["event"], e["epoch"], e.get("reason", e.get("peers", "")))
            for e in events
            if e["event"] in ("start", "state_downloaded", "state_download_failed", "peers_banned")
        ] + [
            (round(e["time"], 1), f"{peer} outer_step", e["epoch"], "")
            for peer in ("peer0", "peer1", "peer2")
            for e in read_events(tmp_path / f"{peer}.jsonl")
            if e["event"] == "outer_step"
        ]
        assert refused and any(e["event"] == "peers_banned" for e in events), sorted(story)
        assert any(e["event"] == "state_downloaded" for e in events)  # then an honest state (no_unverified_state)
    if name == "cpu-starve":  # peer2 ran ~20% of each second from its start to its exit, yet committed every epoch
        starve = report["faults"][0]["starve"]
        assert starve["ended_by"] == "gone" and starve["stops"] >= 10, starve
        assert starve["running_s"] / starve["wall_s"] == pytest.approx(0.2, abs=0.05), starve
        assert report["invariants"]["every_peer_kept_committing"]
    if name == "joiner-restart-2peer":
        _check_joiner_and_restart(tmp_path)
    if name == "ahead-liars-2v2":
        _check_ahead_liars(tmp_path, scenario)
    if name == "nan-peer":  # the NaN peer never poisons the honest peers: their loss went down
        assert report["figures"]["final_eval_loss"] < report["figures"]["initial_eval_loss"]


def _check_ahead_liars(out, scenario) -> None:
    """The attack ran (every liar up, claiming, while the honest peers trained), no honest peer's loss rose above its
    pre-attack value + 10% (issue 28), and every honest trainer that was there from the start banned every liar: it
    probed what they claimed (``diloco.probe``) or was served it, and refused it. A joiner bans them if it was served
    the poison (whether it is depends on timing: it weighs every claim alike until it trains with someone)."""
    liar_names = {f"peer{f.peer}" for f in scenario.faults if getattr(f, "mode", "") == "ahead_liar"}
    names = sorted(p.stem for p in out.glob("peer*.jsonl"))
    honest = {n: read_events(out / f"{n}.jsonl") for n in names if n not in liar_names}
    liars = {n: read_events(out / f"{n}.jsonl") for n in sorted(liar_names)}
    founders = {f"peer{i}" for i in range(scenario.peers)}
    liar_ids = {evs[0]["peer"] for evs in liars.values()}
    honest_end = max(e["time"] for evs in honest.values() for e in evs if e["event"] == "outer_step")
    for name, evs in liars.items():
        started = [e["time"] for e in evs if e["event"] == "start"]
        assert started and started[0] < honest_end, f"{name} was not up during the run: the attack did not happen"
    for name, evs in honest.items():
        steps = [e for e in evs if e["event"] == "outer_step" and e.get("eval_loss") is not None]
        attack = min(e["time"] for evs in liars.values() for e in evs if e["event"] == "start")
        before = [e["eval_loss"] for e in steps if e["time"] <= attack]
        after = [e["eval_loss"] for e in steps if e["time"] > attack]
        if before:
            assert max(after) <= before[-1] * 1.1, (name, before[-1], after)
        banned = {p for e in evs if e["event"] == "peers_banned" for p in e["peers"]}
        refused = [e for e in evs if e["event"] == "state_download_failed" and "refused" in e["reason"]]
        assert not refused or banned & liar_ids, name
        if name in founders:
            assert liar_ids <= banned, (name, "did not ban both liars", [e["reason"] for e in evs if "probe" in str(e)])


DECISIONS = ("round_failed", "state_downloaded", "state_download_failed", "peers_banned", "outer_step")


def _decisions(out, last: int = 25) -> str:
    """What each process decided, for a failure seen only on CI: every peer's last ``last`` round/sync events with
    their reasons, and the last warnings of every process log."""
    lines, runs = [], {path.stem: read_events(path) for path in sorted(out.glob("*.jsonl"))}
    t0 = min((evs[0]["time"] for evs in runs.values() if evs), default=0.0)  # the first peer's start
    for name, evs in runs.items():
        events = [e for e in evs if e["event"] in DECISIONS]
        lines.append(f"--- {name}: last {min(last, len(events))} of {len(events)} round/sync events")
        for e in events[-last:]:
            what = e.get("detail") or e.get("reason") or e.get("peers") or f"group {e.get('group_size')}"
            what = f"{what} -> {e['next']}" if "next" in e else what
            lines.append(f"  +{e['time'] - t0:7.1f}s {e['event']:<22} epoch {e.get('epoch')}: {str(what)[:220]}")
    for path in sorted(out.glob("*.log")):
        text = path.read_text(errors="replace")
        # hivetrain logs "WARN"/"ERROR" (cli.common.setup_logging), hivemind "[WARN]"/"[ERROR]"
        warned = [ln for ln in text.splitlines() if " WARN" in ln or "ERROR" in ln or "Traceback" in ln]
        lines.append(f"--- {path.name}: last {min(12, len(warned))} of {len(warned)} warnings")
        lines += [f"  {ln[:260]}" for ln in warned[-12:]]
        starts = [i for i in (text.find("Thread 0x"), text.find("Current thread 0x")) if i >= 0]
        stacks = text[min(starts) :] if starts else ""
        if stacks:  # the harness's SIGUSR1 at the time limit: where every thread of a process that hung waits
            lines.append(f"--- {path.name}: thread stacks at the time limit")
            lines += [f"  {ln[:200]}" for ln in stacks.splitlines()[:80]]
    return "\n".join(lines)


def _check_joiner_and_restart(out) -> None:
    """The late joiner (peer1) and the same identity restarted (peer1r) averaged with peer0 from their second outer
    step on, and every epoch either committed was committed by peer0 in the same group of 2 (issue 22: before, the
    joiner failed every round "alone" while peer0 committed solo steps)."""
    steps = {
        n: [e for e in read_events(out / f"{n}.jsonl") if e["event"] == "outer_step"]
        for n in ("peer0", "peer1", "peer1r")
    }
    with_peer0 = {e["epoch"] for e in steps["peer0"] if e["group_size"] == 2}
    for name in ("peer1", "peer1r"):
        assert steps[name], f"{name} committed no outer step"
        assert all(e["group_size"] == 2 for e in steps[name][1:]), (
            name,
            [(e["epoch"], e["group_size"]) for e in steps[name]],
        )
        assert {e["epoch"] for e in steps[name][1:]} <= with_peer0, name
    restart = [e for e in read_events(out / "peer1r.jsonl") if e["event"] == "start"]
    assert restart and restart[0]["peer"] == read_events(out / "peer1.jsonl")[0]["peer"], (
        "peer1r is not peer1's identity"
    )


def _check_nat_peer(out, outer_steps: int) -> None:
    """Nobody can dial peer1's or peer2's data port, yet both were in every group of 4. Of each pair the member with
    the smaller peer id dials (``RoundLinks``): a reachable peer that had to dial a NAT peer asked it to dial back
    (direct TCP); the NAT peer that had to dial the other NAT peer could not be dialed back either and used a libp2p
    stream (as does a reachable peer whose dial-back misses its window, which may happen on a busy machine but not in
    most rounds); a NAT peer that dials out is never streamed to."""
    events = {i: read_events(out / f"peer{i}.jsonl") for i in range(4)}
    steps = {i: [e for e in evs if e["event"] == "outer_step"] for i, evs in events.items()}
    starts = {i: next(e["time"] for e in evs if e["event"] == "start") for i, evs in events.items()}
    # A first inner phase is ~1.3 s: a peer whose first record was not yet in the DHT when the others' first phases
    # ended (5 processes importing torch on 2 CI cores) misses the first group(s) through no fault of the NAT logic and
    # catches up by state download. Its start time does not tell: a fresh-clone run had reachable peer0 start 0.2 s
    # before the first phase ended, the others' epoch-1 group closed "complete" without it, and it joined at epoch 2.
    # (A loop of 19 runs had two reachable peers miss epochs 1-2 this way while the NAT pair grouped alone.) So: once
    # every peer has committed a round, every group holds all 4, and each NAT peer commits every epoch from its first
    # to the end; how soon everyone is in is startup speed, not NAT.
    all_in = max(s[0]["time"] for s in steps.values())
    for i, peer_steps in steps.items():
        assert all(e["group_size"] == 4 for e in peer_steps if e["time"] >= all_in), (i, peer_steps, starts)
    for nat in (1, 2):
        epochs = [e["epoch"] for e in steps[nat]]
        assert epochs == list(range(epochs[0], outer_steps + 1)), (nat, epochs)
    logs = {i: (out / f"peer{i}.log").read_text() for i in range(4)}
    ids = {i: re.search(r"DHT node (\w+) up", text).group(1) for i, text in logs.items()}
    for i in range(4):
        for nat in (1, 2):
            if i == nat:
                continue
            asked = re.search(rf"cannot connect to {ids[nat]} .*; asking it over libp2p to dial us back", logs[i])
            assert bool(asked) == (ids[i] < ids[nat]), (i, nat, ids)
            streamed = logs[i].count(f"{ids[nat]} could not dial us back either; trying a libp2p stream")
            if ids[i] > ids[nat]:  # the NAT peer dials out: never streamed to
                assert streamed == 0, (i, nat, ids)
            elif i in (1, 2):  # NAT to NAT: no dial-back can work, every round of theirs goes over a stream
                assert streamed >= 1, (i, nat, ids)
            else:  # a reachable peer was dialed back; a dial-back that misses its window on a busy machine falls
                # back to a stream (beside 2 CPU hogs: 1 round of 6, 2026-11-30), but not in most rounds
                assert streamed <= outer_steps // 2, (i, nat, ids, streamed)
