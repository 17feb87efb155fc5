"""``join-swarm ADDRESS`` on a pipelined run: serve a stage or train through the pipeline.

``join-swarm`` reads the run config the coordinator publishes; when it has a ``[swarm]`` table (``RunConfig.pipelined``)
``join_swarm._train`` calls ``run_swarm_role`` instead of starting a DiLoCo trainer. The role comes from
``--role server|trainer|auto`` and the swarm's needs (``hivetrain.swarm.roles.decide_role``):

* server: a ``StageServer`` for ``--stage N`` or the bottleneck stage, until SIGINT/SIGTERM; its stage runs DiLoCo's
  outer step among the stage's servers (``swarm.average_stage``) and it moves to the bottleneck stage when that helps
  (``swarm.rebalance_interval_s``).
* trainer: a ``PipelineTrainer`` for ``swarm.trainer_steps`` steps (0 = until stopped) on the run's data, appending one
  JSON line per step to ``--metrics-file``.

Either writes its figures into ``--summary-file`` (``role``, ``exit_code``, ``exit_reason`` and ``server_stats`` or the
trainer's stats) on every exit.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
import zlib

import torch
from transformers import LlamaConfig

from hivetrain.cli.common import EXIT_FAILED, EXIT_OK
from hivetrain.config import RunConfig
from hivetrain.faults import FaultInjector
from hivetrain.peers.node import PeerNode
from hivetrain.swarm.announce import fetch_stage_records
from hivetrain.swarm.config import SwarmConfig
from hivetrain.swarm.roles import RoleDecision, decide_role

logger = logging.getLogger("hivetrain.join_swarm")

SERVER_POLL_INTERVAL_S = 1.0


def check_role_arguments(args: argparse.Namespace, config: RunConfig) -> None:
    """Refuse flags that do not apply: ``--role``/``--stage`` for a data-parallel run; for a pipelined run, the
    DiLoCo trainer's ``--model-path``, ``--duty-cycle`` and ``--pause-file``, which stage servers and pipeline
    trainers do not implement.

    Raises:
        ValueError: naming the flag and why.
    """
    if not config.pipelined and (args.role is not None or args.stage is not None):
        raise ValueError(
            f"--role/--stage are for pipelined runs; run {config.run_id!r} has no [swarm] table (data-parallel "
            "DiLoCo: every peer trains the whole model): drop them"
        )
    if not config.pipelined:
        return
    unsupported = [
        flag
        for flag, given in (
            ("--model-path", args.model_path is not None),
            ("--duty-cycle", args.duty_cycle != 1.0),
            ("--pause-file", bool(args.pause_file)),
        )
        if given
    ]
    if unsupported:
        raise ValueError(
            f"{', '.join(unsupported)}: not supported in a pipelined run ([swarm]) yet: stage servers and pipeline "
            "trainers build the model from the run's config and do not throttle; drop them"
        )


def local_swarm_config(config: RunConfig, device: str | None, threads: int) -> SwarmConfig:
    """The run's pipeline settings with this machine's choices: ``--device`` (None = the run's ``swarm.device``) and
    ``--threads`` (0 = the run's ``swarm.num_threads``). Neither changes what the pipeline computes."""
    swarm = config.swarm
    return dataclasses.replace(swarm, device=device or swarm.device, num_threads=threads or swarm.num_threads)


def has_training_data(config: RunConfig) -> bool:
    """Whether this machine can read the run's ``data.paths`` (empty = the Python stdlib: always)."""
    from hivetrain.data import resolve_files

    try:
        resolve_files(config.data.paths)
    except (ValueError, FileNotFoundError):
        return False
    return True


def choose_role(args: argparse.Namespace, node: PeerNode, config: RunConfig) -> RoleDecision:
    """Decide this peer's role from the stage records in the DHT. Raises ValueError for a role it cannot take."""
    records = fetch_stage_records(node.dht, config.run_id)
    decision = decide_role(
        args.role or "auto",
        records,
        config.swarm,
        time.time(),
        has_data=has_training_data(config),
        stage=args.stage,
    )
    logger.info("pipelined run %r: %s (%s)", config.run_id, decision.role, decision.reason)
    return decision


def run_swarm_role(
    args: argparse.Namespace,
    node: PeerNode,
    config: RunConfig,
    model_config: LlamaConfig,
    fingerprint: str,
    faults: FaultInjector,
    ending,
    data_hosts: tuple[str, str | None],
) -> int:
    """Take a role in the pipelined run ``config`` and run it; returns the exit code.

    Args:
        ending: join-swarm's ``_Ending``: its ``role_stats`` is set to what the summary file reports.
        data_hosts: (listen host, announce host or None) of a server's stage averager.

    Raises:
        Interrupted: SIGINT/SIGTERM (a server's only way to end); the summary is written by the caller.
        ValueError: a role this peer cannot take (e.g. ``--role trainer`` without the data).
    """
    swarm = local_swarm_config(config, args.device, args.threads)
    if swarm.num_threads:
        torch.set_num_threads(swarm.num_threads)
    decision = choose_role(args, node, config)
    if decision.role == "server":
        return _serve(node, config, swarm, model_config, fingerprint, decision.stage, faults, ending, data_hosts)
    return _train_pipeline(args, node, config, swarm, faults, ending)


def _serve(node, config, swarm, model_config, fingerprint, stage, faults, ending, data_hosts) -> int:
    from hivetrain.swarm.process import group_averager_factory, server_stats
    from hivetrain.swarm.server import StageServer

    listen_host, announce_host = data_hosts
    factory = (
        group_averager_factory(config, faults, listen_host, announce_host=announce_host)
        if swarm.average_stage
        else None
    )
    started = time.time()
    server = StageServer(node, config, swarm, model_config, fingerprint, stage, faults, factory)
    ending.role_stats = lambda: {"role": "server", **server_stats(server, started)}
    try:
        server.start()
        logger.info("serving stage %d of run %r", server.stage, config.run_id)
        while True:
            time.sleep(SERVER_POLL_INTERVAL_S)
    finally:
        server.shutdown()  # first: an outer step in progress gets to finish (bounded), and the stats count it


def _train_pipeline(args, node, config, swarm, faults, ending) -> int:
    from hivetrain.swarm.process import run_training

    stats: dict = {"role": "trainer"}
    ending.role_stats = lambda: stats
    index = zlib.crc32(node.peer_id.encode()) % 1000  # seeds routing; the data stream is seeded by the peer ID
    run_training(node, config, swarm, swarm.trainer_steps, index, args.metrics_file, faults=faults, stats=stats)
    return EXIT_OK if stats.get("completed") else EXIT_FAILED
