"""What the chaos runner does when a triggered fault comes due: one function per fault model, in ``FIRE``.

Each ``fire_*(runner, index, fault, target, reason)`` applies fault ``index`` of the scenario (``fault``, its frozen
model from ``chaos/fault_models.py``) to ``target`` (the peer it names; None for faults that name none), records what it
did with ``runner.fired`` and schedules what comes later (a resume, a heal, a restart, reading a tool's answer) with
``runner.later``. ``reason`` says what triggered it, for the log. The runner has already checked that a named peer is
running. Launch-time faults (``LAUNCH_TIME_KINDS``: hooks, byzantine modes, latency, an unreachable data port) are
applied when a peer starts and have no entry here.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hivetrain.chaos import adversary, process
from hivetrain.chaos.fault_models import (
    AdversaryFault,
    BandwidthFault,
    ChurnFault,
    CpuStarveFault,
    FloodFault,
    ForgeRecordFault,
    JoinFault,
    KillCoordinatorFault,
    KillFault,
    KillP2pdFault,
    PartitionFault,
    PauseFault,
    RestartFault,
)
from hivetrain.chaos.schedule import ChurnStep, churn_decision, churn_plan
from hivetrain.chaos.starve import DutyCycler

if TYPE_CHECKING:
    from hivetrain.chaos.runner import ChaosRunner, _Peer

PROBE_TIMEOUT_S = 60.0


def fire_kill(run: ChaosRunner, index: int, fault: KillFault, target: _Peer, reason: str) -> None:
    target.run.killed = True
    process.kill(target.proc)
    run.fired(index, f"SIGKILL {target.run.name} and its p2pd ({reason})")


def fire_pause(run: ChaosRunner, index: int, fault: PauseFault, target: _Peer, reason: str) -> None:
    process.pause(target.proc)
    run.fired(index, f"SIGSTOP {target.run.name} for {fault.duration_s:g}s ({reason})")
    run.faults[index]["ended_at_s"] = round(run.now() + fault.duration_s, 2)
    run.later(run.now() + fault.duration_s, lambda p=target.proc: process.resume(p))


def fire_restart(run: ChaosRunner, index: int, fault: RestartFault, target: _Peer, reason: str) -> None:
    target.run.killed = True
    process.kill(target.proc)
    run.fired(index, f"SIGKILL {target.run.name}, back with its identity in {fault.down_s:g}s ({reason})")
    run.later(run.now() + fault.down_s, lambda p=target: run.relaunch(p))


def fire_kill_p2pd(run: ChaosRunner, index: int, fault: KillP2pdFault, target: _Peer, reason: str) -> None:
    # Without its daemon the peer cannot see the swarm: by design it stops (exit 4) rather than train alone and fork
    # the run. It is a casualty of the fault, not a survivor that must finish.
    target.run.killed = True
    pids = process.kill_p2pd(target.proc)
    run.fired(index, f"SIGKILL p2pd {pids} of {target.run.name} ({reason})")


def fire_kill_coordinator(run: ChaosRunner, index: int, fault: KillCoordinatorFault, target: None, reason: str) -> None:
    assert run.swarm is not None and run.swarm.coordinator is not None
    process.kill(run.swarm.coordinator)
    run.fired(index, f"SIGKILL coordinator, back in {fault.down_s:g}s ({reason})")
    run.later(run.now() + fault.down_s, lambda: _restart_coordinator(run, index))


def _restart_coordinator(run: ChaosRunner, index: int) -> None:
    assert run.swarm is not None
    try:
        address = run.swarm.restart_coordinator(timeout_s=90)
        run.faults[index]["ended_at_s"] = round(run.now(), 2)
        run.log(f"[{run.now():6.1f}s] coordinator restarted at {address}")
    except RuntimeError as exc:
        run.faults[index]["detail"] += f"; restart failed: {exc}"
        run.log(f"[{run.now():6.1f}s] coordinator restart FAILED: {exc}")


def fire_join(run: ChaosRunner, index: int, fault: JoinFault, target: None, reason: str) -> None:
    names = [run.launch(run.take_index()).run.name for _ in range(fault.count)]
    run.fired(index, f"started {', '.join(names)} ({reason})")


def fire_bandwidth(run: ChaosRunner, index: int, fault: BandwidthFault, target: _Peer, reason: str) -> None:
    assert run.topology is not None and target.member is not None
    run.topology.set_bandwidth(target.member, fault.mbps)
    run.fired(index, f"{target.run.name} limited to {fault.mbps:g} Mbit/s each way ({reason})")


def fire_partition(run: ChaosRunner, index: int, fault: PartitionFault, target: None, reason: str) -> None:
    assert run.topology is not None
    side = [run.by_index[i] for i in fault.side if i in run.by_index]
    run.topology.isolate([p.member for p in side if p.member is not None])
    run.fired(index, f"cut {', '.join(p.run.name for p in side)} off for {fault.heal_after_s:g}s ({reason})")
    run.faults[index]["ended_at_s"] = round(run.now() + fault.heal_after_s, 2)
    run.later(run.now() + fault.heal_after_s, lambda: _heal(run))


def _heal(run: ChaosRunner) -> None:
    assert run.topology is not None
    run.topology.heal()
    run.log(f"[{run.now():6.1f}s] partition healed")


def fire_churn(run: ChaosRunner, index: int, fault: ChurnFault, target: None, reason: str) -> None:
    plan = churn_plan(fault, run.now(), run.scenario.seed)
    run.fired(index, f"{len(plan)} churn events over {fault.duration_s:g}s ({reason})")
    run.faults[index]["ended_at_s"] = round(run.now() + fault.duration_s, 2)
    for step in plan:
        run.later(step.t_s, lambda s=step: _churn_step(run, s, fault))


def _churn_step(run: ChaosRunner, step: ChurnStep, fault: ChurnFault) -> None:
    live = {p.run.name: p for p in run.peers if p.proc.alive() and not p.run.killed}
    protected = [name for name, p in live.items() if p.run.byzantine]
    action, victim, why = churn_decision(step, list(live), protected, fault.min_peers, fault.max_peers)
    record = {"index": None, "kind": f"churn:{action}", "fired_at_s": round(run.now(), 2), "ended_at_s": None}
    if action == "join":
        name = run.launch(None).run.name
        record.update(label=f"+{name}", detail=f"started {name} ({why})")
    elif action == "kill":
        live[victim].run.killed = True
        process.kill(live[victim].proc)
        record.update(label=f"-{victim}", detail=f"SIGKILL {victim} ({why})")
    else:
        return
    run.faults.append(record)
    run.log(f"[{run.now():6.1f}s] CHURN {record['detail']}")


def fire_cpu_starve(run: ChaosRunner, index: int, fault: CpuStarveFault, target: _Peer, reason: str) -> None:
    """Start duty cycling ``target``'s process group (SIGSTOP/SIGCONT, ``chaos/starve.py``); it ends after the fault's
    duration, when the peer exits, or at teardown (``end_starve``), and always leaves the group running."""
    cycler = DutyCycler(
        target.proc.signal_group,
        fault.fraction,
        fault.period_s,
        duration_s=fault.duration_s,
        alive=target.proc.alive,
        name=target.run.name,
    )
    run.cyclers[index] = cycler.start()
    until = f"for {fault.duration_s:g}s" if fault.duration_s else "until it exits"
    duty = f"{fault.fraction:g} of every {fault.period_s:g}s (SIGSTOP/SIGCONT)"
    run.fired(index, f"{target.run.name} runs {duty} {until} ({reason})")
    if fault.duration_s:
        run.faults[index]["ended_at_s"] = round(run.now() + fault.duration_s, 2)
        run.later(run.now() + fault.duration_s + 0.5, lambda: end_starve(run, index))


def end_starve(run: ChaosRunner, index: int) -> None:
    """Stop the duty cycler of fault ``index`` (its target left running) and add what it did to the detail."""
    cycler = run.cyclers.pop(index, None)
    if cycler is None:
        return
    stats = cycler.stop()
    record = run.faults[index]
    if record["ended_at_s"] is None or stats.ended_by != "deadline":
        record["ended_at_s"] = round(record["fired_at_s"] + stats.wall_s, 2)
    record["detail"] += f"; {stats.describe()}"
    record["starve"] = dataclasses.asdict(stats)  # stops, conts, running_s, wall_s, ended_by
    run.log(f"[{run.now():6.1f}s] cpu_starve ended: {stats.describe()}")


def fire_adversary(run: ChaosRunner, index: int, fault: AdversaryFault, target: _Peer, reason: str) -> None:
    python, maddr = adversary.adversary_python(), adversary.peer_maddr(target.proc.log_path)
    if python is None or maddr is None:
        why = "py-libp2p is not installed (scripts/setup_adversary)" if python is None else "no address logged"
        run.faults[index]["detail"] = f"adversary not started: {why}"
        run.log(f"[{run.now():6.1f}s] adversary not started: {why}")
        return
    out_path = run.out_dir / f"adversary{index}.jsonl"
    popen = adversary.launch(
        python, maddr, run.config.run_id, fault.duration_s, fault.slowloris, run.scenario.seed, out_path
    )
    run.adversaries.append(popen)
    run.fired(index, f"py-libp2p adversary attacks {target.run.name} for {fault.duration_s:g}s ({reason})")
    run.faults[index]["ended_at_s"] = round(run.now() + fault.duration_s, 2)

    def done() -> None:
        run.faults[index]["detail"] += "; " + adversary.summarize(out_path)

    run.later(run.now() + fault.duration_s + 5.0, done)


def tool(run: ChaosRunner, module: str, args: list[str], out_path: Path) -> subprocess.Popen:
    """Start ``python -m module args`` in its own process group (killed at teardown); stdout to ``out_path``."""
    with open(out_path, "ab") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=out, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    run.adversaries.append(popen)
    return popen


def fire_forge_record(run: ChaosRunner, index: int, fault: ForgeRecordFault, target: None, reason: str) -> None:
    assert run.swarm is not None and run.swarm.address is not None
    out = run.out_dir / f"forge{index}.json"
    args = [run.swarm.address, run.config.run_id, "--epoch", str(fault.epoch)]
    popen = tool(run, "hivetrain.testing.dht_forger", ["forge", *args, "--expires-in-s", str(fault.expires_in_s)], out)
    run.fired(
        index, f"an attacker stores a record of epoch {fault.epoch} expiring in {fault.expires_in_s:g}s ({reason})"
    )
    run.faults[index]["ended_at_s"] = round(run.now() + fault.probe_after_s, 2)

    def done() -> None:  # the attacker has stored its record and left by now (if not, the probe waits)
        if popen.poll() is None and run.now() < run.faults[index]["fired_at_s"] + PROBE_TIMEOUT_S:
            run.later(run.now() + 1.0, done)
            return
        answer = out.read_text().strip()[-300:] if out.exists() else ""
        run.faults[index]["detail"] += "; forger: " + (answer or "no answer")
        run.probe_dht(final=False)

    run.later(run.now() + fault.probe_after_s, done)


def fire_flood(run: ChaosRunner, index: int, fault: FloodFault, target: _Peer, reason: str) -> None:
    address = next((e["data_address"] for e in target.run.events if e.get("event") == "start"), None)
    if not address:
        run.faults[index]["detail"] = f"flood not started: {target.run.name} named no data port (no start event)"
        return
    host, port = address.rsplit(":", 1)
    out = run.out_dir / f"flood{index}.json"
    counts = ["--idle", str(fault.idle), "--slowloris", str(fault.slowloris), "--oversized", str(fault.oversized)]
    tool(run, "hivetrain.testing.flood", [host, port, "--duration-s", str(fault.duration_s), *counts], out)
    run.fired(
        index,
        f"{fault.idle} idle + {fault.slowloris} slowloris + {fault.oversized} oversized connections to "
        f"{target.run.name}'s data port {port} for {fault.duration_s:g}s ({reason})",
    )
    run.faults[index]["ended_at_s"] = round(run.now() + fault.duration_s, 2)
    ends_at_s = run.now() + fault.duration_s

    def done() -> None:  # the flood prints its counters once it has closed its connections
        counters = out.read_text().strip() if out.exists() else ""
        if not counters and run.now() < ends_at_s + PROBE_TIMEOUT_S:
            run.later(run.now() + 1.0, done)
            return
        run.faults[index]["detail"] += "; flood: " + (counters or "no counters")

    run.later(ends_at_s + 1.0, done)


FIRE: dict[type, Callable[[Any, int, Any, Any, str], None]] = {
    KillFault: fire_kill,
    PauseFault: fire_pause,
    CpuStarveFault: fire_cpu_starve,
    RestartFault: fire_restart,
    KillP2pdFault: fire_kill_p2pd,
    KillCoordinatorFault: fire_kill_coordinator,
    JoinFault: fire_join,
    BandwidthFault: fire_bandwidth,
    PartitionFault: fire_partition,
    AdversaryFault: fire_adversary,
    ForgeRecordFault: fire_forge_record,
    FloodFault: fire_flood,
    ChurnFault: fire_churn,
}
"""Fault model type -> what firing it does: one entry per triggered kind (``fault_models.TRIGGERED_KINDS``)."""
