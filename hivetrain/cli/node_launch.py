"""Starting the processes of a multi-rank node (``torchrun --nproc-per-node N -m hivetrain.cli.join_swarm``).

``join_swarm.main`` calls ``run_node`` when ``launched_by_torchrun()``. It reads torchrun's environment, joins the
process groups (``init_node``) and runs rank 0 as the swarm peer (``join_swarm.main(argv, node_ranks=ranks)``: the
builder makes its trainer train for the node) or a follower rank (``run_follower``). The protocol between
them, and what happens when a rank dies, is ``node_ranks``'s docstring.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hivetrain.diloco.node_ranks import (
    CMD_HELLO,
    CMD_STOP,
    DEFAULT_TIMEOUT_S,
    NodeRanks,
    NodeRanksFailed,
    follow,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeEnv:
    """The torchrun environment of this process: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> NodeEnv | None:
        """None unless ``WORLD_SIZE`` > 1. Raises ValueError if the variables are not integers in range."""
        env = os.environ if environ is None else environ
        try:
            world_size = int(env.get("WORLD_SIZE", "1"))
            if world_size <= 1:
                return None
            rank, local_rank = int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"]))
        except (KeyError, ValueError) as exc:
            raise ValueError(
                f"torch.distributed environment: bad or missing WORLD_SIZE/RANK/LOCAL_RANK ({exc}); start with torchrun"
            ) from None
        if not 0 <= rank < world_size:
            raise ValueError(f"RANK={rank} is outside 0..WORLD_SIZE-1={world_size - 1}")
        return cls(rank, world_size, local_rank)


def launched_by_torchrun(environ: dict[str, str] | None = None) -> bool:
    """Whether this process is a rank of a multi-rank node (``WORLD_SIZE`` set and not 0 or 1; a ``WORLD_SIZE`` that
    is not an integer counts too: ``run_node`` then exits saying what is wrong with it)."""
    env = os.environ if environ is None else environ
    return env.get("WORLD_SIZE", "").strip() not in ("", "0", "1")


def timeout_s_from_env() -> float:
    """``HIVETRAIN_NODE_TIMEOUT_S`` (seconds, > 0), default 1800. Raises ValueError if it is not a positive number."""
    raw = os.environ.get("HIVETRAIN_NODE_TIMEOUT_S", "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"HIVETRAIN_NODE_TIMEOUT_S={raw!r}: give a positive number of seconds")
    return value


def init_node(env: NodeEnv, use_cuda: bool, timeout_s: float) -> NodeRanks:
    """Join the node's process groups (torchrun's ``MASTER_ADDR``/``MASTER_PORT``): NCCL on ``cuda:LOCAL_RANK`` when
    ``use_cuda``, else gloo; control messages on a gloo group. Every collective times out after ``timeout_s``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if use_cuda:
        torch.cuda.set_device(env.local_rank)
        device = torch.device("cuda", env.local_rank)
    else:
        device = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    return NodeRanks(env.rank, env.world_size, control, device)


def close_node(ranks: NodeRanks | None) -> None:
    """Tear down the process groups (a no-op if none)."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def run_node(argv: list[str] | None = None) -> int:
    """``join-swarm`` under torchrun with WORLD_SIZE > 1: rank 0 runs ``join_swarm.main`` for the node, the other
    ranks ``run_follower``. Returns the process's exit code (2 for a bad environment or flags)."""
    from hivetrain.cli import join_swarm
    from hivetrain.cli.common import EXIT_BAD_INPUT, EXIT_FAILED, fail, setup_logging

    args = join_swarm.build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        env = NodeEnv.from_environ()
        assert env is not None, "main() runs only under torchrun with WORLD_SIZE > 1"
        timeout_s = timeout_s_from_env()
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available (use --device cpu or auto)")
        use_cuda = args.device != "cpu" and torch.cuda.is_available()
        if use_cuda and env.local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={env.local_rank} but only {torch.cuda.device_count()} CUDA device(s): "
                "use --nproc-per-node at most the number of GPUs"
            )
    except ValueError as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    ranks = init_node(env, use_cuda, timeout_s)
    logger.info("node rank %d of %d on %s", env.rank, env.world_size, ranks.device)
    try:
        if env.rank == 0:
            ranks.start_keepalive()
            try:
                ranks.sharding = args.node_sharding  # as asked; the builder settles "auto"
                return join_swarm.main(argv, node_ranks=ranks)
            finally:
                ranks.stop_keepalive()
                ranks.stop()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the node leaves
        try:
            return run_follower(args, ranks)
        except Exception as exc:  # noqa: BLE001 - any failure ends this rank, saying why
            logger.exception("node rank %d failed", env.rank)
            return fail(f"node rank {env.rank}: {type(exc).__name__}: {exc}", EXIT_FAILED)
    finally:
        close_node(ranks)


def run_follower(args: argparse.Namespace, ranks: NodeRanks) -> int:
    """A follower rank: wait for rank 0's HELLO, build the corpus and the model, then ``follow`` until STOP.

    Returns 0 when rank 0 says STOP (also before HELLO: rank 0 failed to start). Raises on a failed collective.
    """
    from hivetrain.config import RunConfig
    from hivetrain.data import load_corpus, stream_seed
    from hivetrain.diloco.builder import data_cursor_path
    from hivetrain.model import build_run_model, set_activation_checkpointing

    code, _, _ = ranks.recv_command()
    if code == CMD_STOP:
        return 0
    if code != CMD_HELLO:
        raise NodeRanksFailed(f"expected HELLO from rank 0, got command {code}")
    hello = ranks.recv_hello()
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        config = RunConfig.from_dict(hello["config"])
        cursor = data_cursor_path(args.identity_path, config.run_id)  # rank 0's; ours is beside it
        corpus = load_corpus(config.data, cursor_path=cursor.with_suffix(f".rank{ranks.rank}.json") if cursor else None)
        sharded = hello.get("sharding") == "fsdp"  # FSDP: only shapes here; rank 0 scatters θ at each phase start
        _, model, fingerprint = build_run_model(config, corpus.vocab_size, model_path=args.model_path, meta=sharded)
        if fingerprint != hello["fingerprint"]:
            raise ValueError(
                f"this rank's model fingerprint {fingerprint[:12]} differs from rank 0's {hello['fingerprint'][:12]}"
            )
        set_activation_checkpointing(model, bool(hello.get("activation_checkpointing", False)))  # as rank 0 chose
        if not sharded:
            model.to(ranks.device)
        ok = True
    except Exception:  # noqa: BLE001 - reported to rank 0 through the ready flags, and logged here
        logger.exception("node rank %d could not build the run's model", ranks.rank)
        ok, sharded = False, False
    if ranks.gather_ready(ok):
        return 1 if not ok else 0  # rank 0 gives up on the node
    if sharded:
        ranks.sharding = "fsdp"
        model = ranks.shard(model, None, config.diloco)
        inner = ranks.inner_optimizer(model, config.diloco)
    else:
        inner = ranks.inner_optimizer(ranks.wrap(model), config.diloco)
    batches = corpus.train_batches(
        config.data.seq_len, config.data.batch_size, stream_seed(config.seed, ranks.stream_name(hello["peer_id"]))
    )
    stats = follow(ranks, inner, batches, model)
    logger.info(
        "node rank %d: %d phases, %d inner steps, %d aborted, %d diverged, %d evaluations (%s)",
        ranks.rank,
        len(stats.phases),
        sum(s for _, s in stats.phases),
        stats.aborted,
        stats.diverged,
        stats.evaluations,
        ranks.sharding,
    )
    return 0
