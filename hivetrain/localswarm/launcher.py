"""Launch a coordinator and join-swarm peers as real processes on 127.0.0.1, and clean them up.

Each process runs in its own session/process group, so that signalling the group reaches its p2pd daemon too.
Only processes started here are ever signalled, by their process-group ID.

A process may run under a command prefix (``ip netns exec NS``, which execs in place, so the PID is the Python
process's) and listen on another host than 127.0.0.1; the chaos harness uses both for network faults. The coordinator
can be restarted with the same identity and port, so the address volunteers were given stays valid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hivetrain.localswarm import forkserver

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


@dataclass
class PeerProcess:
    """One launched process (coordinator or peer) and its files."""

    name: str
    popen: subprocess.Popen | forkserver.ForkedProcess
    log_path: Path
    metrics_path: Path | None = None
    summary_path: Path | None = None
    started_at: float = field(default_factory=time.time)
    exited_at: float | None = None  # unix time (s) ``alive()`` first saw it exited; None = not seen yet

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        """Whether the process runs; the first call that finds it exited records ``exited_at``."""
        if self.popen.poll() is None:
            return True
        if self.exited_at is None:
            self.exited_at = time.time()
        return False

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the process group (the process and its p2pd)."""
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def group_pids(self) -> list[int]:
        """PIDs of every live process in this process's group (itself, its p2pd, orphans it left)."""
        return group_pids(self.popen.pid)


def group_pids(pgid: int) -> list[int]:
    """PIDs of the live (non-zombie) processes whose process group is ``pgid`` (scans /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry))
    return found


def stop_groups(procs: list[PeerProcess], grace_s: float) -> None:
    """SIGTERM the process group of every live process, wait up to ``grace_s`` seconds in all, then SIGKILL every
    group (which also ends a p2pd left behind in a group whose leader already exited)."""
    for proc in procs:
        if proc.alive():
            proc.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        proc.signal_group(signal.SIGKILL)
        if proc.alive():
            proc.popen.wait(timeout=5)


class LocalSwarm:
    """Starts processes under ``out_dir`` and guarantees their cleanup in ``close()``."""

    def __init__(
        self,
        out_dir: Path,
        config_path: Path,
        threads_per_peer: int = 1,
        verbose: bool = False,
        extra_env: dict[str, str] | None = None,
    ):
        """Processes started without a command prefix are forked from one process that has imported torch,
        transformers and hivemind (``localswarm.forkserver``: about 6 s of CPU saved per process) where the platform has
        a fork server; a fresh interpreter each otherwise."""
        self.out_dir = Path(out_dir)
        self.preload = forkserver.available()
        self.extra_env = dict(extra_env or {})
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = Path(config_path)
        self.threads_per_peer = threads_per_peer
        self.verbose = verbose
        self.coordinator: PeerProcess | None = None
        self.peers: list[PeerProcess] = []
        self.address: str | None = None
        self._coordinator_launch: tuple[list[str], list[str]] | None = None  # (argv, prefix) for restarts
        self.history: list[PeerProcess] = []  # every process ever started, restarts included

    def _spawn(self, name: str, argv: list[str], prefix: Sequence[str] = (), **paths) -> PeerProcess:
        log_path = self.out_dir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(self.threads_per_peer), **self.extra_env}
        if self.preload and not prefix:  # a prefix (``ip netns exec``) must exec
            popen = forkserver.start(argv, env, log_path)
        else:
            with open(log_path, "ab") as log:
                popen = subprocess.Popen(
                    [*prefix, sys.executable, "-m", *argv],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    env=env,
                )
        proc = PeerProcess(name=name, popen=popen, log_path=log_path, **paths)
        self.history.append(proc)
        return proc

    def start_coordinator(
        self,
        timeout_s: float = 60.0,
        extra_args: Sequence[str] = (),
        prefix: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> str:
        """Start the coordinator and wait for its address. Raises RuntimeError if it is not up in time.

        Args:
            prefix: command prefix (e.g. ``["ip", "netns", "exec", NS]``).
            host, port: where it listens (port 0 = any free port).
        """
        argv = [
            "hivetrain.cli.main",
            "coordinator",
            "--config",
            str(self.config_path),
            "--identity-path",
            str(self.out_dir / "coordinator.key"),
            "--host-maddrs",
            f"/ip4/{host}/tcp/{port}",
            "--address-file",
            str(self.out_dir / "coordinator.addr"),
            "--metrics-file",
            str(self.out_dir / "coordinator.jsonl"),
            "--refresh-interval",
            "2",
            *extra_args,
        ]
        self._coordinator_launch = (argv, list(prefix))
        return self._launch_coordinator(timeout_s)

    def restart_coordinator(self, timeout_s: float = 60.0) -> str:
        """Start the coordinator again (after it died) with the same identity, host and port: the same address.

        Raises RuntimeError if it is not up in time (e.g. the port is taken).
        """
        assert self._coordinator_launch is not None and self.address is not None, "start the coordinator first"
        argv, prefix = self._coordinator_launch
        port = self.address.split("/tcp/")[1].split("/")[0]
        argv = [a if not a.startswith("/ip4/") else a.rsplit("/", 1)[0] + f"/{port}" for a in argv]
        self._coordinator_launch = (argv, prefix)
        return self._launch_coordinator(timeout_s)

    def _launch_coordinator(self, timeout_s: float) -> str:
        argv, prefix = self._coordinator_launch
        address_file = self.out_dir / "coordinator.addr"
        address_file.unlink(missing_ok=True)
        self.coordinator = self._spawn("coordinator", argv, prefix)
        deadline = time.monotonic() + timeout_s
        while not address_file.exists():
            if not self.coordinator.alive() or time.monotonic() > deadline:
                log = self.coordinator.log_path.read_text()
                refusals = [line.removeprefix("error: ") for line in log.splitlines() if line.startswith("error: ")]
                if refusals:  # it said why (a bad config, a disk too small): that is the message
                    raise RuntimeError(
                        f"the coordinator refused to start: {refusals[-1]} (log: {self.coordinator.log_path})"
                    )
                why = "exited" if not self.coordinator.alive() else f"no address after {timeout_s:.0f} s"
                raise RuntimeError(
                    f"coordinator did not start ({why}); see {self.coordinator.log_path}:\n{log[-2000:]}"
                )
            time.sleep(0.2)
        self.address = address_file.read_text().split()[0]
        return self.address

    def add_peer(
        self,
        extra_args: Sequence[str] = (),
        name: str | None = None,
        prefix: Sequence[str] = (),
        host: str = "127.0.0.1",
        address: str | None = None,
        entry: str = "hivetrain.cli.join_swarm",
    ) -> PeerProcess:
        """Start one join-swarm process bootstrapping from the coordinator.

        Args:
            prefix: command prefix (e.g. ``["ip", "netns", "exec", NS]``).
            host: the address it listens on.
            address: bootstrap from this multiaddr instead of the coordinator's (e.g. a proxy in front of it).
            entry: the module whose ``main(argv)`` runs the peer: ``join-swarm`` itself, or a harness wrapping it
                (the chaos harness's ``hivetrain.testing.hostile_peer``), given the same arguments.
        """
        assert self.address is not None, "start the coordinator first"
        index = len(self.peers)
        name = name or f"peer{index}"
        metrics, summary = self.out_dir / f"{name}.jsonl", self.out_dir / f"{name}.json"
        argv = [
            entry,
            address or self.address,
            "--identity-path",
            str(self.out_dir / f"{name}.key"),
            "--host-maddrs",
            f"/ip4/{host}/tcp/0",
            "--metrics-file",
            str(metrics),
            "--summary-file",
            str(summary),
            "--threads",
            str(self.threads_per_peer),
            *extra_args,
        ]
        if self.verbose:
            argv.append("--verbose")
        peer = self._spawn(name, argv, prefix, metrics_path=metrics, summary_path=summary)
        self.peers.append(peer)
        return peer

    def wait_peers(self, timeout_s: float, poll=None) -> bool:
        """Wait until every peer has exited; ``poll()`` is called about once a second. Returns False on timeout."""
        deadline = time.monotonic() + timeout_s
        while any(p.alive() for p in self.peers):
            if time.monotonic() > deadline:
                return False
            if poll is not None:
                poll()
            time.sleep(1.0)
        return True

    def close(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process group still running, then SIGKILL what is left after ``grace_s``."""
        stop_groups([p for p in self.history if p.alive() or p.group_pids()], grace_s)
