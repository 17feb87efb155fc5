"""Run a chaos scenario: launch a coordinator and peers as real processes, apply the faults, write the report.

``run_scenario(scenario, out_dir)`` is the whole lifecycle: set up (network namespaces, proxy, coordinator, initial
peers), a poll loop a few times a second (read the peers' metrics, fire due faults and timers, sample RSS, notice
exits), then tear everything down in ``finally`` and compute ``report.json``, ``summary.txt`` and ``plot.png`` in
``out_dir``. Whatever happens (an exception, Ctrl+C), every process group it started is killed and every namespace it
created is deleted before it returns or raises.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from hivetrain.chaos import firing, process
from hivetrain.chaos.facts import PeerRun
from hivetrain.chaos.fault_models import LAUNCH_TIME_KINDS, UNREACHABLE_HOST
from hivetrain.chaos.network import Member, NetnsTopology, TcpProxy
from hivetrain.chaos.plot import plot_run
from hivetrain.chaos.report import build_report, format_summary
from hivetrain.chaos.scenario import Scenario
from hivetrain.chaos.schedule import Observed, due_faults
from hivetrain.chaos.starve import DutyCycler
from hivetrain.localswarm.launcher import LocalSwarm, PeerProcess
from hivetrain.localswarm.summary import exit_reason, read_events, read_peer_summary
from hivetrain.peers.identity import Identity, load_or_create_identity
from hivetrain.peers.membership import make_token
from hivetrain.testing.byzantine import CHUNK_BYTES_ENV, SERVED_MARKER
from hivetrain.testing.hostile_peer import ENTRY as HOSTILE_ENTRY

logger = logging.getLogger(__name__)

RSS_INTERVAL_S = 2.0
TOKEN_MARGIN_S = 3600.0  # join tokens expire this long after the scenario's max_duration_s
_NORMAL_EXITS = (0, 2, 3, 4, 130)


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
            if timed_out and self.swarm is not None:  # where a hang waits: every live process's stacks, in its log
                process.dump_stacks(self.swarm.history)
            if any(f["kind"] == "forge_record" and f["fired_at_s"] is not None for f in self.faults):
                self.probe_dht(final=True)  # while the coordinator's DHT node is still up
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
                self.fired(i, f"proxy on port {proxy_port} in front of the coordinator")
        for index in range(scenario.peers):
            self.launch(index)

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
                firing.end_starve(self, index)
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
    def relaunch(self, peer: _Peer) -> None:
        """Start ``peer`` again (a ``restart`` fault): its index and identity, a new name (``peerNr``)."""
        self.launch(peer.run.index, name=f"{peer.run.name}r", identity_of=peer.run.name)

    def launch(self, index: int | None, name: str = "", identity_of: str = "") -> _Peer:
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
            entry=HOSTILE_ENTRY,  # join-swarm with the harness flags above (and the scenario's state chunk size)
        )
        run = PeerRun(name=name, index=index, byzantine=byzantine, started_at_s=self.now(), peer_id=peer_id)
        peer = _Peer(proc=proc, run=run)
        peer.member, peer.hooks = member, hooks
        self.peers.append(peer)
        if index is not None:
            self.by_index[index] = peer
        for i, fault in enumerate(self.scenario.faults):
            if fault.kind == "byzantine" and fault.peer == index:
                self.fired(i, f"{name} launched with --byzantine {fault.mode}")
            elif fault.kind == "unreachable" and fault.peer == index:
                self.fired(i, f"{name} launched announcing the undialable data address {UNREACHABLE_HOST}")
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
                self.fired(i, detail, at_s=event["t_s"])
                return

    def _check_hooks(self, peer: _Peer) -> None:
        """Record a ``stop`` hook fault once its peer has stopped itself, and stop the rest of its process group."""
        for i in peer.hooks:
            fault = self.scenario.faults[i]
            if self.faults[i]["fired_at_s"] is not None:
                continue
            if fault.action == "stop" and process.is_stopped(peer.proc):
                process.pause(peer.proc)  # a laptop lid stops everything: its p2pd and DHT process too
                self.fired(i, f"{peer.run.name} stopped itself at {fault.point}; SIGCONT in {fault.seconds:g}s")
                self.faults[i]["ended_at_s"] = self.now() + fault.seconds
                self.later(self.now() + fault.seconds, lambda p=peer.proc: process.resume(p))

    def _sample(self) -> None:
        for peer in self.peers:
            if peer.proc.alive():
                process.remember_p2pds(peer.proc, self.p2pds)
                peer.run.rss.append((self.now(), process.group_rss_bytes(peer.proc)))

    # ---- faults -----------------------------------------------------------------------------------------------
    def fired(self, index: int, detail: str, at_s: float | None = None) -> None:
        record = self.faults[index]
        record["fired_at_s"] = round(self.now() if at_s is None else at_s, 2)
        record["detail"] = detail
        self.log(f"[{record['fired_at_s']:6.1f}s] FAULT {record['label']}: {detail}")

    def _peer(self, index: int) -> _Peer | None:
        return self.by_index.get(index)

    def _fire(self, index: int, reason: str) -> None:
        """Fire triggered fault ``index`` (``firing.FIRE`` by its model's type), unless the peer it names is gone."""
        fault = self.scenario.faults[index]
        target = self._peer(fault.peer) if hasattr(fault, "peer") else None
        if hasattr(fault, "peer") and (target is None or not target.proc.alive()):
            self.fired(index, f"peer {fault.peer} was not running ({reason}); nothing to do")
            self.faults[index]["fired_at_s"] = None  # it did not fire: faults_fired fails
            return
        firing.FIRE[type(fault)](self, index, fault, target, reason)

    def later(self, at_s: float, action: Callable[[], None]) -> None:
        """Run ``action`` from the control loop once the run's clock (``now()``) reaches ``at_s``."""
        self.timers.append(_Timer(at_s, action))

    def probe_dht(self, final: bool) -> None:
        """Read the run's peer records from the honest DHT nodes without a guard (``testing/dht_forger.py probe``);
        the end-of-run probe waits for its answer, the others are read at the end."""
        assert self.swarm is not None and self.swarm.address is not None
        n = len(self.probes)
        out = self.out_dir / f"dht_probe{n}.json"
        args = ["probe", self.swarm.address, self.config.run_id]
        popen = firing.tool(self, "hivetrain.testing.dht_forger", args, out)
        self.probes.append({"at_s": round(self.now(), 2), "final": final, "out": out, "popen": popen})
        self.log(f"[{self.now():6.1f}s] probing the DHT for forged records{' (end of run)' if final else ''}")
        if final:
            try:
                popen.wait(timeout=firing.PROBE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass

    def _probe_results(self) -> list[dict]:
        results = []
        for probe in self.probes:
            popen, out = probe["popen"], probe["out"]
            try:
                popen.wait(timeout=max(1.0, firing.PROBE_TIMEOUT_S - (self.now() - probe["at_s"])))
            except subprocess.TimeoutExpired:
                pass
            lines = out.read_text().splitlines() if out.exists() else []
            try:
                answer = json.loads(lines[-1]) if lines else {"ok": False, "error": "no answer"}
            except json.JSONDecodeError:
                answer = {"ok": False, "error": "unreadable answer"}
            results.append({"at_s": probe["at_s"], "final": probe["final"], **answer})
        return results

    def _coordinator_epochs(self) -> list[int]:
        """The epochs the coordinator downloaded (its metrics events, restarts included: the file is appended to)."""
        events = read_events(self.out_dir / "coordinator.jsonl")
        return [int(e["epoch"]) for e in events if e["event"] == "state_downloaded"]

    def take_index(self) -> int:
        index = self._next_index
        self._next_index += 1
        return index


def run_scenario(scenario: Scenario, out_dir: Path, log: Callable[[str], None] = print) -> dict:
    """Run ``scenario`` with its processes' files in ``out_dir``; returns the report (also in out_dir/report.json)."""
    return ChaosRunner(scenario, out_dir, log=log).run()
