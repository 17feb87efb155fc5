"""What a chaos run survived: figures and post-run invariants, computed from what the processes left behind.

Pure functions of ``PeerRun`` records (each peer's metrics events, summary, exit, RSS samples) and the fault log the
runner kept; ``build_report`` returns the dict written to ``report.json`` and ``format_summary`` its readable form.

Invariants (every one must hold for ``passed``):
    state_hashes_agree     survivors (honest peers that finished) hold the same state hash at every epoch they share
                           (butterfly runs only: with moshpit or gossip groups peers of an epoch differ by design)
    no_diverged_peers      no honest survivor ends on a state the majority does not hold (``diverged_peers``;
                           butterfly runs only)
    eval_loss_decreased    mean final eval loss of the survivors < initial eval loss
    finished               every survivor reached the run's outer_steps and exited 0 before max_duration_s
    no_leftover_processes  no launched process or p2pd is alive after the run
    no_torn_checkpoint     every checkpoint on disk verifies (``CheckpointStore.list``)
    rss_growth_bounded     RSS growth per peer (first committed step -> max) <= scenario.max_rss_growth_mb
    faults_fired           every fault of the scenario fired
    no_unverified_state    every state an honest peer downloaded is one an honest peer committed in a round (same
                           epoch and hash), and no honest peer nor the coordinator reached an epoch past the run's end

Invariants a scenario asks for (present only then):
    every_peer_kept_committing  (``every_peer_commits``) every honest survivor committed every epoch from its first
                           commit to the end, and downloaded no state after its first commit
    joiners_synced_in_time (``max_join_download_s``) every honest joiner held the swarm's state that soon after start
    dht_clean              (a ``forge_record`` fault) every probe of the DHT after the forgery answered, the last one
                           at the end of the run, and none found a peer record past the run's end or expiring
                           further ahead than the record TTL cap

Invariants of an invite-only run with an ``uninvited`` byzantine peer (present only then; ``uninvited_problems``):
    uninvited_peer_tried   every uninvited peer really attacked: it ran at least one inner phase and tried a round
                           (else the other three prove nothing)
    uninvited_never_grouped  no uninvited peer committed a round in a group of 2 or more, and no honest peer's
                           round excluded one (it was never in an honest peer's group)
    uninvited_record_unseen  no honest peer ever saw more trainers than the members launched by then (the uninvited
                           peer's record never reached an honest peer's view)
    uninvited_served_no_state  no node opened a state stream to an uninvited peer (nobody asked it for state)
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from hivetrain.chaos.scenario import Scenario

MIB = 2**20
RECORD_EXPIRY_CAP_S = 660.0
"""How far ahead of the probe's clock an honest node may hold a peer record's expiration: ``RecordBounds``'
max_record_ttl_s (600 s) plus max_clock_skew_s (60 s)."""


@dataclass
class PeerRun:
    """One peer process as the runner saw it. Times are seconds since the swarm started.

    Attributes:
        name: "peer3" or "churn2".
        index: its scenario index (None for churn peers).
        byzantine: its --byzantine mode ("" = honest).
        events: its metrics events (dicts, with "t_s" added).
        summary: its summary file (None if it was killed before writing one).
        exit_code: None while alive at the end (then it was stopped by the runner).
        killed: the harness killed it on purpose (kill or churn fault).
        rss: (t_s, bytes) samples of the peer and its p2pd together.
        reason: why it exited, as the runner read it (``testing.summary.exit_reason``: its summary's
            ``exit_reason``, else its log's last ERROR line, else "exit code N"); "" while alive.
        peer_id: its base58 peer ID when the runner made its identity (invite-only runs), else "".
        state_requests_from: for an ``uninvited`` peer, who opened a state stream to it (names, or peer IDs).
    """

    name: str
    index: int | None
    byzantine: str = ""
    started_at_s: float = 0.0
    exited_at_s: float | None = None
    exit_code: int | None = None
    killed: bool = False
    events: list[dict] = field(default_factory=list)
    summary: dict | None = None
    rss: list[tuple[float, int]] = field(default_factory=list)
    reason: str = ""
    peer_id: str = ""
    state_requests_from: list[str] = field(default_factory=list)

    @property
    def honest(self) -> bool:
        return not self.byzantine

    @property
    def survived(self) -> bool:
        return self.exit_code == 0 and not self.killed


def commit_times(peers: list[PeerRun]) -> list[tuple[float, int]]:
    """(t_s, epoch) of the first commit of each epoch by an honest peer, in time order."""
    first: dict[int, float] = {}
    for peer in peers:
        if not peer.honest:
            continue
        for e in peer.events:
            if e["event"] == "outer_step" and (e["epoch"] not in first or e["t_s"] < first[e["epoch"]]):
                first[e["epoch"]] = e["t_s"]
    return sorted((t, epoch) for epoch, t in first.items())


def lost_samples(peers: list[PeerRun]) -> list[tuple[float, int, str]]:
    """(t_s, num_samples, peer) of inner phases whose pseudo-gradient was never committed.

    An inner phase is lost when the peer discarded it, downloaded state instead, or died before committing it.
    """
    lost = []
    for peer in peers:
        pending: tuple[float, int] | None = None
        for e in peer.events:
            kind = e["event"]
            if kind == "inner_phase":
                if pending is not None:
                    lost.append((*pending, peer.name))
                pending = (e["t_s"], int(e.get("samples", 0)))
            elif kind == "outer_step":
                pending = None
            elif kind in ("pseudo_gradient_discarded", "state_downloaded") and pending is not None:
                lost.append((e["t_s"], pending[1], peer.name))
                pending = None
        if pending is not None:
            lost.append((peer.exited_at_s if peer.exited_at_s is not None else pending[0], pending[1], peer.name))
    return sorted(lost)


def hash_agreement(peers: list[PeerRun]) -> tuple[bool, list[str], dict[str, list[str]]]:
    """Compare the survivors' state hashes per epoch.

    Returns:
        (all epochs agree, names of diverged survivors, epoch -> distinct hashes where they disagree).
    """
    survivors = [p for p in peers if p.survived and p.honest and p.summary]
    by_epoch: dict[str, dict[str, str]] = {}
    for peer in survivors:
        for epoch, digest in peer.summary.get("state_hashes", {}).items():
            by_epoch.setdefault(str(epoch), {})[peer.name] = digest
    disagreements = {
        epoch: sorted(set(hashes.values())) for epoch, hashes in by_epoch.items() if len(set(hashes.values())) > 1
    }
    diverged: set[str] = set()
    for epoch in disagreements:
        majority = Counter(by_epoch[epoch].values()).most_common(1)[0][0]
        diverged |= {name for name, digest in by_epoch[epoch].items() if digest != majority}
    return not disagreements, sorted(diverged), disagreements


def transient_forks(peers: list[PeerRun]) -> int:
    """Epochs at which honest peers committed different states (later repaired by a state download, or not)."""
    by_epoch: dict[int, set[str]] = {}
    for peer in peers:
        if peer.honest:
            for e in peer.events:
                if e["event"] == "outer_step":
                    by_epoch.setdefault(e["epoch"], set()).add(e["state_hash"])
    return sum(1 for hashes in by_epoch.values() if len(hashes) > 1)


def rss_growth_mib(peer: PeerRun) -> float:
    """RSS growth of a peer from its first committed step to its largest sample, MiB (0 without samples)."""
    first_commit = next((e["t_s"] for e in peer.events if e["event"] == "outer_step"), None)
    if first_commit is None:
        return 0.0
    warm = [rss for t, rss in peer.rss if t >= first_commit]
    return (max(warm) - warm[0]) / MIB if warm else 0.0


def eval_series(peer: PeerRun) -> list[tuple[float, float]]:
    """(t_s, eval loss) of a peer: at start, after evaluated outer steps and at finish."""
    return [(e["t_s"], e["eval_loss"]) for e in peer.events if e.get("eval_loss") is not None]


def last_epoch(peer: PeerRun) -> int | None:
    """The last epoch a peer reached (its summary's, else its events'); None if it reached none."""
    epochs = [int(e["epoch"]) for e in peer.events if e["event"] in ("start", "outer_step", "state_downloaded")]
    if peer.summary:
        epochs.append(int(peer.summary.get("epoch", 0)))
    return max(epochs, default=None)


def peers_left(peers: list[PeerRun]) -> list[dict]:
    """The peers that left before the end, in the order they left: killed on purpose, or exited non-zero.

    Returns:
        Dicts with name, peer_id ("" if unknown), exit_code, epoch (last reached), at_s (seconds after the swarm
        started) and reason (marked "hit by a fault on purpose" for peers the harness killed or cut off).
    """
    left = []
    for p in peers:
        if p.exit_code is None or (p.exit_code == 0 and not p.killed):
            continue
        peer_id = (p.summary or {}).get("peer_id") or next((e["peer"] for e in p.events if e.get("peer")), "")
        reason = p.reason or f"exit code {p.exit_code}"
        left.append(
            {
                "name": p.name,
                "peer_id": peer_id,
                "exit_code": p.exit_code,
                "epoch": last_epoch(p),
                "at_s": None if p.exited_at_s is None else round(p.exited_at_s, 1),
                "reason": f"{reason} (hit by a fault on purpose)" if p.killed else reason,
            }
        )
    return sorted(left, key=lambda d: (d["at_s"] is None, d["at_s"] or 0.0))


def unverified_states(peers: list[PeerRun], target: int, coordinator_epochs: list[int] = ()) -> list[str]:
    """What breaks ``no_unverified_state``, one line each (empty: none).

    A download is verified when an honest peer committed that (epoch, state hash) in a round (its ``outer_step``
    event). Epochs past ``target`` (the run's outer steps) are a lie taken as true, whoever reached them.
    """
    committed = {
        (int(e["epoch"]), e.get("state_hash"))
        for p in peers
        if p.honest
        for e in p.events
        if e["event"] == "outer_step"
    }
    problems = []
    for p in peers:
        if not p.honest:
            continue
        for e in p.events:
            if e["event"] == "state_downloaded" and (int(e["epoch"]), e.get("state_hash")) not in committed:
                problems.append(
                    f"{p.name} downloaded epoch {e['epoch']} ({str(e.get('state_hash'))[:12]}), which no honest "
                    "peer committed"
                )
        epoch = last_epoch(p)
        if epoch is not None and epoch > target:
            problems.append(f"{p.name} reached epoch {epoch}, past the run's {target} outer steps")
    problems += [
        f"the coordinator downloaded epoch {e}, past the run's {target}" for e in coordinator_epochs if e > target
    ]
    return problems


def missed_commits(peers: list[PeerRun], target: int) -> dict[str, str]:
    """Honest survivors that did not commit every epoch from their first commit to ``target``: name -> what they
    missed (epochs without a commit, state downloads after the first commit)."""
    missed = {}
    for p in peers:
        if not (p.honest and p.survived):
            continue
        commits = [int(e["epoch"]) for e in p.events if e["event"] == "outer_step"]
        if not commits:
            missed[p.name] = "committed no epoch"
            continue
        first_t = next(e["t_s"] for e in p.events if e["event"] == "outer_step")
        gaps = sorted(set(range(min(commits), target + 1)) - set(commits))
        late = [e for e in p.events if e["event"] == "state_downloaded" and e["t_s"] > first_t]
        if gaps or late:
            why = "; ".join(f"{int(e['epoch'])} at {e['t_s']:.1f}s ({e.get('reason', '?')})" for e in late)
            missed[p.name] = f"epochs without a commit {gaps}" + (f", downloaded state at epoch {why}" if late else "")
    return missed


def join_sync_times(peers: list[PeerRun], num_initial: int) -> dict[str, float | None]:
    """Seconds from an honest joiner's start event to its first state download (0 if it committed without one);
    None if it did neither. Joiners are the peers of ``join`` faults (index >= ``num_initial``)."""
    times: dict[str, float | None] = {}
    for p in peers:
        if not p.honest or p.index is None or p.index < num_initial:
            continue
        start = next((e["t_s"] for e in p.events if e["event"] == "start"), None)
        synced = next((e for e in p.events if e["event"] in ("state_downloaded", "outer_step")), None)
        if start is None or synced is None:
            times[p.name] = None
        else:
            times[p.name] = round(synced["t_s"] - start, 2) if synced["event"] == "state_downloaded" else 0.0
    return times


def dht_leftovers(probe: dict, target: int) -> list[dict]:
    """The records a DHT probe found that no honest node may hold: a peer record past the run's ``target`` epoch or
    expiring more than ``RECORD_EXPIRY_CAP_S`` after the probe read it. ``probe["records"]``: dicts with peer_id,
    epoch and expires_in_s (seconds from the probe's read)."""
    return [
        r
        for r in probe.get("records", [])
        if r.get("epoch", 0) > target or r.get("expires_in_s", 0) > RECORD_EXPIRY_CAP_S
    ]


def uninvited_problems(peers: list[PeerRun]) -> dict[str, list[str]]:
    """What breaks each ``uninvited_*`` invariant, one line per finding (empty lists: it holds).

    The uninvited peers' IDs come from the runner (``PeerRun.peer_id``), else from their events. A member's view
    counts every trainer record it holds, its own included, so it may see at most the members (peers that are not
    ``uninvited``) launched before the event.
    """
    uninvited = [p for p in peers if p.byzantine == "uninvited"]
    ids = {p.peer_id or next((e["peer"] for e in p.events if e.get("peer")), ""): p.name for p in uninvited}
    ids.pop("", None)
    found: dict[str, list[str]] = {
        "uninvited_peer_tried": [],
        "uninvited_never_grouped": [],
        "uninvited_record_unseen": [],
        "uninvited_served_no_state": [],
        "uninvited_got_no_state": [],
    }
    if not uninvited:
        found["uninvited_peer_tried"].append("no uninvited peer was launched")
    for p in uninvited:
        kinds = {e["event"] for e in p.events}
        if "inner_phase" not in kinds or not kinds & {"outer_step", "round_failed", "contribution_carried"}:
            found["uninvited_peer_tried"].append(f"{p.name} ran no inner phase or tried no round ({p.reason})")
        for e in p.events:
            if e["event"] == "outer_step" and int(e.get("group_size") or 0) >= 2:
                found["uninvited_never_grouped"].append(
                    f"{p.name} committed epoch {e['epoch']} in a group of {e['group_size']}"
                )
        for e in p.events:  # no member (the coordinator included) served it the run's state
            if e["event"] == "state_downloaded":
                found["uninvited_got_no_state"].append(f"{p.name} downloaded epoch {e['epoch']}")
        if p.state_requests_from:
            found["uninvited_served_no_state"].append(
                f"{p.name} got state streams from {', '.join(sorted(set(p.state_requests_from)))}"
            )
    members = sorted(p.started_at_s for p in peers if p.byzantine != "uninvited")
    for p in peers:
        if not p.honest:
            continue
        worst = None
        for e in p.events:
            if e["event"] == "outer_step":
                for peer_id in set(e.get("excluded") or ()) & set(ids):
                    found["uninvited_never_grouped"].append(
                        f"{p.name}'s round of epoch {e['epoch']} had the uninvited {ids[peer_id]} in its group "
                        "(excluded it)"
                    )
            launched = sum(1 for t in members if t <= e["t_s"])
            if int(e.get("peers_seen") or 0) > launched and worst is None:
                worst = f"{p.name} saw {e['peers_seen']} trainers at {e['t_s']:.1f} s, with {launched} members launched"
        if worst:
            found["uninvited_record_unseen"].append(worst)
    return found


def build_report(
    scenario: Scenario,
    peers: list[PeerRun],
    faults: list[dict],
    *,
    wall_s: float,
    timed_out: bool,
    leftover_pids: list[int],
    checkpoints: list[dict],
    coordinator_epochs: list[int] = (),
    dht_probes: list[dict] = (),
) -> dict:
    """The content of ``report.json``.

    Args:
        faults: the runner's fault log: dicts with at least kind, label, fired_at_s (None = never fired),
            ended_at_s; recovery_s and samples_lost are added here.
        leftover_pids: launched processes (or their p2pd) still alive after cleanup.
        checkpoints: {"path", "status", "reason"} for every checkpoint found.
        coordinator_epochs: the epochs the coordinator downloaded (from its log).
        dht_probes: DHT probes run after a forged record: dicts with at_s, final (the end-of-run probe), ok (it
            answered), error, and records (peer_id, epoch, expires_in_s).
    """
    target = scenario.run_config().diloco.outer_steps
    commits = commit_times(peers)
    start_s = min((e["t_s"] for p in peers for e in p.events if e["event"] == "start"), default=0.0)
    marks = [start_s] + [t for t, _ in commits]
    gaps = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    lost = lost_samples(peers)

    fired_times = sorted(f["fired_at_s"] for f in faults if f.get("fired_at_s") is not None)
    for fault in faults:
        fired = fault.get("fired_at_s")
        if fired is None:
            fault.update(recovery_s=None, samples_lost=0)
            continue
        after = [t for t, _ in commits if t > fired]
        fault["recovery_s"] = round(after[0] - fired, 2) if after else None
        later = [t for t in fired_times if t > fired]
        window_end = min([after[0] if after else float("inf")] + ([later[0]] if later else []))
        fault["samples_lost"] = sum(n for t, n, _ in lost if fired <= t <= window_end)

    exact = scenario.run_config().averaging.exact_average
    agree, diverged, disagreements = hash_agreement(peers) if exact else (True, [], {})  # moshpit: states differ
    honest = [p for p in peers if p.honest]
    survivors = [p for p in honest if p.survived]
    initial = [e["eval_loss"] for p in honest for e in p.events if e["event"] == "start" and e.get("eval_loss")]
    final = [p.summary["final_eval_loss"] for p in survivors if p.summary and p.summary.get("final_eval_loss")]
    initial_loss = statistics.median(initial) if initial else None
    final_loss = statistics.fmean(final) if final else None
    rss = {p.name: round(rss_growth_mib(p), 1) for p in peers}
    finished = (
        not timed_out
        and bool(survivors)
        and all(p.summary and p.summary.get("epoch", 0) >= target for p in survivors)
        and all(p.exit_code in (0, None) or p.killed or p.byzantine for p in peers)
    )
    invariants = {
        **({"state_hashes_agree": agree, "no_diverged_peers": not diverged} if exact else {}),
        "eval_loss_decreased": initial_loss is not None and final_loss is not None and final_loss < initial_loss,
        "finished": finished,
        "no_leftover_processes": not leftover_pids,
        "no_torn_checkpoint": all(c["status"] != "torn" for c in checkpoints),
        "rss_growth_bounded": all(v <= scenario.max_rss_growth_mb for v in rss.values()),
        "faults_fired": all(f.get("fired_at_s") is not None for f in faults),
    }
    unverified = unverified_states(peers, target, list(coordinator_epochs))
    invariants["no_unverified_state"] = not unverified
    missed = missed_commits(peers, target)
    if scenario.every_peer_commits:
        invariants["every_peer_kept_committing"] = bool(survivors) and not missed
    sync_times = join_sync_times(peers, scenario.peers)
    if scenario.max_join_download_s is not None:
        bound = scenario.max_join_download_s
        invariants["joiners_synced_in_time"] = bool(sync_times) and all(
            t is not None and t <= bound for t in sync_times.values()
        )
    probes = [{**probe, "leftovers": dht_leftovers(probe, target)} for probe in dht_probes]
    if any(f.kind == "forge_record" for f in scenario.faults):
        invariants["dht_clean"] = (
            any(p.get("final") and p.get("ok") for p in probes)
            and all(p.get("ok") for p in probes)
            and not any(p["leftovers"] for p in probes)
        )
    asked = any(getattr(f, "mode", "") == "uninvited" for f in scenario.faults)
    uninvited = uninvited_problems(peers) if asked else {}
    invariants.update({name: not problems for name, problems in uninvited.items()})
    recoveries = [f["recovery_s"] for f in faults if f.get("recovery_s") is not None]
    return {
        "scenario": scenario.name,
        "description": scenario.description,
        "passed": all(invariants.values()),
        "invariants": invariants,
        "faults": faults,
        "diverged_peers": diverged,
        "figures": {
            "outer_steps_committed": len(commits),
            "target_outer_steps": target,
            "longest_gap_s": round(max(gaps), 2) if gaps else None,
            "max_recovery_s": max(recoveries) if recoveries else None,
            "samples_lost": sum(n for _, n, _ in lost),
            "samples_committed": sum(
                int(e.get("samples", 0)) for p in honest for e in p.events if e["event"] == "inner_phase"
            )
            - sum(n for _, n, name in lost if name in {p.name for p in honest}),
            "peers_diverged": len(diverged),
            "transient_forks": transient_forks(peers),
            "initial_eval_loss": initial_loss,
            "final_eval_loss": final_loss,
            "wall_s": round(wall_s, 1),
            "rss_growth_mib": rss,
            "rounds_failed": sum(1 for p in peers for e in p.events if e["event"] == "round_failed"),
            "state_downloads": sum(1 for p in peers for e in p.events if e["event"] == "state_downloaded"),
            "rounds_recovered": sum(1 for p in peers for e in p.events if e["event"] == "round_recovered"),
        },
        "hash_disagreements": disagreements,
        "unverified_states": unverified,
        "missed_commits": missed,
        "join_sync_s": sync_times,
        "dht_probes": probes,
        "uninvited": uninvited,
        "peers": [
            {
                "name": p.name,
                "index": p.index,
                "byzantine": p.byzantine,
                "started_at_s": round(p.started_at_s, 2),
                "exited_at_s": None if p.exited_at_s is None else round(p.exited_at_s, 2),
                "exit_code": p.exit_code,
                "killed": p.killed,
                "final_epoch": p.summary.get("epoch") if p.summary else None,
                "reason": p.reason,
            }
            for p in peers
        ],
        "peers_left": peers_left(peers),
        "commits": [{"t_s": round(t, 2), "epoch": epoch} for t, epoch in commits],
        "leftover_pids": leftover_pids,
        "checkpoints": checkpoints,
        "timed_out": timed_out,
    }


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def format_summary(report: dict) -> str:
    """A readable summary of a report (plain text, ~30 lines)."""
    fig = report["figures"]
    lines = [
        f"scenario {report['scenario']}: {'PASSED' if report['passed'] else 'FAILED'}  ({report['description']})",
        "",
        "invariants:",
        *[f"  {'ok  ' if ok else 'FAIL'} {name}" for name, ok in report["invariants"].items()],
        "",
        "figures:",
        f"  outer steps committed     {fig['outer_steps_committed']} / {fig['target_outer_steps']}",
        f"  longest gap without step  {_fmt(fig['longest_gap_s'])} s",
        f"  worst recovery            {_fmt(fig['max_recovery_s'])} s",
        f"  samples lost              {fig['samples_lost']} (committed {fig['samples_committed']})",
        f"  peers diverged            {fig['peers_diverged']}  (transient forks: {fig['transient_forks']})",
        f"  eval loss                 {_fmt(fig['initial_eval_loss'])} -> {_fmt(fig['final_eval_loss'])}",
        f"  rounds failed / state downloads  {fig['rounds_failed']} / {fig['state_downloads']}"
        + (f" ({fig['rounds_recovered']} applied after a lost vote)" if fig.get("rounds_recovered") else ""),
        f"  wall time                 {fig['wall_s']} s",
        f"  RSS growth per peer (MiB) {', '.join(f'{k} {v}' for k, v in fig['rss_growth_mib'].items())}",
    ]
    if report.get("join_sync_s"):
        lines.append(
            f"  joiners' state sync (s)   {', '.join(f'{k} {_fmt(v)}' for k, v in report['join_sync_s'].items())}"
        )
    for probe in report.get("dht_probes", []):
        found = len(probe.get("records", []))
        what = f"{found} records, {len(probe['leftovers'])} out of bounds" if probe.get("ok") else probe.get("error")
        lines.append(f"  DHT probe at {_fmt(probe.get('at_s'))} s{' (end)' if probe.get('final') else ''}: {what}")
    lines += ["", "faults:"]
    for f in report["faults"]:
        lines.append(
            f"  {f['label']:<28} fired {_fmt(f.get('fired_at_s')):>8} s  recovery {_fmt(f.get('recovery_s')):>7} s"
            f"  samples lost {f.get('samples_lost', 0):>5}  {f.get('detail', '')}"
        )
    if report.get("peers_left"):
        lines += ["", "peers that left:"]
        for p in report["peers_left"]:
            lines.append(
                f"  {p['name']:<10} exit {_fmt(p['exit_code']):>4} at {'-' if p['at_s'] is None else p['at_s']:>6} s,"
                f" epoch {_fmt(p['epoch'])}"
                f": {p['reason']}"
            )
    for line in report.get("unverified_states", []):
        lines.append(f"unverified state: {line}")
    for name, what in report.get("missed_commits", {}).items():
        lines.append(f"missed commits: {name}: {what}")
    for name, problems in report.get("uninvited", {}).items():
        lines += [f"{name}: {line}" for line in problems]
    if report["diverged_peers"]:
        lines.append(f"diverged peers: {', '.join(report['diverged_peers'])}")
    if report["leftover_pids"]:
        lines.append(f"processes left behind: {report['leftover_pids']}")
    return "\n".join(lines)
