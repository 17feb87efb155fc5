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
from dataclasses import dataclass

from hivetrain.chaos.facts import (
    PeerRun,
    commit_times,
    dht_leftovers,
    hash_agreement,
    join_sync_times,
    lost_samples,
    missed_commits,
    peers_left,
    rss_growth_mib,
    transient_forks,
    uninvited_problems,
    unverified_states,
)
from hivetrain.chaos.scenario import Scenario


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
    """The content of ``report.json``: each fault's recovery, the invariants (module docstring), the figures, and what
    each peer did.

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
    commits, lost = commit_times(peers), lost_samples(peers)
    _fault_outcomes(faults, commits, lost)
    health = _Health.of(scenario, peers)
    invariants = _core_invariants(scenario, peers, faults, target, health, timed_out, leftover_pids, checkpoints)
    asked = _asked_invariants(scenario, peers, target, health, list(coordinator_epochs), list(dht_probes))
    invariants.update(asked.invariants)
    return {
        "scenario": scenario.name,
        "description": scenario.description,
        "passed": all(invariants.values()),
        "invariants": invariants,
        "faults": faults,
        "diverged_peers": health.diverged,
        "figures": _figures(peers, faults, commits, lost, target, health, wall_s),
        "hash_disagreements": health.disagreements,
        "unverified_states": asked.unverified,
        "missed_commits": asked.missed,
        "join_sync_s": asked.sync_times,
        "dht_probes": asked.probes,
        "uninvited": asked.uninvited,
        "peers": [_peer_row(p) for p in peers],
        "peers_left": peers_left(peers),
        "commits": [{"t_s": round(t, 2), "epoch": epoch} for t, epoch in commits],
        "leftover_pids": leftover_pids,
        "checkpoints": checkpoints,
        "timed_out": timed_out,
    }


def _fault_outcomes(faults: list[dict], commits: list[tuple[float, int]], lost: list[tuple[float, int, str]]) -> None:
    """Each fault's recovery (seconds from firing to the next commit) and the samples lost until then or the next
    fault, added to its dict in place."""
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


@dataclass(frozen=True)
class _Health:
    """How the honest peers ended: state agreement (exact-average runs only), eval losses, RSS growth."""

    exact: bool
    agree: bool
    diverged: list[str]
    disagreements: dict[str, list[str]]
    honest: list[PeerRun]
    survivors: list[PeerRun]
    initial_loss: float | None
    final_loss: float | None
    rss: dict[str, float]

    @classmethod
    def of(cls, scenario: Scenario, peers: list[PeerRun]) -> _Health:
        exact = scenario.run_config().averaging.exact_average
        agree, diverged, disagreements = hash_agreement(peers) if exact else (True, [], {})  # moshpit: states differ
        honest = [p for p in peers if p.honest]
        survivors = [p for p in honest if p.survived]
        initial = [e["eval_loss"] for p in honest for e in p.events if e["event"] == "start" and e.get("eval_loss")]
        final = [p.summary["final_eval_loss"] for p in survivors if p.summary and p.summary.get("final_eval_loss")]
        return cls(exact, agree, diverged, disagreements, honest, survivors,
                   statistics.median(initial) if initial else None, statistics.fmean(final) if final else None,
                   {p.name: round(rss_growth_mib(p), 1) for p in peers})  # fmt: skip


def _core_invariants(scenario, peers, faults, target, health: _Health, timed_out, leftover_pids, checkpoints) -> dict:
    """The invariants every run must keep (module docstring)."""
    finished = (
        not timed_out
        and bool(health.survivors)
        and all(p.summary and p.summary.get("epoch", 0) >= target for p in health.survivors)
        and all(p.exit_code in (0, None) or p.killed or p.byzantine for p in peers)
    )
    initial, final = health.initial_loss, health.final_loss
    return {
        **({"state_hashes_agree": health.agree, "no_diverged_peers": not health.diverged} if health.exact else {}),
        "eval_loss_decreased": initial is not None and final is not None and final < initial,
        "finished": finished,
        "no_leftover_processes": not leftover_pids,
        "no_torn_checkpoint": all(c["status"] != "torn" for c in checkpoints),
        "rss_growth_bounded": all(v <= scenario.max_rss_growth_mb for v in health.rss.values()),
        "faults_fired": all(f.get("fired_at_s") is not None for f in faults),
    }


@dataclass(frozen=True)
class _Asked:
    """The invariants that depend on the scenario (and always ``no_unverified_state``), with their evidence."""

    invariants: dict[str, bool]
    unverified: list[str]
    missed: dict[str, str]
    sync_times: dict[str, float | None]
    probes: list[dict]
    uninvited: dict[str, list[str]]


def _asked_invariants(scenario, peers, target, health: _Health, coordinator_epochs, dht_probes) -> _Asked:
    invariants: dict[str, bool] = {}
    unverified = unverified_states(peers, target, coordinator_epochs)
    invariants["no_unverified_state"] = not unverified
    missed = missed_commits(peers, target)
    if scenario.every_peer_commits:
        invariants["every_peer_kept_committing"] = bool(health.survivors) and not missed
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
    return _Asked(invariants, unverified, missed, sync_times, probes, uninvited)


def _figures(peers, faults, commits, lost, target, health: _Health, wall_s: float) -> dict:
    start_s = min((e["t_s"] for p in peers for e in p.events if e["event"] == "start"), default=0.0)
    marks = [start_s] + [t for t, _ in commits]
    gaps = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    recoveries = [f["recovery_s"] for f in faults if f.get("recovery_s") is not None]
    honest_names = {p.name for p in health.honest}
    count = lambda event: sum(1 for p in peers for e in p.events if e["event"] == event)  # noqa: E731
    return {
        "outer_steps_committed": len(commits),
        "target_outer_steps": target,
        "longest_gap_s": round(max(gaps), 2) if gaps else None,
        "max_recovery_s": max(recoveries) if recoveries else None,
        "samples_lost": sum(n for _, n, _ in lost),
        "samples_committed": sum(
            int(e.get("samples", 0)) for p in health.honest for e in p.events if e["event"] == "inner_phase"
        )
        - sum(n for _, n, name in lost if name in honest_names),
        "peers_diverged": len(health.diverged),
        "transient_forks": transient_forks(peers),
        "initial_eval_loss": health.initial_loss,
        "final_eval_loss": health.final_loss,
        "wall_s": round(wall_s, 1),
        "rss_growth_mib": health.rss,
        "rounds_failed": count("round_failed"),
        "state_downloads": count("state_downloaded"),
        "rounds_recovered": count("round_recovered"),
    }


def _peer_row(p: PeerRun) -> dict:
    return {
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
