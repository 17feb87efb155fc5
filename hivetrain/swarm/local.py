"""Run a pipelined swarm on this machine: a bootstrap DHT node, S x K stage-server processes and T trainer processes
on 127.0.0.1. ``hivetrain local-swarm --pipeline S --servers-per-stage K --trainers T`` calls ``run_local_pipeline``.

Every process runs in its own session, so signalling its process group reaches its p2pd daemon too; only processes
started here are ever signalled, by process-group ID. Logs, per-process stats and ``summary.json`` go to ``out_dir``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from hivetrain.config import DataConfig, DilocoConfig, RunConfig
from hivetrain.model import count_parameters
from hivetrain.peers.node import NodeConfig, PeerNode, start_node
from hivetrain.swarm.announce import fetch_stage_records
from hivetrain.swarm.config import SwarmConfig
from hivetrain.swarm.process import write_process_config
from hivetrain.testing.launcher import PeerProcess, stop_groups

logger = logging.getLogger(__name__)

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def default_run(model: str, seed: int) -> RunConfig:
    """A run sized for a laptop demo: 8-window steps of 128 tokens, short phases, no warmup."""
    return RunConfig(
        run_id="pipeline",
        model=model,
        seed=seed,
        data=DataConfig(seq_len=128, batch_size=8, max_corpus_bytes=8 * 2**20),
        diloco=DilocoConfig(inner_steps=10, warmup_steps=0, inner_lr=3e-3),
        averaging=dataclasses.replace(RunConfig().averaging, matchmaking_time_s=2.0, round_timeout_s=30.0),
    )


class LocalPipeline:
    """Starts the processes of a local pipelined swarm and guarantees their cleanup in ``close()``."""

    def __init__(self, out_dir: Path, run: RunConfig, swarm: SwarmConfig, threads_per_process: int = 1):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.run, self.swarm, self.threads = run, swarm, threads_per_process
        self.config_path = self.out_dir / "pipeline.json"
        write_process_config(self.config_path, run, swarm)
        self.boot: PeerNode | None = None
        self.servers: list[PeerProcess] = []
        self.trainers: list[PeerProcess] = []

    def start_bootstrap(self) -> list[str]:
        self.boot = start_node(NodeConfig(host_maddrs=(LOOPBACK,), use_relay=False))
        return self.boot.visible_maddrs()

    def _spawn(self, name: str, module: str, args: list[str]) -> PeerProcess:
        log_path = self.out_dir / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.threads))
        argv = [
            sys.executable, "-m", module, "--config", str(self.config_path),
            "--initial-peers", *self.boot.visible_maddrs(), "--host-maddrs", LOOPBACK,
            "--identity-path", str(self.out_dir / f"{name}.key"), "--stats-file", str(self.out_dir / f"{name}.json"),
            *args,
        ]  # fmt: skip
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env
            )
        return PeerProcess(name=name, popen=popen, log_path=log_path, summary_path=self.out_dir / f"{name}.json")

    def add_server(self, stage: int | None, name: str, extra_args: list[str] = ()) -> PeerProcess:
        args = ["--stage", "auto" if stage is None else str(stage), "--listen-host", "127.0.0.1", *extra_args]
        proc = self._spawn(name, "hivetrain.swarm.server", args)
        self.servers.append(proc)
        return proc

    def add_trainer(self, index: int, steps: int, extra_args: list[str] = ()) -> PeerProcess:
        name = f"trainer{index}"
        args = ["--steps", str(steps), "--index", str(index), "--metrics-file", str(self.out_dir / f"{name}.jsonl")]
        proc = self._spawn(name, "hivetrain.swarm.trainer", [*args, *extra_args])
        self.trainers.append(proc)
        return proc

    def wait_for_servers(self, count: int, timeout_s: float) -> None:
        """Block until ``count`` servers announce themselves. Raises RuntimeError (with a log tail) otherwise."""
        deadline = time.monotonic() + timeout_s
        while len(fetch_stage_records(self.boot.dht, self.run.run_id)) < count:
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
        """SIGTERM every process group still running, SIGKILL what is left after ``grace_s``; stop the bootstrap."""
        stop_groups([*self.trainers, *self.servers], grace_s)
        if self.boot is not None:
            self.boot.shutdown()


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
    stages: int,
    servers_per_stage: int,
    trainers: int,
    model: str,
    steps: int,
    seed: int,
    *,
    run: RunConfig | None = None,
    swarm: SwarmConfig | None = None,
    threads_per_process: int = 1,
    timeout_s: float = 1800.0,
) -> dict:
    """Train ``model`` cut into ``stages`` stages, each served by ``servers_per_stage`` processes, with ``trainers``
    trainer processes running ``steps`` steps each; write ``out_dir/summary.json`` and return it.

    Args:
        run: the run config (default ``default_run(model, seed)``; its model and seed are replaced by the arguments).
        swarm: pipeline settings (default ``SwarmConfig()``; its ``num_stages`` is replaced by ``stages``).
        threads_per_process: torch threads of each process.
        timeout_s: stop everything after this many seconds (summary["timed_out"] = True).

    Raises:
        ValueError: counts below 1, or a config that does not fit (e.g. batch size not a multiple of the microbatch).
        RuntimeError: the stage servers did not come up (the message shows the failing server's log).
    """
    if min(stages, servers_per_stage, trainers, steps) < 1:
        raise ValueError("stages, servers_per_stage, trainers and steps must all be >= 1")
    run = dataclasses.replace(run or default_run(model, seed), model=model, seed=seed)
    swarm = dataclasses.replace(swarm or SwarmConfig(), num_stages=stages)
    swarm.num_microbatches(run.data.batch_size)
    out = Path(out_dir)
    pipeline = LocalPipeline(out, run, swarm, threads_per_process)
    started = time.time()
    finished = False
    try:
        pipeline.start_bootstrap()
        for stage in range(stages):
            for k in range(servers_per_stage):
                pipeline.add_server(stage, f"server{stage}_{k}")
        for index in range(trainers):  # trainers wait until every stage is served
            pipeline.add_trainer(index, steps)
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
    for s in servers:
        hashes.setdefault(str(s["stage"]), {})[s["peer_id"]] = f"epoch {s['epoch']}: {s.get('state_hash', '')[:16]}"
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
