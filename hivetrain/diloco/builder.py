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
) -> tuple[torch.nn.Module, str]:
    """(model on ``device``, fingerprint) of the run's θ₀, after the memory preflight (``hivetrain.preflight``:
    the model described on the meta device first, so a model too big for this machine is refused before any memory
    is taken).

    Raises:
        ValueError / FileNotFoundError: a model source that cannot be read, a vocab the model cannot hold, or a
            model too big for this device's memory (the preflight's message names the fix).
    """
    from hivetrain.model import build_run_model, describe_run_model, set_activation_checkpointing
    from hivetrain.preflight import run_preflight

    model_config, num_parameters = describe_run_model(config, vocab_size, model_path)  # meta: no memory
    checkpointed = config.diloco.activation_checkpointing == "on"
    if check_memory:
        decision = run_preflight(config, model_config, num_parameters, device)
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
    return model.to(device), fingerprint


def build_phases(
    config: RunConfig,
    model: torch.nn.Module,
    corpus: Corpus,
    peer_id: str,
    duty: DutyCycle,
    options: TrainerOptions,
    node_ranks: NodeRanks | None = None,
    fingerprint: str = "",
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
        inner_steps=diloco.inner_steps,
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
        node_ranks.hello({**hello, "activation_checkpointing": checkpointed})
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
    model, fingerprint = build_model(
        config, corpus.vocab_size, device, model_path=model_path, check_memory=check_memory
    )
    refuse_other_models(node.dht, config.run_id, node.peer_id, fingerprint, config.model)
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
        phases = build_phases(config, model, corpus, node.peer_id, duty, options, node_ranks, fingerprint)
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
        )
    except BaseException:
        averager.shutdown(timeout_s=3.0)
        loop.stop(timeout_s=2.0)
        raise
    return DilocoPeer(trainer, averager, loop, model, corpus, fingerprint)
