"""The utilization bench's swarm: shaped links in network namespaces, a volunteer behind a real NAT, and one arm.

``build_network`` puts the coordinator and every peer in its own namespace (``hivetrain.chaos.network``), limits each
peer's link to ``mbps`` each way with ``tc tbf`` and puts the peers marked ``behind_nat`` behind a home router
(iptables MASQUERADE, no port forwarding). ``run_arm`` starts a coordinator and real ``join-swarm`` processes in them,
lets the peers train for ``run_s`` seconds once every peer has started training, stops them with SIGINT (join-swarm
leaves cleanly on it) and returns their events, summaries and exit codes. Every process it started is stopped before
it returns or raises (SIGTERM then SIGKILL to each process group, by PID); the caller deletes the namespaces, which
takes their veths and iptables rules along.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hivetrain.chaos.network import Member, NetnsTopology
from hivetrain.localswarm.launcher import LocalSwarm
from hivetrain.localswarm.summary import read_events, read_peer_summary

STARTUP_TIMEOUT_S = 240.0  # imports, p2pd, bootstrap, config, first evaluation, all peers, on a loaded machine
LEAVE_TIMEOUT_S = 30.0  # SIGINT until exit (join-swarm leaves within a few seconds)


@dataclass(frozen=True)
class PeerSpec:
    """One volunteer: its speed (``join-swarm --duty-cycle``) and whether it sits behind NAT."""

    name: str
    duty_cycle: float
    behind_nat: bool


@dataclass
class ArmRun:
    """What one arm left behind (times in unix seconds)."""

    arm: str
    t_start: float  # every peer had emitted its "start" event (training began)
    t_stop: float  # SIGINT sent to every peer
    events: dict[str, list[dict]] = field(default_factory=dict)
    summaries: dict[str, dict | None] = field(default_factory=dict)
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    exited_early: dict[str, float] = field(default_factory=dict)  # name -> seconds after t_start
    nat_log_lines: dict[str, int] = field(default_factory=dict)  # dial-back / libp2p-stream log lines seen


def ensure_iptables(log: Callable[[str], None]) -> None:
    """Install Debian's ``iptables`` package with apt-get if the command is missing (root only).

    Raises:
        RuntimeError: apt-get failed or is missing.
    """
    if shutil.which("iptables"):
        return
    log("iptables missing: apt-get update && apt-get install -y iptables")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv, timeout_s in (
        (["apt-get", "update", "-qq"], 300),
        (["apt-get", "install", "-y", "-qq", "iptables"], 600),
    ):
        try:
            subprocess.run(argv, check=True, env=env, timeout=timeout_s, capture_output=True)
        except (OSError, subprocess.SubprocessError) as exc:
            raise RuntimeError(f"could not install iptables ({' '.join(argv)}): {exc}") from exc
    if not shutil.which("iptables"):
        raise RuntimeError("apt-get installed iptables but the command is still missing")


def supports_duty_cycle() -> bool:
    """Whether this hivetrain's ``join-swarm`` has ``--duty-cycle``."""
    proc = subprocess.run(
        [sys.executable, "-m", "hivetrain.cli.join_swarm", "--help"], capture_output=True, text=True, timeout=120
    )
    return "--duty-cycle" in proc.stdout


def build_network(topology: NetnsTopology, specs: list[PeerSpec], mbps: float) -> tuple[Member, list[Member]]:
    """The coordinator's member (unlimited link) and one member per peer (``mbps`` each way; NAT where asked).

    ``topology`` must be created; the caller closes it. Raises NetnsError when a command fails.
    """
    coordinator = topology.add_member()
    members = []
    for spec in specs:
        member = topology.add_nat_member() if spec.behind_nat else topology.add_member()
        topology.set_bandwidth(member, mbps)
        members.append(member)
    return coordinator, members


def make_identities(out_dir: Path, specs: list[PeerSpec]) -> None:
    """Write each peer's identity file (``<name>.key``, what the launcher passes) so that the peers behind NAT get
    the largest peer IDs: the member with the smaller ID dials, so every link to a NAT'd peer is one that the others
    must open, and each takes hivetrain's dial-back (or libp2p) path instead of the NAT'd peer dialing out itself."""
    from hivetrain.peers.identity import load_or_create_identity

    tmp = out_dir / "identities"
    identities = sorted(
        (load_or_create_identity(tmp / f"{i}.key") for i in range(len(specs))), key=lambda ident: ident.peer_id
    )
    order = sorted(specs, key=lambda spec: spec.behind_nat)  # public peers take the smaller IDs
    for spec, identity in zip(order, identities, strict=True):
        identity.path.rename(out_dir / f"{spec.name}.key")
    shutil.rmtree(tmp)


def _peer_args(spec: PeerSpec, duty_supported: bool) -> list[str]:
    args = ["--dht-lost-timeout", "600"]
    if duty_supported:
        args += ["--duty-cycle", f"{spec.duty_cycle:g}"]
    if spec.behind_nat:
        args.append("--client-mode")  # what the README tells a volunteer behind NAT without port forwarding
    return args


def run_arm(
    arm: str,
    config_path: Path,
    out_dir: Path,
    coordinator: Member,
    members: list[Member],
    specs: list[PeerSpec],
    run_s: float,
    duty_supported: bool,
    log: Callable[[str], None],
) -> ArmRun:
    """Run one arm: a coordinator and ``len(specs)`` peers for ``run_s`` seconds of training, then SIGINT.

    Raises:
        RuntimeError: the coordinator did not start, or the peers did not all start training within
            ``STARTUP_TIMEOUT_S`` (a peer's log tail is in the message).
    """
    make_identities(out_dir, specs)
    swarm = LocalSwarm(out_dir, config_path, threads_per_peer=1)
    try:
        swarm.start_coordinator(timeout_s=90, prefix=coordinator.exec_prefix, host=coordinator.ip)
        for spec, member in zip(specs, members, strict=True):
            swarm.add_peer(_peer_args(spec, duty_supported), name=spec.name, prefix=member.exec_prefix, host=member.ip)
        t_start = _wait_started(swarm, log)
        log(f"[{arm}] all {len(specs)} peers training; running {run_s:.0f}s")
        run = ArmRun(arm=arm, t_start=t_start, t_stop=0.0)
        seen_epoch = 0
        while time.time() < t_start + run_s:
            time.sleep(1.0)
            for peer in swarm.peers:
                if not peer.alive() and peer.name not in run.exited_early:
                    run.exited_early[peer.name] = time.time() - t_start
                    log(f"[{arm}] {peer.name} exited early with code {peer.popen.returncode} (see {peer.log_path})")
            seen_epoch = _log_commits(arm, swarm, t_start, seen_epoch, log)
        run.t_stop = time.time()
        for peer in swarm.peers:
            if peer.alive():
                os.kill(peer.pid, signal.SIGINT)  # the peer's own PID: it stops its p2pd itself
        deadline = time.monotonic() + LEAVE_TIMEOUT_S
        for peer in swarm.peers:
            try:
                peer.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log(f"[{arm}] {peer.name} did not leave within {LEAVE_TIMEOUT_S:.0f}s of SIGINT")
        for peer in swarm.peers:
            run.events[peer.name] = read_events(peer.metrics_path)
            run.summaries[peer.name] = read_peer_summary(peer)
            run.exit_codes[peer.name] = peer.popen.poll()
            run.nat_log_lines[peer.name] = _nat_log_lines(peer.log_path)
        return run
    finally:
        swarm.close(grace_s=10.0)


def _wait_started(swarm: LocalSwarm, log: Callable[[str], None]) -> float:
    """Unix time at which the last peer emitted its ``start`` event. Raises RuntimeError on an exit or timeout."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        starts = {}
        for peer in swarm.peers:
            if not peer.alive():
                tail = peer.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{peer.name} exited with {peer.popen.returncode} while starting:\n{tail}")
            times = [e["time"] for e in read_events(peer.metrics_path) if e.get("event") == "start"]
            if times:
                starts[peer.name] = times[0]
        if len(starts) == len(swarm.peers):
            return max(starts.values())
        if time.monotonic() > deadline:
            waiting = sorted({p.name for p in swarm.peers} - set(starts))
            raise RuntimeError(f"peers {waiting} did not start training within {STARTUP_TIMEOUT_S:.0f}s")
        time.sleep(1.0)


def _log_commits(arm: str, swarm: LocalSwarm, t_start: float, seen_epoch: int, log: Callable[[str], None]) -> int:
    for peer in swarm.peers:
        for e in read_events(peer.metrics_path):
            if e.get("event") == "outer_step" and e.get("epoch", 0) > seen_epoch:
                seen_epoch = e["epoch"]
                loss = e.get("eval_loss")
                log(
                    f"[{arm}] +{e['time'] - t_start:5.0f}s epoch {seen_epoch} committed by {peer.name} "
                    f"(group {e.get('group_size')}, round {e.get('round_s', 0):.1f}s, "
                    f"eval loss {'-' if loss is None else f'{loss:.3f}'})"
                )
    return seen_epoch


def _nat_log_lines(path: Path) -> int:
    """Log lines in which a peer asked an undialable member to dial back or fell back to a libp2p stream."""
    if not path.exists():
        return 0
    text = path.read_text(errors="replace")
    return text.count("asking it over libp2p to dial us back") + text.count("trying a libp2p stream")
