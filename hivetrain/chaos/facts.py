"""Facts of a chaos run, read from what its processes left behind (``PeerRun``: each peer's metrics events, summary,
exit and RSS samples): commits and their times, samples lost, state-hash agreement and forks, RSS growth, who left
and why, states downloaded without a committed source, missed commits, joiners' sync times, the DHT probes'
leftovers and what an uninvited peer managed. Pure functions; ``report.build_report`` turns them into ``report.json``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

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
        reason: why it exited, as the runner read it (``localswarm.summary.exit_reason``: its summary's
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
