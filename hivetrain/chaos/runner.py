"""Run a chaos scenario: launch a coordinator and peers as real processes, apply the faults, write the report.

``run_scenario(scenario, out_dir)`` is the whole lifecycle: set up (network namespaces, proxy, coordinator, initial
peers), a poll loop a few times a second (read the peers' metrics, fire due faults and timers, sample RSS, notice
exits), then tear everything down in ``finally`` and compute ``report.json``, ``summary.txt`` and ``plot.png`` in
``out_dir``. Whatever happens (an exception, Ctrl+C), every process group it started is killed and every namespace it
created is deleted before it returns or raises.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from hivetrain.chaos import adversary, process
from hivetrain.chaos.network import Member, NetnsTopology, TcpProxy
from hivetrain.chaos.plot import plot_run
from hivetrain.chaos.report import PeerRun, build_report, format_summary
from hivetrain.chaos.scenario import LAUNCH_TIME_KINDS, UNREACHABLE_HOST, Scenario
from hivetrain.chaos.schedule import ChurnStep, Observed, churn_decision, churn_plan, due_faults
from hivetrain.chaos.starve import DutyCycler
from hivetrain.peers.identity import Identity, load_or_create_identity
from hivetrain.peers.membership import make_token
from hivetrain.testing.byzantine import CHUNK_BYTES_ENV, SERVED_MARKER
from hivetrain.testing.launcher import LocalSwarm, PeerProcess
from hivetrain.testing.summary import exit_reason, read_peer_summary

logger = logging.getLogger(__name__)

RSS_INTERVAL_S = 2.0
TOKEN_MARGIN_S = 3600.0  # join tokens expire this long after the scenario's max_duration_s
PROBE_TIMEOUT_S = 60.0
_NORMAL_EXITS = (0, 2, 3, 4, 130)
_DATA_PORT = re.compile(r"averager \S+ listening on ([0-9.]+):(\d+)")
_COORDINATOR_DOWNLOAD = re.compile(r"downloaded epoch (\d+)")


@dataclass
class _Peer:
    proc: PeerProcess
    run: PeerRun
    member: Member | None = None
    offset: int = 0
    hooks: list[int] = field(default_factory=list)  # indices of hook faults armed on it (--fault)


@dataclass
class _Timer:
    at_s: float
    action: Callable[[], None]


class ChaosRunner:
    """One run of one scenario. Use ``run()`` once.

    Args:
        scenario: the validated scenario.
        out_dir: logs, metrics, report.json, summary.txt and plot.png go here.
        log: receives one human-readable line per notable thing (faults, commits).
        poll_interval_s: period of the control loop, seconds.
    """

    def __init__(
        self, scenario: Scenario, out_dir: Path, log: Callable[[str], None] = print, poll_interval_s: float = 0.25
    ):
        self.scenario, self.out_dir, self.log, self.poll_interval_s = scenario, Path(out_dir), log, poll_interval_s
        self.config = scenario.run_config()
        self.t0 = 0.0
        self.peers: list[_Peer] = []
        self.by_index: dict[int, _Peer] = {}
        self.observed: list[Observed] = []
        self.faults: list[dict] = [
            {"index": i, "kind": f.kind, "label": f.describe(), "fired_at_s": None, "ended_at_s": None, "detail": ""}
            for i, f in enumerate(scenario.faults)
        ]
        self.timers: list[_Timer] = []
        self.topology: NetnsTopology | None = None
        self.coordinator_member: Member | None = None
        self.proxy: TcpProxy | None = None
        self.peer_address: str | None = None
        self.swarm: LocalSwarm | None = None
        self.adversaries: list = []  # Popen of adversary processes (own process groups)
        self.cyclers: dict[int, DutyCycler] = {}  # fault index -> the duty cycler of a cpu_starve fault
        self.probes: list[dict] = []  # DHT probes after a forged record: {at_s, final, out (path), popen}
        self.p2pds: dict[int, float] = {}
        self.orphans: list[dict] = []  # {peer, exit_code, pids} of processes a peer left behind when it exited
        self._next_index = scenario.peers
        self._num_churn = 0
        self._last_rss = 0.0
        self._last_epoch = 0
        self.issuer: Identity | None = None  # the coordinator's identity, when the run is invite-only

    def now(self) -> float:
        return time.time() - self.t0

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def run(self) -> dict:
        """Run the scenario to its end; returns the report (also written to ``out_dir``)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.out_dir / "run.toml"
        config_path.write_text(tomli_w.dumps(self.config.to_dict()))
        (self.out_dir / "scenario.json").write_text(self.scenario.model_dump_json(indent=2))
        timed_out = False
        self.t0 = time.time()
        try:
            self._setup(config_path)
            timed_out = not self._loop()
            if any(f["kind"] == "forge_record" and f["fired_at_s"] is not None for f in self.faults):
                self._probe_dht(final=True)  # while the coordinator's DHT node is still up
        finally:
            dht_probes = self._probe_results()
            leftover = self._teardown()
        # a peer that exited on its own (not crashed on purpose) must not have left its p2pd/DHT processes behind
        leftover += [pid for o in self.orphans if o["exit_code"] in _NORMAL_EXITS for pid in o["pids"]]
        wall_s = time.time() - self.t0
        self._read_state_requests()
        checkpoints = process.check_checkpoints(self.out_dir)
        runs = [p.run for p in self.peers]
        report = build_report(
            self.scenario,
            runs,
            self.faults,
            wall_s=wall_s,
            timed_out=timed_out,
            leftover_pids=leftover,
            checkpoints=checkpoints,
            coordinator_epochs=self._coordinator_epochs(),
            dht_probes=dht_probes,
        )
        report["orphans_after_crash"] = self.orphans
        (self.out_dir / "report.json").write_text(json.dumps(report, indent=2))
        (self.out_dir / "summary.txt").write_text(format_summary(report) + "\n")
        try:
            plot_run(report, runs, self.out_dir / "plot.png")
        except Exception as exc:  # noqa: BLE001 - a plotting failure must not hide the report
            logger.warning("could not draw the plot: %r", exc)
        return report

    def _setup(self, config_path: Path) -> None:
        scenario = self.scenario
        env = {CHUNK_BYTES_ENV: str(scenario.state_chunk_bytes)} if scenario.state_chunk_bytes else {}
        self.swarm = LocalSwarm(self.out_dir, config_path, threads_per_peer=scenario.threads_per_peer, extra_env=env)
        prefix, host = (), "127.0.0.1"
        if scenario.network == "netns":
            self.topology = NetnsTopology()
            self.topology.create()
            self.coordinator_member = self.topology.add_member()
            prefix, host = self.coordinator_member.exec_prefix, self.coordinator_member.ip
        address = self.swarm.start_coordinator(timeout_s=90, prefix=prefix, host=host)
        self.log(f"[{self.now():6.1f}s] coordinator up at {address}")
        if scenario.invite_only:  # the coordinator created its identity file before it published its address
            self.issuer = load_or_create_identity(self.out_dir / "coordinator.key")
        for i, fault in enumerate(scenario.faults):
            if fault.kind == "latency":
                port = int(address.split("/tcp/")[1].split("/")[0])
                self.proxy = TcpProxy(
                    host, port, fault.latency_ms, fault.jitter_ms, fault.loss, fault.rto_ms, seed=scenario.seed
                )
                proxy_port = self.proxy.start()
                self.peer_address = address.replace(f"/tcp/{port}/", f"/tcp/{proxy_port}/")
                self._fired(i, f"proxy on port {proxy_port} in front of the coordinator")
        for index in range(scenario.peers):
            self._launch(index)

    def _loop(self) -> bool:
        """Returns False when the scenario ran past max_duration_s."""
        pending = [i for i, f in enumerate(self.scenario.faults) if f.kind not in LAUNCH_TIME_KINDS]
        while True:
            now = self.now()
            self._poll_peers()
            for index, reason in due_faults(pending, self.scenario, self.observed, now):
                pending.remove(index)
                self._fire(index, reason)
            for timer in [t for t in self.timers if t.at_s <= now]:
                self.timers.remove(timer)
                timer.action()
            if now - self._last_rss >= RSS_INTERVAL_S:
                self._last_rss = now
                self._sample()
            if now > self.scenario.max_duration_s:
                self.log(f"[{now:6.1f}s] max_duration_s reached: stopping")
                return False
            # Byzantine peers are adversaries: once every honest peer is done they are stopped, not awaited (banned
            # by everyone, they may never reach the last epoch).
            # from what _poll_peers recorded, not a second liveness check: a peer that exits between the two would
            # end the loop with its exit (code, summary) never read (CI: 3 honest peers exiting together, "finished"
            # failed with every epoch committed)
            alive = any(p.run.exit_code is None for p in self.peers if not p.run.byzantine)
            waiting_on_time = any(self.scenario.faults[i].at_s is not None for i in pending)
            if not alive and not self.timers and not waiting_on_time:
                return True
            time.sleep(self.poll_interval_s)

    def _teardown(self) -> list[int]:
        """Stop everything started; returns PIDs still alive afterwards."""
        leftover: list[int] = []
        try:
            for index in list(self.cyclers):  # first, or a cycler could SIGSTOP a peer after its SIGCONT below
                self._end_starve(index)
            if self.swarm is not None:
                for proc in self.swarm.history:
                    proc.signal_group(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                for popen in self.adversaries:
                    if popen.poll() is None:
                        os.killpg(popen.pid, signal.SIGKILL)
                    popen.wait(timeout=10)
                self.swarm.close(grace_s=10.0)
                time.sleep(0.5)
                leftover = process.leftovers(self.swarm.history, self.p2pds)
                for proc in self.swarm.history:  # never leave anything behind, even after reporting it
                    proc.signal_group(signal.SIGKILL)
        finally:
            if self.proxy is not None:
                self.proxy.close()
            if self.topology is not None:
                self.topology.close()
        return leftover

    # ---- peers ------------------------------------------------------------------------------------------------
    def _relaunch(self, peer: _Peer) -> None:
        """Start ``peer`` again (a ``restart`` fault): its index and identity, a new name (``peerNr``)."""
        self._launch(peer.run.index, name=f"{peer.run.name}r", identity_of=peer.run.name)

    def _launch(self, index: int | None, name: str = "", identity_of: str = "") -> _Peer:
        """Start a join-swarm peer: ``peer{index}`` (or ``churnN`` for None) unless ``name`` is given; with
        ``identity_of``, the identity file (and join token) of that earlier peer."""
        assert self.swarm is not None
        args: list[str] = ["--identity-path", str(self.out_dir / f"{identity_of}.key")] if identity_of else []
        hooks, byzantine = [], ""
        for i, fault in enumerate(self.scenario.faults):
            if index is None or getattr(fault, "peer", None) != index:
                continue
            if fault.kind == "hook":
                args += ["--fault", fault.spec()]
                hooks.append(i)
            elif fault.kind == "byzantine":
                args += ["--byzantine", fault.mode]
                byzantine = fault.mode
            elif fault.kind == "unreachable":
                args += ["--data-announce-host", UNREACHABLE_HOST]
        if not name and index is None:
            self._num_churn += 1
            name = f"churn{self._num_churn}"
        name = name or f"peer{index}"
        peer_id = ""
        if self.issuer is not None:
            peer_id, token_args = self._invite(identity_of or name, invited=byzantine != "uninvited")
            args += token_args
        member = self.topology.add_member() if self.topology is not None else None
        proc = self.swarm.add_peer(
            args,
            name=name,
            prefix=member.exec_prefix if member else (),
            host=member.ip if member else "127.0.0.1",
            address=self.peer_address,
        )
        run = PeerRun(name=name, index=index, byzantine=byzantine, started_at_s=self.now(), peer_id=peer_id)
        peer = _Peer(proc=proc, run=run)
        peer.member, peer.hooks = member, hooks
        self.peers.append(peer)
        if index is not None:
            self.by_index[index] = peer
        for i, fault in enumerate(self.scenario.faults):
            if fault.kind == "byzantine" and fault.peer == index:
                self._fired(i, f"{name} launched with --byzantine {fault.mode}")
            elif fault.kind == "unreachable" and fault.peer == index:
                self._fired(i, f"{name} launched announcing the undialable data address {UNREACHABLE_HOST}")
        self.log(f"[{self.now():6.1f}s] started {name}" + (f" ({' '.join(args)})" if args else ""))
        return peer

    def _invite(self, name: str, invited: bool) -> tuple[str, list[str]]:
        """Create the identity of peer ``name`` (the file join-swarm's ``--identity-path`` reads) and, if
        ``invited``, a join token for it signed by the coordinator's identity (``name.token``). Returns (its peer
        ID, the join-swarm arguments: ``--join-token @FILE``, or none for an uninvited peer)."""
        assert self.issuer is not None
        identity = load_or_create_identity(self.out_dir / f"{name}.key")
        if not invited:
            return identity.peer_id, []
        now = time.time()
        token = make_token(
            self.issuer.private_key,
            self.config.run_id,
            identity.peer_id,
            issued_at=now,
            expires_at=now + self.scenario.max_duration_s + TOKEN_MARGIN_S,
        )
        path = self.out_dir / f"{name}.token"
        path.write_text(token + "\n")
        return identity.peer_id, ["--join-token", f"@{path}"]

    def _read_state_requests(self) -> None:
        """Record, for every ``uninvited`` peer, who opened a state stream to it (from its log's ``SERVED_MARKER``
        lines), named as the runner knows them (peerN, coordinator), else by peer ID."""
        names = {p.run.peer_id: p.run.name for p in self.peers if p.run.peer_id}
        if self.issuer is not None:
            names[self.issuer.peer_id] = "coordinator"
        for peer in self.peers:
            if peer.run.byzantine != "uninvited" or not peer.proc.log_path.exists():
                continue
            for line in peer.proc.log_path.read_text(errors="replace").splitlines():
                if SERVED_MARKER in line:
                    requester = line.split(SERVED_MARKER, 1)[1].strip()
                    peer.run.state_requests_from.append(names.get(requester, requester or "?"))

    def _poll_peers(self) -> None:
        for peer in self.peers:
            self._read_events(peer)
            run = peer.run
            if run.exit_code is None and not peer.proc.alive():
                run.exit_code, run.exited_at_s = peer.proc.popen.returncode, self.now()
                run.summary = read_peer_summary(peer.proc)
                run.reason = exit_reason(run.summary, peer.proc.log_path, run.exit_code)
                self.log(f"[{run.exited_at_s:6.1f}s] {run.name} exited with code {run.exit_code}")
                self._after_exit(peer)
            if peer.hooks and run.exit_code is None:
                self._check_hooks(peer)

    def _read_events(self, peer: _Peer) -> None:
        path = peer.proc.metrics_path
        if path is None or not path.exists():
            return
        with open(path, "rb") as f:
            f.seek(peer.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n")
        if end < 0:
            return
        peer.offset += end + 1
        for line in chunk[: end + 1].splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            event["t_s"] = event.get("time", self.t0) - self.t0
            peer.run.events.append(event)
            if event["event"] == "fault_fired" and peer.hooks:
                self._hook_fired(peer, event)
            self.observed.append(Observed(peer.run.index, event["event"], int(event.get("epoch", 0)), event["t_s"]))
            if event["event"] == "outer_step" and event["epoch"] > self._last_epoch and not peer.run.byzantine:
                self._last_epoch = event["epoch"]
                loss = event.get("eval_loss")
                self.log(
                    f"[{event['t_s']:6.1f}s] epoch {event['epoch']} committed by {peer.run.name} "
                    f"(group {event.get('group_size')}, eval loss {loss if loss is None else round(loss, 3)})"
                )

    def _after_exit(self, peer: _Peer) -> None:
        """A peer exited: a normal exit must have taken its p2pd along; a crash may orphan it (recorded, reaped).

        A hard crash (``os._exit`` at a hook, like a segfault) leaves the peer's p2pd and DHT child processes behind
        on a volunteer's machine; the harness records them in ``orphans_after_crash`` and reaps them.
        """
        self._read_events(peer)  # all of them now: an exit hook's fault_fired event may have come after the last read
        for i in peer.hooks:
            fault = self.scenario.faults[i]
            if fault.action == "exit" and peer.run.exit_code == 137 and self.faults[i]["fired_at_s"] is not None:
                peer.run.killed = True  # died on purpose at its hook: not a survivor, and not a failure of the run
        left = peer.proc.group_pids()
        if left:
            if peer.run.exit_code in _NORMAL_EXITS:
                deadline = time.monotonic() + 3.0
                while left and time.monotonic() < deadline:
                    time.sleep(0.2)
                    left = peer.proc.group_pids()
            if left:
                self.orphans.append({"peer": peer.run.name, "exit_code": peer.run.exit_code, "pids": left})
                self.log(f"[{self.now():6.1f}s] {peer.run.name} left {len(left)} process(es) behind: reaping them")
            peer.proc.signal_group(signal.SIGKILL)

    def _hook_fired(self, peer: _Peer, event: dict) -> None:
        """A ``fault_fired`` event of ``peer`` (``FaultInjector.on_fire``, written by its trainer before the action
        runs): the first of its unfired raise/sleep/exit hook faults at that point and action whose ``when`` the
        hook's context matches has fired. (A ``stop`` fault is recorded once the peer is seen stopped,
        ``_check_hooks``: the harness must then stop the rest of its process group.)"""
        context = event.get("context") or {}
        for i in peer.hooks:
            fault = self.scenario.faults[i]
            if self.faults[i]["fired_at_s"] is not None or fault.action == "stop":
                continue
            if fault.point.value != event.get("point") or fault.action != event.get("action"):
                continue
            if all(str(context.get(key)) == str(value) for key, value in fault.when.items()):
                detail = f"{peer.run.name}: {fault.spec()} (its fault_fired event)"
                self._fired(i, detail, at_s=event["t_s"])
                return

    def _check_hooks(self, peer: _Peer) -> None:
        """Record a ``stop`` hook fault once its peer has stopped itself, and stop the rest of its process group."""
        for i in peer.hooks:
            fault = self.scenario.faults[i]
            if self.faults[i]["fired_at_s"] is not None:
                continue
            if fault.action == "stop" and process.is_stopped(peer.proc):
                process.pause(peer.proc)  # a laptop lid stops everything: its p2pd and DHT process too
                self._fired(i, f"{peer.run.name} stopped itself at {fault.point}; SIGCONT in {fault.seconds:g}s")
                self.faults[i]["ended_at_s"] = self.now() + fault.seconds
                self.timers.append(_Timer(self.now() + fault.seconds, lambda p=peer.proc: process.resume(p)))

    def _sample(self) -> None:
        for peer in self.peers:
            if peer.proc.alive():
                process.remember_p2pds(peer.proc, self.p2pds)
                peer.run.rss.append((self.now(), process.group_rss_bytes(peer.proc)))

    # ---- faults -----------------------------------------------------------------------------------------------
    def _fired(self, index: int, detail: str, at_s: float | None = None) -> None:
        record = self.faults[index]
        record["fired_at_s"] = round(self.now() if at_s is None else at_s, 2)
        record["detail"] = detail
        self.log(f"[{record['fired_at_s']:6.1f}s] FAULT {record['label']}: {detail}")

    def _peer(self, index: int) -> _Peer | None:
        return self.by_index.get(index)

    def _fire(self, index: int, reason: str) -> None:
        fault = self.scenario.faults[index]
        kind = fault.kind
        target = self._peer(fault.peer) if hasattr(fault, "peer") else None
        if hasattr(fault, "peer") and (target is None or not target.proc.alive()):
            self._fired(index, f"peer {fault.peer} was not running ({reason}); nothing to do")
            self.faults[index]["fired_at_s"] = None  # it did not fire: faults_fired fails
            return
        if kind == "kill":
            target.run.killed = True
            process.kill(target.proc)
            self._fired(index, f"SIGKILL {target.run.name} and its p2pd ({reason})")
        elif kind == "pause":
            process.pause(target.proc)
            self._fired(index, f"SIGSTOP {target.run.name} for {fault.duration_s:g}s ({reason})")
            self.faults[index]["ended_at_s"] = round(self.now() + fault.duration_s, 2)
            self.timers.append(_Timer(self.now() + fault.duration_s, lambda p=target.proc: process.resume(p)))
        elif kind == "cpu_starve":
            self._starve(index, fault, target, reason)
        elif kind == "restart":
            target.run.killed = True
            process.kill(target.proc)
            self._fired(index, f"SIGKILL {target.run.name}, back with its identity in {fault.down_s:g}s ({reason})")
            self.timers.append(_Timer(self.now() + fault.down_s, lambda p=target: self._relaunch(p)))
        elif kind == "kill_p2pd":
            # Without its daemon the peer cannot see the swarm: by design it stops (exit 4) rather than train alone
            # and fork the run. It is a casualty of the fault, not a survivor that must finish.
            target.run.killed = True
            pids = process.kill_p2pd(target.proc)
            self._fired(index, f"SIGKILL p2pd {pids} of {target.run.name} ({reason})")
        elif kind == "kill_coordinator":
            assert self.swarm is not None and self.swarm.coordinator is not None
            process.kill(self.swarm.coordinator)
            self._fired(index, f"SIGKILL coordinator, back in {fault.down_s:g}s ({reason})")
            self.timers.append(_Timer(self.now() + fault.down_s, lambda i=index: self._restart_coordinator(i)))
        elif kind == "join":
            names = [self._launch(self._take_index()).run.name for _ in range(fault.count)]
            self._fired(index, f"started {', '.join(names)} ({reason})")
        elif kind == "bandwidth":
            assert self.topology is not None and target.member is not None
            self.topology.set_bandwidth(target.member, fault.mbps)
            self._fired(index, f"{target.run.name} limited to {fault.mbps:g} Mbit/s each way ({reason})")
        elif kind == "partition":
            assert self.topology is not None
            side = [self.by_index[i] for i in fault.side if i in self.by_index]
            self.topology.isolate([p.member for p in side if p.member is not None])
            self._fired(index, f"cut {', '.join(p.run.name for p in side)} off for {fault.heal_after_s:g}s ({reason})")
            self.faults[index]["ended_at_s"] = round(self.now() + fault.heal_after_s, 2)
            self.timers.append(_Timer(self.now() + fault.heal_after_s, self._heal))
        elif kind == "adversary":
            self._attack(index, fault, target, reason)
        elif kind == "forge_record":
            self._forge(index, fault, reason)
        elif kind == "flood":
            self._flood(index, fault, target, reason)
        elif kind == "churn":
            plan = churn_plan(fault, self.now(), self.scenario.seed)
            self._fired(index, f"{len(plan)} churn events over {fault.duration_s:g}s ({reason})")
            self.faults[index]["ended_at_s"] = round(self.now() + fault.duration_s, 2)
            for step in plan:
                self.timers.append(_Timer(step.t_s, lambda s=step, f=fault: self._churn_step(s, f)))

    def _starve(self, index: int, fault, target: _Peer, reason: str) -> None:
        """Start duty cycling ``target``'s process group (SIGSTOP/SIGCONT, ``chaos/starve.py``); it ends after the
        fault's duration, when the peer exits, or at teardown, and always leaves the group running."""
        cycler = DutyCycler(
            target.proc.signal_group,
            fault.fraction,
            fault.period_s,
            duration_s=fault.duration_s,
            alive=target.proc.alive,
            name=target.run.name,
        )
        self.cyclers[index] = cycler.start()
        until = f"for {fault.duration_s:g}s" if fault.duration_s else "until it exits"
        duty = f"{fault.fraction:g} of every {fault.period_s:g}s (SIGSTOP/SIGCONT)"
        self._fired(index, f"{target.run.name} runs {duty} {until} ({reason})")
        if fault.duration_s:
            self.faults[index]["ended_at_s"] = round(self.now() + fault.duration_s, 2)
            self.timers.append(_Timer(self.now() + fault.duration_s + 0.5, lambda i=index: self._end_starve(i)))

    def _end_starve(self, index: int) -> None:
        """Stop the duty cycler of fault ``index`` (its target left running) and add what it did to the detail."""
        cycler = self.cyclers.pop(index, None)
        if cycler is None:
            return
        stats = cycler.stop()
        record = self.faults[index]
        if record["ended_at_s"] is None or stats.ended_by != "deadline":
            record["ended_at_s"] = round(record["fired_at_s"] + stats.wall_s, 2)
        record["detail"] += f"; {stats.describe()}"
        record["starve"] = dataclasses.asdict(stats)  # stops, conts, running_s, wall_s, ended_by
        self.log(f"[{self.now():6.1f}s] cpu_starve ended: {stats.describe()}")

    def _attack(self, index: int, fault, target: _Peer, reason: str) -> None:
        python, maddr = adversary.adversary_python(), adversary.peer_maddr(target.proc.log_path)
        if python is None or maddr is None:
            why = "py-libp2p is not installed (scripts/setup_adversary)" if python is None else "no address logged"
            self.faults[index]["detail"] = f"adversary not started: {why}"
            self.log(f"[{self.now():6.1f}s] adversary not started: {why}")
            return
        out_path = self.out_dir / f"adversary{index}.jsonl"
        popen = adversary.launch(
            python, maddr, self.config.run_id, fault.duration_s, fault.slowloris, self.scenario.seed, out_path
        )
        self.adversaries.append(popen)
        self._fired(index, f"py-libp2p adversary attacks {target.run.name} for {fault.duration_s:g}s ({reason})")
        self.faults[index]["ended_at_s"] = round(self.now() + fault.duration_s, 2)

        def done() -> None:
            self.faults[index]["detail"] += "; " + adversary.summarize(out_path)

        self.timers.append(_Timer(self.now() + fault.duration_s + 5.0, done))

    def _tool(self, module: str, args: list[str], out_path: Path) -> subprocess.Popen:
        """Start ``python -m module args`` in its own process group (killed at teardown); stdout to ``out_path``."""
        with open(out_path, "ab") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                stdout=out, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        self.adversaries.append(popen)
        return popen

    def _forge(self, index: int, fault, reason: str) -> None:
        assert self.swarm is not None and self.swarm.address is not None
        out = self.out_dir / f"forge{index}.json"
        args = [self.swarm.address, self.config.run_id, "--epoch", str(fault.epoch)]
        popen = self._tool(
            "hivetrain.testing.dht_forger", ["forge", *args, "--expires-in-s", str(fault.expires_in_s)], out
        )
        self._fired(
            index,
            f"an attacker stores a record of epoch {fault.epoch} expiring in {fault.expires_in_s:g}s ({reason})",
        )
        self.faults[index]["ended_at_s"] = round(self.now() + fault.probe_after_s, 2)

        def done() -> None:  # the attacker has stored its record and left by now (if not, the probe waits)
            if popen.poll() is None and self.now() < self.faults[index]["fired_at_s"] + PROBE_TIMEOUT_S:
                self.timers.append(_Timer(self.now() + 1.0, done))
                return
            answer = out.read_text().strip()[-300:] if out.exists() else ""
            self.faults[index]["detail"] += "; forger: " + (answer or "no answer")
            self._probe_dht(final=False)

        self.timers.append(_Timer(self.now() + fault.probe_after_s, done))

    def _probe_dht(self, final: bool) -> None:
        """Read the run's peer records from the honest DHT nodes without a guard (``testing/dht_forger.py probe``);
        the end-of-run probe waits for its answer, the others are read at the end."""
        assert self.swarm is not None and self.swarm.address is not None
        n = len(self.probes)
        out = self.out_dir / f"dht_probe{n}.json"
        popen = self._tool("hivetrain.testing.dht_forger", ["probe", self.swarm.address, self.config.run_id], out)
        self.probes.append({"at_s": round(self.now(), 2), "final": final, "out": out, "popen": popen})
        self.log(f"[{self.now():6.1f}s] probing the DHT for forged records{' (end of run)' if final else ''}")
        if final:
            try:
                popen.wait(timeout=PROBE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass

    def _probe_results(self) -> list[dict]:
        results = []
        for probe in self.probes:
            popen, out = probe["popen"], probe["out"]
            try:
                popen.wait(timeout=max(1.0, PROBE_TIMEOUT_S - (self.now() - probe["at_s"])))
            except subprocess.TimeoutExpired:
                pass
            lines = out.read_text().splitlines() if out.exists() else []
            try:
                answer = json.loads(lines[-1]) if lines else {"ok": False, "error": "no answer"}
            except json.JSONDecodeError:
                answer = {"ok": False, "error": "unreadable answer"}
            results.append({"at_s": probe["at_s"], "final": probe["final"], **answer})
        return results

    def _flood(self, index: int, fault, target: _Peer, reason: str) -> None:
        log = target.proc.log_path.read_text(errors="replace") if target.proc.log_path.exists() else ""
        match = _DATA_PORT.search(log)
        if match is None:
            self.faults[index]["detail"] = f"flood not started: {target.run.name} logged no data port"
            return
        host, port = match.group(1), match.group(2)
        out = self.out_dir / f"flood{index}.json"
        counts = ["--idle", str(fault.idle), "--slowloris", str(fault.slowloris), "--oversized", str(fault.oversized)]
        self._tool("hivetrain.testing.flood", [host, port, "--duration-s", str(fault.duration_s), *counts], out)
        self._fired(
            index,
            f"{fault.idle} idle + {fault.slowloris} slowloris + {fault.oversized} oversized connections to "
            f"{target.run.name}'s data port {port} for {fault.duration_s:g}s ({reason})",
        )
        self.faults[index]["ended_at_s"] = round(self.now() + fault.duration_s, 2)

        ends_at_s = self.now() + fault.duration_s

        def done() -> None:  # the flood prints its counters once it has closed its connections
            counters = out.read_text().strip() if out.exists() else ""
            if not counters and self.now() < ends_at_s + PROBE_TIMEOUT_S:
                self.timers.append(_Timer(self.now() + 1.0, done))
                return
            self.faults[index]["detail"] += "; flood: " + (counters or "no counters")

        self.timers.append(_Timer(ends_at_s + 1.0, done))

    def _coordinator_epochs(self) -> list[int]:
        """The epochs the coordinator downloaded (its log, restarts included)."""
        path = self.out_dir / "coordinator.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return [int(m.group(1)) for m in _COORDINATOR_DOWNLOAD.finditer(text)]

    def _take_index(self) -> int:
        index = self._next_index
        self._next_index += 1
        return index

    def _restart_coordinator(self, index: int) -> None:
        assert self.swarm is not None
        try:
            address = self.swarm.restart_coordinator(timeout_s=90)
            self.faults[index]["ended_at_s"] = round(self.now(), 2)
            self.log(f"[{self.now():6.1f}s] coordinator restarted at {address}")
        except RuntimeError as exc:
            self.faults[index]["detail"] += f"; restart failed: {exc}"
            self.log(f"[{self.now():6.1f}s] coordinator restart FAILED: {exc}")

    def _heal(self) -> None:
        assert self.topology is not None
        self.topology.heal()
        self.log(f"[{self.now():6.1f}s] partition healed")

    def _churn_step(self, step: ChurnStep, fault) -> None:
        live = {p.run.name: p for p in self.peers if p.proc.alive() and not p.run.killed}
        protected = [name for name, p in live.items() if p.run.byzantine]
        action, victim, why = churn_decision(step, list(live), protected, fault.min_peers, fault.max_peers)
        record = {"index": None, "kind": f"churn:{action}", "fired_at_s": round(self.now(), 2), "ended_at_s": None}
        if action == "join":
            name = self._launch(None).run.name
            record.update(label=f"+{name}", detail=f"started {name} ({why})")
        elif action == "kill":
            live[victim].run.killed = True
            process.kill(live[victim].proc)
            record.update(label=f"-{victim}", detail=f"SIGKILL {victim} ({why})")
        else:
            return
        self.faults.append(record)
        self.log(f"[{self.now():6.1f}s] CHURN {record['detail']}")


def run_scenario(scenario: Scenario, out_dir: Path, log: Callable[[str], None] = print) -> dict:
    """Run ``scenario`` with its processes' files in ``out_dir``; returns the report (also in out_dir/report.json)."""
    return ChaosRunner(scenario, out_dir, log=log).run()
