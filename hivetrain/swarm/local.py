"""Run a pipelined swarm on this machine: a coordinator publishing a run config with ``[swarm]``, S x K stage servers
and T pipeline trainers, each a ``join-swarm`` process on 127.0.0.1 (``--role server --stage s`` / ``--role
trainer``): the same commands volunteers run. ``hivetrain local-swarm --pipeline S`` calls ``run_local_pipeline``.

Processes are started and stopped by ``hivetrain.localswarm.launcher.LocalSwarm`` (each in its own session; only
processes started here are ever signalled, by process-group ID). Logs, per-process summaries, ``run.toml`` and
``summary.json`` go to ``out_dir``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import tomli_w

from hivetrain.config import RunConfig
from hivetrain.data.config import DataConfig
from hivetrain.diloco.config import DilocoConfig
from hivetrain.localswarm.launcher import LOOPBACK, LocalSwarm, PeerProcess
from hivetrain.model import count_parameters
from hivetrain.peers.node import NodeConfig, PeerNode, start_node
from hivetrain.swarm.announce import fetch_stage_records
from hivetrain.swarm.config import SwarmConfig

logger = logging.getLogger(__name__)


def default_run(model: str, seed: int) -> RunConfig:
    """A run sized for a laptop demo: 8-window steps of 128 tokens, short phases, no warmup, 3 stages."""
    return RunConfig(
        run_id="pipeline",
        model=model,
        seed=seed,
        data=DataConfig(seq_len=128, batch_size=8, max_corpus_bytes=8 * 2**20),
        diloco=DilocoConfig(inner_steps=10, warmup_steps=0, inner_lr=3e-3),
        averaging=dataclasses.replace(RunConfig().averaging, matchmaking_time_s=2.0, round_timeout_s=30.0),
        swarm=SwarmConfig(),
    )


class LocalPipeline:
    """Starts the processes of a local pipelined swarm and guarantees their cleanup in ``close()``.

    Args:
        run: a pipelined run config (``run.pipelined``); written to ``out_dir/run.toml`` for the coordinator.
        extra_args: join-swarm arguments added to every server and trainer (``local-swarm --peer-args``).
        coordinator_args: extra ``hivetrain coordinator`` arguments (e.g. ``--http-port``).
    """

    def __init__(
        self,
        out_dir: Path,
        run: RunConfig,
        threads_per_process: int = 1,
        verbose: bool = False,
        extra_args: Sequence[str] = (),
        coordinator_args: Sequence[str] = (),
    ):
        if not run.pipelined:
            raise ValueError("LocalPipeline needs a pipelined run config (a [swarm] table with num_stages >= 1)")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.run, self.swarm = run, run.swarm
        self.config_path = self.out_dir / "run.toml"
        self.config_path.write_text(tomli_w.dumps(run.to_dict()))
        self.launcher = LocalSwarm(self.out_dir, self.config_path, threads_per_process, verbose=verbose)
        self.extra_args, self.coordinator_args = list(extra_args), list(coordinator_args)
        self.observer: PeerNode | None = None
        self.servers: list[PeerProcess] = []
        self.trainers: list[PeerProcess] = []

    def start_bootstrap(self, timeout_s: float = 60.0) -> list[str]:
        """Start the coordinator (no state copy: a pipeline's state lives in its stages); returns its address (what
        volunteers are given)."""
        address = self.launcher.start_coordinator(timeout_s, extra_args=["--no-state", *self.coordinator_args])
        return [address]

    def _observe(self) -> PeerNode:
        """An in-process DHT node that reads the stage records (started on first use: after the processes, so that
        its start overlaps theirs)."""
        if self.observer is None:
            address = self.launcher.address
            self.observer = start_node(NodeConfig(initial_peers=(address,), host_maddrs=(LOOPBACK,), use_relay=False))
        return self.observer

    def add_server(self, stage: int | None, name: str, extra_args: Sequence[str] = ()) -> PeerProcess:
        args = ["--role", "server", *(["--stage", str(stage)] if stage is not None else []), *self.extra_args]
        proc = self.launcher.add_peer([*args, *extra_args], name=name)
        self.servers.append(proc)
        return proc

    def add_trainer(self, index: int, extra_args: Sequence[str] = ()) -> PeerProcess:
        proc = self.launcher.add_peer(["--role", "trainer", *self.extra_args, *extra_args], name=f"trainer{index}")
        self.trainers.append(proc)
        return proc

    def wait_for_servers(self, count: int, timeout_s: float) -> None:
        """Block until ``count`` servers announce themselves. Raises RuntimeError (with a log tail) otherwise."""
        deadline = time.monotonic() + timeout_s
        observer = self._observe()
        while len(fetch_stage_records(observer.dht, self.run.run_id)) < count:
            dead = [p for p in self.servers if not p.alive()]
            if dead or time.monotonic() > deadline:
                culprit = dead[0] if dead else self.servers[-1]
                raise RuntimeError(f"stage servers did not start; {culprit.log_path}:\n{_tail(culprit.log_path)}")
            time.sleep(0.5)

    def wait_trainers(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while any(p.alive() for p in self.trainers):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return True

    def close(self, grace_s: float = 20.0) -> None:
        """SIGTERM every process group still running (the coordinator too: servers and trainers leave through their
        own DHT nodes), SIGKILL what is left after ``grace_s``; stop the observer node."""
        self.launcher.close(grace_s)
        if self.observer is not None:
            self.observer.shutdown()


def _tail(path: Path, num_chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-num_chars:]
    except OSError:
        return ""


def _read_json(path: Path | None) -> dict | None:
    try:
        return json.loads(Path(path).read_text()) if path else None
    except (OSError, ValueError):
        return None


def run_local_pipeline(
    out_dir: Path,
    run: RunConfig,
    servers_per_stage: int,
    trainers: int,
    *,
    threads_per_process: int = 1,
    timeout_s: float = 1800.0,
    verbose: bool = False,
    extra_args: Sequence[str] = (),
    coordinator_args: Sequence[str] = (),
) -> dict:
    """Train the pipelined run ``run`` (``run.swarm.num_stages`` stages, each served by ``servers_per_stage``
    processes) with ``trainers`` trainer processes running ``run.swarm.trainer_steps`` steps each; write
    ``out_dir/summary.json`` and return it.

    Args:
        threads_per_process: torch threads of each process.
        timeout_s: stop everything after this many seconds (summary["timed_out"] = True).
        extra_args: join-swarm arguments for every process; ``coordinator_args``: for the coordinator.

    Raises:
        ValueError: counts below 1, a run that is not pipelined, or trainers that would never stop
            (``swarm.trainer_steps`` = 0).
        RuntimeError: the coordinator or the stage servers did not come up (the message shows the failing log).
    """
    if min(servers_per_stage, trainers) < 1:
        raise ValueError("servers_per_stage and trainers must be >= 1")
    if not run.pipelined:
        raise ValueError("run_local_pipeline needs a pipelined run config (a [swarm] table with num_stages >= 1)")
    if run.swarm.trainer_steps < 1:
        raise ValueError("a local pipeline must end: set swarm.trainer_steps (local-swarm --steps) >= 1")
    stages = run.swarm.num_stages
    out = Path(out_dir)
    pipeline = LocalPipeline(out, run, threads_per_process, verbose, extra_args, coordinator_args)
    started = time.time()
    finished = False
    try:
        pipeline.start_bootstrap()
        for stage in range(stages):
            for k in range(servers_per_stage):
                pipeline.add_server(stage, f"server{stage}_{k}")
        for index in range(trainers):  # trainers wait until every stage is served
            pipeline.add_trainer(index)
        pipeline.wait_for_servers(stages * servers_per_stage, timeout_s=min(timeout_s, 300.0))
        finished = pipeline.wait_trainers(timeout_s - (time.time() - started))
    finally:
        pipeline.close()
    summary = build_pipeline_summary(pipeline, wall_s=time.time() - started)
    summary["timed_out"] = not finished
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def build_pipeline_summary(pipeline: LocalPipeline, wall_s: float) -> dict:
    """The summary.json of a pipelined run: the fields of the data-parallel local swarm's summary that apply, plus
    pipeline figures (microbatches/s, reroutes, replays, rebalances) and per-process stats."""
    trainer_stats = {p.name: _read_json(p.summary_path) for p in pipeline.trainers}
    server_stats = {p.name: _read_json(p.summary_path) for p in pipeline.servers}
    done = [s for s in trainer_stats.values() if s]
    initial = [s["initial_eval_loss"] for s in done if s.get("initial_eval_loss") is not None]
    final = [s["final_eval_loss"] for s in done if s.get("final_eval_loss") is not None]
    microbatches = sum(s.get("microbatches", 0) for s in done)
    train_wall_s = max((s.get("train_wall_s", 0.0) for s in done), default=0.0)
    servers = [s for s in server_stats.values() if s]
    hashes: dict[str, dict[str, str]] = {}
    held: dict[str, dict[int, set[str]]] = {}  # stage -> epoch -> state hashes its servers hold there
    for s in servers:
        hashes.setdefault(str(s["stage"]), {})[s["peer_id"]] = f"epoch {s['epoch']}: {s.get('state_hash', '')[:16]}"
        held.setdefault(str(s["stage"]), {}).setdefault(s["epoch"], set()).add(s.get("state_hash", ""))
    return {
        "mode": "pipeline",
        "model": pipeline.run.model,
        "num_parameters": _num_parameters(pipeline.run),
        "stages": pipeline.swarm.num_stages,
        "servers_per_stage": len(pipeline.servers) // max(pipeline.swarm.num_stages, 1),
        "trainers": len(pipeline.trainers),
        "peers": [s["peer_id"] for s in done] + [s["peer_id"] for s in servers],
        "steps": min((s.get("steps", 0) for s in done), default=0),
        "initial_eval_loss": sum(initial) / len(initial) if initial else None,
        "final_eval_loss": sum(final) / len(final) if final else None,
        "final_eval_loss_per_peer": final,
        "wall_s": wall_s,
        "microbatches": microbatches,
        "microbatches_per_s": microbatches / train_wall_s if train_wall_s else 0.0,
        "reroutes": sum(s.get("reroutes", 0) for s in done),
        "replays": sum(s.get("replays", 0) for s in done),
        "failed_steps": sum(s.get("failed_steps", 0) for s in done),
        "rebalances": sum(s.get("rebalances", 0) for s in servers),
        "outer_steps": {str(s["stage"]): s["epoch"] for s in servers},
        "state_hashes": hashes,
        "stage_hashes_agree": {stage: all(len(h) == 1 for h in epochs.values()) for stage, epochs in held.items()},
        "state_downloads": sum(s.get("state_downloads", 0) for s in servers),
        "bytes_sent_total": sum(s.get("bytes_sent", 0) for s in done),
        "exit_codes": {p.name: p.popen.returncode for p in [*pipeline.trainers, *pipeline.servers]},
        "trainer_stats": trainer_stats,
        "server_stats": server_stats,
    }


def _num_parameters(run: RunConfig) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from hivetrain.swarm.process import describe_model

    config, _ = describe_model(run)
    with torch.device("meta"):  # shapes only
        return count_parameters(AutoModelForCausalLM.from_config(config))
