"""Assembling a DiLoCo peer: the one place a trainer is built (``join-swarm``, a node's rank 0, benches, tests).

``build_peer`` turns a run config and a started DHT node into a ``DilocoPeer``: the corpus, the model θ₀ on its
device (after the memory preflight and the check that the swarm trains the same model), the inner phase runner (a
multi-rank node's DDP wrapper when ``node_ranks`` is given), the group averager and the ``DilocoTrainer`` wired to
them. It starts nothing it does not also stop: ``DilocoPeer.close`` (or the ``with`` block) shuts the averager and
the event loop down; the DHT node belongs to the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hivetrain.config import RunConfig
from hivetrain.data import Corpus, load_corpus, stream_seed
from hivetrain.diloco.duty import DutyCycle
from hivetrain.diloco.inner import InnerOptimizer
from hivetrain.diloco.node_ranks import NodeInner, NodeRanks
from hivetrain.diloco.node_shard import SHARDINGS, gathered_parameters, param_dtype, shard_units
from hivetrain.diloco.options import TrainerOptions
from hivetrain.diloco.phase import PhaseRunner
from hivetrain.diloco.schedule import PhasePlan
from hivetrain.faults import NO_FAULTS, FaultInjector
from hivetrain.peers.membership import MemberRoster
from hivetrain.peers.node import PeerNode
from hivetrain.peers.records import refuse_other_models

if TYPE_CHECKING:
    from hivetrain.averaging import GroupAverager
    from hivetrain.diloco.trainer import DilocoTrainer
    from hivetrain.peers.loop import LoopThread

logger = logging.getLogger(__name__)

AVERAGER_READY_TIMEOUT_S = 30.0
EVAL_BATCH = 16  # windows per forward pass of an evaluation (``hivetrain.model.evaluate``'s default)


def data_cursor_path(identity_path: str | None, run_id: str) -> Path | None:
    """Where our training stream keeps its position across restarts: next to our identity key (a peer without a
    persistent identity has a new peer ID, so a new stream, on every start: no cursor)."""
    if not identity_path:
        return None
    key = Path(identity_path).expanduser()
    return key.with_name(f"{key.name}.{run_id}.data-cursor.json")


@dataclass
class DilocoPeer:
    """A built DiLoCo peer. ``run()`` trains until the run's outer steps or ``trainer.stop()``; ``close()`` stops the
    averager and the loop (idempotent; the DHT node stays the caller's).

    Attributes:
        trainer: the ``DilocoTrainer`` (its ``state``, ``stats``, ``stop()``, ``announce_leaving()``).
        averager: the started ``GroupAverager`` (its data plane listens from ``build_peer`` on).
        loop: the asyncio loop thread every P2P call of this peer runs on.
        model: θ on its device (fp32 parameters; the trainer's ``state`` is its CPU copy).
        corpus: the run's corpus as this peer reads it.
        fingerprint: sha256 hex of θ₀'s tensors (every peer of the run has the same).
    """

    trainer: DilocoTrainer
    averager: GroupAverager
    loop: LoopThread
    model: torch.nn.Module
    corpus: Corpus
    fingerprint: str
    _closed: bool = field(default=False, repr=False)

    def run(self) -> None:
        """Train. Raises what ``DilocoTrainer.run`` raises (``DhtLost``, ``Interrupted``, a failure of training)."""
        self.trainer.run()

    def close(self, averager_timeout_s: float = 3.0, loop_timeout_s: float = 2.0) -> None:
        """Stop the averager (its data plane and matchmaking) and the loop, each bounded in seconds."""
        if self._closed:
            return
        self._closed = True
        self.averager.shutdown(timeout_s=averager_timeout_s)
        self.loop.stop(timeout_s=loop_timeout_s)

    def __enter__(self) -> DilocoPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_model(
    config: RunConfig,
    vocab_size: int,
    device: torch.device,
    *,
    model_path: str | None = None,
    check_memory: bool = True,
    node_ranks: NodeRanks | None = None,
) -> tuple[torch.nn.Module, str]:
    """(model on ``device``, fingerprint) of the run's θ₀, after the memory preflight (``hivetrain.preflight``:
    the model described on the meta device first, so a model too big for this machine is refused before any memory
    is taken).

    A multi-rank node's rank 0 (``node_ranks``) also settles how the node trains (``node_ranks.sharding``, set here):
    "ddp" as asked, "fsdp" as asked, or for "auto" FSDP only on CUDA when the model does not fit one GPU whole
    (``_node_sharding``). Under FSDP the model returned stays on the CPU: it is the trainer's host copy, and the
    ranks train a sharded one (``NodeRanks.shard``).

    Raises:
        ValueError / FileNotFoundError: a model source that cannot be read, a vocab the model cannot hold, a model
            too big for this device's memory (the preflight's message names the fix), or FSDP with fp16.
    """
    from hivetrain.model import build_run_model, describe_run_model, set_activation_checkpointing
    from hivetrain.preflight import run_preflight

    model_config, num_parameters = describe_run_model(config, vocab_size, model_path)  # meta: no memory
    checkpointed = config.diloco.activation_checkpointing == "on"
    sharding, gathered = "ddp", 0
    if node_ranks is not None:
        meta = build_run_model(config, vocab_size, model_path=model_path, meta=True).model  # shapes only
        sharding = _node_sharding(config, model_config, meta, device, node_ranks, check_memory)
        node_ranks.sharding = sharding
        logger.info(
            "node of %d ranks: %s", node_ranks.world_size, "FSDP (sharded model)" if sharding == "fsdp" else "DDP"
        )
        gathered = gathered_parameters(meta) if sharding == "fsdp" else 0
    if check_memory:
        shards = node_ranks.world_size if sharding == "fsdp" else 1
        decision = run_preflight(
            config, model_config, num_parameters, device, shards=shards, gathered_parameters=gathered
        )
        logger.info("%s", decision.reason)
        checkpointed = decision.activation_checkpointing
    else:
        logger.info("memory preflight skipped")
    _, model, fingerprint = build_run_model(config, vocab_size, model_path=model_path)
    set_activation_checkpointing(model, checkpointed)
    if checkpointed:
        logger.info(
            "activation checkpointing on (diloco.activation_checkpointing = %r)", config.diloco.activation_checkpointing
        )
    return (model if sharding == "fsdp" else model.to(device)), fingerprint


def eval_in_background(
    config: RunConfig,
    vocab_size: int,
    device: torch.device,
    model_path: str | None,
    check_memory: bool,
    node_ranks: NodeRanks | None,
    free: tuple[int, int] | None = None,
) -> bool:
    """Whether this peer evaluates off the critical path (``eval_worker``): ``diloco.eval_overlap`` as resolved for
    the device (not in an FSDP node), and for "auto" on CUDA only if the preflight, with one more fp32 copy of the
    parameters on the device (the replica) and what an evaluation holds at once beside training (16 windows' logits
    in fp32, twice: the model's output and the loss's copy; one layer's activations), still finds the run fits as it
    would without it (the same activation checkpointing choice), with ``free`` = (device, host) bytes free before
    the model took any (default: read now). A node's rank 0 calls it after the builder settled the node's sharding.
    Logs its choice."""
    from hivetrain.diloco.eval_worker import resolve_eval_overlap

    requested = config.diloco.eval_overlap
    sharded = node_ranks is not None and node_ranks.sharding == "fsdp"
    if not resolve_eval_overlap(requested, device.type, sharded):
        return False
    if requested == "auto" and device.type == "cuda":
        if not check_memory:
            logger.info("evaluations run between phases (no memory preflight to size a background replica)")
            return False
        from hivetrain.model import describe_run_model
        from hivetrain.preflight import DEFAULT_MARGIN, InsufficientMemory, free_memory, run_preflight

        model_config, n = describe_run_model(config, vocab_size, model_path)
        free_device, free_host = free if free is not None else free_memory(device)
        tokens = EVAL_BATCH * config.data.seq_len
        hidden = int(getattr(model_config, "hidden_size", 0) or 0)
        mlp = int(getattr(model_config, "intermediate_size", 0) or 4 * hidden)
        evaluation = tokens * (8 * int(model_config.vocab_size) + 4 * (4 * hidden + 3 * mlp))
        replica = int((4 * n + evaluation) * DEFAULT_MARGIN)
        try:
            alone = run_preflight(config, model_config, n, device, free=(free_device, free_host))
            with_replica = run_preflight(config, model_config, n, device, free=(free_device - replica, free_host))
        except InsufficientMemory:
            logger.info("evaluations run between phases (no room on the device for a background replica)")
            return False
        if with_replica.activation_checkpointing != alone.activation_checkpointing:
            logger.info("evaluations run between phases (a background replica would force activation checkpointing)")
            return False
    logger.info("evaluations run in the background, on a replica of the model (diloco.eval_overlap = %r)", requested)
    return True


def _node_sharding(
    config: RunConfig, model_config, meta: torch.nn.Module, device: torch.device, ranks: NodeRanks, check_memory: bool
) -> str:
    """How a node trains: ``ranks.sharding`` as asked ("ddp", "fsdp"), or for "auto" "fsdp" on CUDA when the
    preflight finds the model does not fit one GPU whole without activation checkpointing (FSDP's intra-node
    gathers cost less than recomputing every layer), else "ddp" (CPU nodes: always, unless asked).

    Raises:
        ValueError: an unknown setting, or "fsdp" with fp16 (``node_shard.param_dtype``).
    """
    from hivetrain.diloco.inner import cuda_native_bf16, resolve_precision
    from hivetrain.model import count_parameters
    from hivetrain.preflight import InsufficientMemory, run_preflight

    requested = ranks.sharding
    if requested not in SHARDINGS:
        raise ValueError(f"--node-sharding {requested!r}: choose one of {', '.join(SHARDINGS)}")
    sharding = requested
    if requested == "auto":
        sharding = "ddp"
        if device.type == "cuda" and ranks.world_size > 1 and check_memory:
            mode = "on" if config.diloco.activation_checkpointing == "on" else "off"
            try:
                run_preflight(config, model_config, count_parameters(meta), device, activation_checkpointing=mode)
            except InsufficientMemory as exc:
                logger.info("the model does not fit one GPU whole (%s): sharding it over the node", str(exc)[:300])
                sharding = "fsdp"
    if sharding == "fsdp":
        precision = resolve_precision(config.diloco.precision, device.type, cuda_native_bf16(device))
        param_dtype(precision.autocast_dtype)  # fp16 refused before any rank starts sharding
        shard_units(meta)  # a model without repeated layers is refused here too
    return sharding


def build_phases(
    config: RunConfig,
    model: torch.nn.Module,
    corpus: Corpus,
    peer_id: str,
    duty: DutyCycle,
    options: TrainerOptions,
    node_ranks: NodeRanks | None = None,
    fingerprint: str = "",
    model_path: str | None = None,
) -> PhaseRunner:
    """The inner phase runner: AdamW inner steps on this peer's data stream, ended by the run's schedule.

    A multi-rank node (``node_ranks``, torchrun; ``diloco/node_ranks.py``): we are its rank 0 and train for all of
    its ranks. The other ranks are sent the run (HELLO) and the model is wrapped in DDP here. To the swarm's schedule
    the node is one peer N times as fast (the epoch target counts the run's batch per peer, the same on every peer);
    with fixed H ("steps") it runs H inner steps of N batches.

    A single-process peer compiles its inner step here when ``diloco.compile`` asks for it
    (``InnerOptimizer.warm_up``: seconds to minutes, before the swarm counts us as training); a node's ranks compile
    at their first inner step, together.

    Raises:
        ValueError: a fixed-H node whose phase would exceed ``averaging.max_samples_per_round``, or
            ``diloco.compile = "on"`` on a machine where torch.compile fails (the message names the cause).
        NodeRanksFailed: a rank could not build the run's model.
    """
    diloco = config.diloco
    per_peer = diloco.samples_per_inner_step(config.data.batch_size)
    per_step = per_peer * (node_ranks.world_size if node_ranks is not None else 1)
    plan = PhasePlan(
        schedule=diloco.schedule,
        inner_steps=diloco.phase_steps,  # H, or H / F with fragments: an epoch is one fragment's outer step
        batch_size=per_peer if diloco.schedule == "swarm" else per_step,
        target_samples_per_epoch=diloco.target_samples_per_epoch,
        max_samples_per_peer=config.averaging.max_samples_per_round,
        stale_after_s=options.record_ttl_s,
        max_extrapolation_s=3 * options.record_interval_s,
    )
    stream = peer_id if node_ranks is None else node_ranks.stream_name(peer_id)
    batches = corpus.train_batches(config.data.seq_len, config.data.batch_size, stream_seed(config.seed, stream))
    if node_ranks is None:
        inner = InnerOptimizer(model, diloco)
        inner.warm_up(config.data.batch_size, config.data.seq_len)  # compiles now (if compiled), not in phase 1
    else:
        if diloco.fragments > 1:
            raise ValueError(
                f"diloco.fragments = {diloco.fragments} on a {node_ranks.world_size}-rank node: a fragment's outer "
                "step updates part of rank 0's parameters, which the node's ranks do not take yet; run one process per "
                "peer (no torchrun) or diloco.fragments = 1"
            )
        bound = config.averaging.max_samples_per_round
        if diloco.schedule == "steps" and diloco.inner_steps * per_step > bound:
            raise ValueError(
                f"a {node_ranks.world_size}-rank node runs {diloco.inner_steps} inner steps of {per_step} samples, "
                f"more than averaging.max_samples_per_round ({bound}) allows one peer: use fewer ranks, or a run with "
                'diloco.schedule = "swarm" or a larger bound'
            )
        from hivetrain.model import is_activation_checkpointing

        checkpointed = is_activation_checkpointing(model)  # rank 0's preflight chose for every rank
        hello = {"config": config.to_dict(), "peer_id": peer_id, "fingerprint": fingerprint}
        node_ranks.hello({**hello, "activation_checkpointing": checkpointed, "sharding": node_ranks.sharding})
        if node_ranks.sharding == "fsdp":
            from hivetrain.model import build_run_model, set_activation_checkpointing

            meta = build_run_model(config, corpus.vocab_size, model_path=model_path, meta=True).model
            set_activation_checkpointing(meta, checkpointed)
            sharded = node_ranks.shard(meta, model, diloco)
            inner = NodeInner(node_ranks.inner_optimizer(sharded, diloco), node_ranks, model, sharded)
        else:
            inner = NodeInner(node_ranks.inner_optimizer(node_ranks.wrap(model), diloco), node_ranks, model)
    return PhaseRunner(inner, batches, plan, duty, peer_id, samples_per_step=per_step)


def build_peer(
    config: RunConfig,
    node: PeerNode,
    *,
    device: torch.device | str = "cpu",
    options: TrainerOptions = TrainerOptions(),
    corpus: Corpus | None = None,
    cursor_path: Path | None = None,
    model_path: str | None = None,
    check_memory: bool = True,
    faults: FaultInjector = NO_FAULTS,
    on_event: Callable[[dict], None] | None = None,
    duty: DutyCycle | None = None,
    membership: MemberRoster | None = None,
    node_ranks: NodeRanks | None = None,
    listen_host: str = "0.0.0.0",
    announce_host: str | None = None,
) -> DilocoPeer:
    """Build a DiLoCo peer of ``config``'s run on ``node`` (a started DHT node whose record guard is set up).

    Args:
        config: the run config (every peer of the run has the same).
        node: our DHT node; it is not stopped by ``DilocoPeer.close``.
        device: where θ and the inner steps live ("cpu", "cuda", ``torch.device``).
        options: per-peer settings (``TrainerOptions``: record timing, public name, the run's coordinator...).
        corpus: the corpus, if already loaded (default: ``load_corpus(config.data, cursor_path=cursor_path)``).
        cursor_path: where our data stream keeps its position across restarts (``data_cursor_path``).
        model_path: this machine's copy of the run's model files when they are not at ``config.model``.
        check_memory: run the memory preflight before building the model.
        faults: the fault injector (the chaos harness's; ``NO_FAULTS`` otherwise).
        on_event: called with every metrics event (dicts; ``cli.progress``).
        duty: the duty cycle the peer pauses by (a SIGUSR1 handler may toggle it); default from ``options``.
        membership: an invite-only run's roster (None: an open run).
        node_ranks: we are rank 0 of a multi-rank node (``diloco/node_ranks.py``): train for all of its ranks.
        listen_host, announce_host: the averaging data plane's listen address and the one announced to peers.

    Raises:
        FileNotFoundError / ValueError: the corpus or the model cannot be built (the message names the cause), or
            the model is too big for this device (preflight).
        IncompatibleRun: the swarm trains another model (``refuse_other_models``).
        NodeRanksFailed: a rank of the node could not build the model.
        TimeoutError: the averager's data plane did not start within 30 s.
        Nothing is left running when it raises.
    """
    from hivetrain.averaging import GroupAverager
    from hivetrain.diloco.trainer import DilocoTrainer
    from hivetrain.peers.loop import LoopThread

    device = torch.device(device)
    corpus = corpus if corpus is not None else load_corpus(config.data, cursor_path=cursor_path)
    from hivetrain.preflight import free_memory

    free_before = free_memory(device) if device.type == "cuda" else None  # before the model takes any of it
    model, fingerprint = build_model(
        config, corpus.vocab_size, device, model_path=model_path, check_memory=check_memory, node_ranks=node_ranks
    )
    refuse_other_models(node.dht, config.run_id, node.peer_id, fingerprint, config.model)
    background_eval = eval_in_background(
        config, corpus.vocab_size, device, model_path, check_memory, node_ranks, free=free_before
    )
    logger.info(
        "peer %s joined run %r (model %s, %s) at %s",
        node.peer_id,
        config.run_id,
        config.model,
        fingerprint[:12],
        ", ".join(node.visible_maddrs()[:2]),
    )
    duty = duty if duty is not None else DutyCycle(options.duty_cycle, pause_file=options.pause_file)
    loop = LoopThread()
    averager = GroupAverager(
        node,
        prefix=f"{config.run_id}.{fingerprint[:8]}.avg",
        config=config.averaging,
        faults=faults,
        listen_host=listen_host,
        announce_host=announce_host,
        admits=membership.admits if membership is not None else None,
    )
    try:
        averager.start()
        averager.wait_ready(timeout_s=AVERAGER_READY_TIMEOUT_S)
        phases = build_phases(config, model, corpus, node.peer_id, duty, options, node_ranks, fingerprint, model_path)
        node_inner = getattr(phases, "inner", None)
        node_inner = node_inner if isinstance(node_inner, NodeInner) else None
        trainer = DilocoTrainer(
            node,
            loop,
            config,
            model,
            corpus,
            averager,
            fingerprint,
            phases,
            options,
            faults=faults,
            on_event=on_event,
            duty=duty,
            membership=membership,
            evaluate_model=node_inner.evaluate_model if node_inner is not None else None,
            eval_in_background=background_eval,
        )
    except BaseException:
        averager.shutdown(timeout_s=3.0)
        loop.stop(timeout_s=2.0)
        raise
    return DilocoPeer(trainer, averager, loop, model, corpus, fingerprint)
