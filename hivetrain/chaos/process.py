"""Process faults and process observations: kill, pause, kill a p2pd, RSS, leftovers, checkpoints on disk.

Only processes the harness launched are touched, by their process-group ID (each peer is its own session, so its
group holds the peer and its p2pd) or by a PID found inside such a group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import psutil

from hivetrain.localswarm.launcher import PeerProcess, group_pids


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def dump_stacks(procs: list[PeerProcess]) -> None:
    """Every process still running writes its threads' stacks to its log (SIGUSR1, ``peers/stacks.py``), for a
    scenario that ran out of time. To the main PIDs only: the helpers of a process group (p2pd, the reaper) do not
    take SIGUSR1. A stopped process is resumed first (it would dump nothing)."""
    for proc in procs:
        if proc.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
                os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(1.0)  # faulthandler writes from the signal handler: a second is plenty, and nothing reports it done


def kill(proc: PeerProcess) -> bool:
    """SIGKILL the whole group (peer and p2pd). Returns False if the peer had already exited."""
    was_alive = proc.alive()
    proc.signal_group(signal.SIGKILL)
    return was_alive


def pause(proc: PeerProcess) -> bool:
    """SIGSTOP the group (a laptop lid closing: sockets stay open, nothing answers). False if already exited."""
    was_alive = proc.alive()
    proc.signal_group(signal.SIGSTOP)
    return was_alive


def resume(proc: PeerProcess) -> None:
    """SIGCONT the group."""
    proc.signal_group(signal.SIGCONT)


def p2pd_pids(proc: PeerProcess) -> list[int]:
    """PIDs of the p2pd daemons in the peer's group."""
    return [pid for pid in proc.group_pids() if _comm(pid) == "p2pd"]


def kill_p2pd(proc: PeerProcess) -> list[int]:
    """SIGKILL only the peer's p2pd; the Python process keeps running. Returns the PIDs killed."""
    killed = []
    for pid in p2pd_pids(proc):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


def is_stopped(proc: PeerProcess) -> bool:
    """True while the peer's main process is stopped (SIGSTOP, e.g. by its own ``stop`` hook fault)."""
    try:
        return psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def group_rss_bytes(proc: PeerProcess) -> int:
    """Resident memory of every process in the peer's group (Python and p2pd), bytes; 0 if gone."""
    total = 0
    for pid in proc.group_pids():
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    return total


def leftovers(procs: list[PeerProcess], p2pds: dict[int, float]) -> list[int]:
    """Launched processes still alive: members of any launched group, and p2pd daemons seen during the run.

    Args:
        p2pds: pid -> create_time of every p2pd seen (create_time guards against PID reuse).
    """
    alive = {pid for proc in procs for pid in group_pids(proc.pid)}
    for pid, created in p2pds.items():
        try:
            if abs(psutil.Process(pid).create_time() - created) < 1e-3 and psutil.Process(pid).status() != "zombie":
                alive.add(pid)
        except psutil.Error:
            continue
    return sorted(alive)


def remember_p2pds(proc: PeerProcess, seen: dict[int, float]) -> None:
    """Record (pid, create_time) of the peer's current p2pd daemons into ``seen``."""
    for pid in p2pd_pids(proc):
        if pid not in seen:
            try:
                seen[pid] = psutil.Process(pid).create_time()
            except psutil.Error:
                continue


def check_checkpoints(root: Path) -> list[dict]:
    """Verify every checkpoint store found under ``root`` (directories holding ``epoch-NNNNNN`` checkpoints).

    Returns:
        {"path", "epoch", "status", "reason"} per checkpoint; status is "ok", "torn", "tampered" or "incompatible".
    """
    from hivetrain.coordinator.checkpoint import CheckpointStore

    stores = {p.parent for p in Path(root).rglob("epoch-*") if p.is_dir()}
    results = []
    for store_root in sorted(stores):
        for info in CheckpointStore(store_root, keep_last=1).list(verify=True):
            results.append({"path": str(info.path), "epoch": info.epoch, "status": info.status, "reason": info.reason})
    return results
