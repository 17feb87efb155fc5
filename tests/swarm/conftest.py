"""In-process pipelines on 127.0.0.1: a bootstrap DHT node, stage servers (each with its own DHT node and p2pd) and
a pipeline trainer. ``crash`` kills a server's DHT process and p2pd with SIGKILL, which is what the network sees
when a volunteer's machine dies."""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Iterator

import psutil
import pytest
import torch

from hivetrain.config import RunConfig
from hivetrain.data.config import DataConfig
from hivetrain.diloco.config import DilocoConfig
from hivetrain.faults import FaultInjector
from hivetrain.model import build_model, lm_loss
from hivetrain.peers.node import NodeConfig, PeerNode, start_node
from hivetrain.swarm.config import SwarmConfig
from hivetrain.swarm.process import describe_model
from hivetrain.swarm.routing import choose_server
from hivetrain.swarm.server import StageServer
from hivetrain.swarm.trainer import PipelineTrainer

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)

TEST_SWARM = SwarmConfig(
    num_stages=3,
    microbatch_size=1,
    compression="none",
    microbatches_per_inner_step=0,  # gradients only accumulate: tests read them
    average_stage=False,
    rebalance_interval_s=0,
    request_timeout_s=5.0,
    step_timeout_s=40.0,
    announce_interval_s=0.5,
    record_ttl_s=2.0,
    ban_base_s=1.0,
)
TEST_RUN = RunConfig(model="tiny", data=DataConfig(seq_len=16, batch_size=4), diloco=DilocoConfig(inner_steps=1))


class Pipeline:
    """Owns every node, server and trainer it starts; ``close`` shuts them all down."""

    def __init__(self, swarm: SwarmConfig = TEST_SWARM, run: RunConfig = TEST_RUN):
        self.swarm, self.run = swarm, run
        self.model_config, self.fingerprint = describe_model(run)
        self.nodes: list[PeerNode] = []
        self.servers: list[StageServer] = []
        self.trainers: list[PipelineTrainer] = []
        self.boot = self._node(initial_peers=())
        self.initial_peers = tuple(self.boot.visible_maddrs())

    def _node(self, initial_peers=None) -> PeerNode:
        peers = self.initial_peers if initial_peers is None else initial_peers
        node = start_node(NodeConfig(initial_peers=peers, host_maddrs=LOOPBACK, use_relay=False, startup_timeout_s=20))
        self.nodes.append(node)
        return node

    def add_server(self, stage: int | None, faults: FaultInjector | None = None, **swarm_overrides) -> StageServer:
        swarm = dataclasses.replace(self.swarm, **swarm_overrides) if swarm_overrides else self.swarm
        server = StageServer(
            self._node(), self.run, swarm, self.model_config, self.fingerprint, stage, faults or FaultInjector()
        )
        self.servers.append(server)
        server.start(timeout_s=30)
        return server

    def add_trainer(self, router=choose_server, seed: int = 0) -> PipelineTrainer:
        trainer = PipelineTrainer(
            self._node(), self.run.run_id, self.swarm, self.model_config, self.fingerprint, seed=seed, router=router
        )
        self.trainers.append(trainer)
        trainer.start()
        trainer.wait_for_stages(timeout_s=20)
        return trainer

    def close(self) -> None:
        for trainer in self.trainers:
            trainer.shutdown()
        for server in self.servers:
            server.shutdown(timeout_s=5)
        for node in self.nodes:
            node.shutdown()


@pytest.fixture
def make_pipeline() -> Iterator:
    pipelines: list[Pipeline] = []

    def make(**kwargs) -> Pipeline:
        pipelines.append(Pipeline(**kwargs))
        return pipelines[-1]

    try:
        yield make
    finally:
        for pipeline in pipelines:
            pipeline.close()


def crash(server: StageServer) -> None:
    """SIGKILL the server's DHT process and its p2pd (started by this test session), and stop its announcements."""
    server._stop.set()
    root = psutil.Process(server.node.dht.pid)
    for proc in [*root.children(recursive=True), root]:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def prefer(*peer_ids: str):
    """A router that sends every microbatch to one of ``peer_ids`` while it is usable, else routes normally."""

    def route(records, stage, now, bans, rng, inflight=None, exclude=()):
        preferred = [r for r in records if r.stage == stage and r.peer_id in peer_ids]
        chosen, reason = choose_server(preferred, stage, now, bans, rng, inflight, exclude)
        if chosen is not None:
            return chosen, "preferred by the test"
        return choose_server(records, stage, now, bans, rng, inflight, exclude)

    return route


def reference_gradients(pipeline: Pipeline, batch_BT1: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean microbatch loss and the sum over microbatches of each parameter's gradient, on the uncut model."""
    model = build_model(pipeline.model_config, pipeline.run.seed)
    losses = [lm_loss(model, chunk) for chunk in batch_BT1.split(pipeline.swarm.microbatch_size)]
    torch.stack(losses).sum().backward()
    return torch.stack(losses).mean().item(), {n: p.grad for n, p in model.named_parameters()}


def stage_gradients(servers: list[StageServer]) -> tuple[dict[str, torch.Tensor], dict[int, int]]:
    """Parameter gradients summed over ``servers`` (name -> tensor) and microbatches accumulated per stage."""
    total: dict[str, torch.Tensor] = {}
    counts: dict[int, int] = {}
    for server in servers:
        grads, count = server.runtime.accumulated_gradients()
        counts[server.stage] = counts.get(server.stage, 0) + count
        for name, grad in grads.items():
            total[name] = total[name] + grad if name in total else grad
    return total, counts


def tiny_pipeline_run(trainer_steps: int) -> RunConfig:
    """A 3-stage pipelined run of ``tiny`` for local-pipeline e2e tests: phases of 1 inner step x 2 microbatches, so
    each lone stage server commits outer steps through GroupAverager; trainers stop after ``trainer_steps``."""
    from hivetrain.swarm.local import default_run

    run = default_run("tiny", seed=0)
    return dataclasses.replace(
        run,
        data=DataConfig(seq_len=64, batch_size=4, max_corpus_bytes=2**20, num_eval_windows=4),
        diloco=dataclasses.replace(run.diloco, inner_steps=1),
        swarm=SwarmConfig(
            num_stages=3,
            microbatch_size=2,
            microbatches_per_inner_step=2,
            announce_interval_s=0.5,
            record_ttl_s=3.0,
            trainer_steps=trainer_steps,
        ),
    )
