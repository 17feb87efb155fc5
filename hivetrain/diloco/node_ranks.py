"""A multi-GPU (or multi-process) node as ONE DiLoCo peer: ``torchrun --nproc-per-node N -m hivetrain.cli.join_swarm``.

The N local ranks train data-parallel with PyTorch's own ``DistributedDataParallel`` (its gradient all-reduce is the
only collective on the gradients: after every inner step all ranks hold the same parameters and AdamW state), or, for
a model that does not fit one GPU, with FSDP2 (``--node-sharding``; ``node_shard``: each rank holds 1/N of the
parameters, gradients and AdamW state, rank 0 a full host copy for the outer step). Rank 0
alone is the swarm peer: it runs the whole ``DilocoTrainer`` (DHT node, records, state downloads, averaging rounds,
evaluation) and claims the node's sample count, N times its own (every rank trains on as many windows per inner step).
The other ranks ("followers", ``follow``) only run inner steps; each reads its own data stream
(``stream_seed(run_seed, f"{peer_id}/rank{r}")``, rank 0 included).

Protocol (rank 0 sends, followers obey; control messages travel on a gloo group ``control``, so they are CPU int64
tensors whatever the backend of the default group, which carries the model: gloo on CPU, NCCL with CUDA):

1. ``HELLO``: rank 0 broadcasts the run config, the peer id and the model fingerprint as JSON (bytes; nothing is
   unpickled). Each follower builds the corpus and the model (from the run's seed or this machine's model files) and
   every rank reports whether it is ready (``all_gather`` of one int); rank 0 raises ``NodeRanksFailed`` naming the
   ranks that are not (their own log says why: a missing file, another fingerprint). All ranks then wrap the model in
   DDP (which broadcasts rank 0's parameters and buffers), or, when HELLO says ``"sharding": "fsdp"``, shard the
   model built on the meta device (``NodeRanks.shard``: FSDP2, rank 0's buffers broadcast).
2. ``PHASE(first_step, max_steps)``: rank 0 broadcasts the phase's start point θ (every parameter, from rank 0's model:
   after an outer step or a state download this is how the new θ reaches the ranks), then all ranks run
   ``InnerOptimizer.run``. After every inner step rank 0 broadcasts its decision (``CONTINUE``, ``END`` or ``ABORT``):
   the swarm's schedule ends a phase dynamically (``PhaseRunner.should_end``), so only rank 0 can decide, and the
   followers run exactly as many inner steps. A non-finite loss on any rank is agreed on before the backward pass
   (``all_finite``: one all-reduce per microbatch), so all ranks raise ``FloatingPointError`` together and rank 0's
   trainer discards the phase as a single-process peer does; the AdamW state stays finite on every rank.
   Under FSDP (``--node-sharding fsdp``, ``node_shard``) θ is scattered from rank 0's host model into every rank's
   shards instead, and a phase that ends (``END``, or out of steps) ends with every rank gathering the parameters
   so rank 0's host model holds θ_local; an aborted or diverged phase gathers nothing.
3. ``EVAL`` (FSDP only): rank 0 broadcasts its held-out windows and the θ to evaluate; every rank evaluates a share
   on its shards and the loss sums are all-reduced (with DDP rank 0 evaluates alone, and sends nothing).
4. ``STOP``: rank 0 leaves (finished, interrupted, failed between phases): followers return 0.
5. ``KEEPALIVE`` / ``STEP_WAIT``: while the followers wait for a command (rank 0 averaging, downloading state,
   evaluating) or a decision (rank 0 paused by its duty cycle, ``--pause-file`` or SIGUSR1), a thread of rank 0 sends
   one every ``KEEPALIVE_INTERVAL_S`` (10 s), so a wait of any length is not a timeout.

What happens if a rank dies or hangs:
- Rank 0 stops mid-phase (Ctrl+C, SIGTERM, a lost DHT, the trainer stopping): it broadcasts ``ABORT`` at the end of
  the inner step (the phase is discarded), later ``STOP``. SIGINT and SIGTERM are held back during an inner phase and
  take effect at the next step boundary (``HeldSignals``), so an interrupted rank 0 never leaves a collective half
  done.
- Rank 0 fails inside an inner step (an exception between two collectives, e.g. out of memory): the followers are
  blocked in a collective that will never complete, so rank 0 marks the node broken, sends nothing more and tears
  down its process groups; the followers fail with gloo's "connection closed" at once (NCCL: after the timeout) and
  exit non-zero.
- A follower dies: rank 0's next collective fails (gloo at once, NCCL after the timeout), the exception ends rank 0's
  training ("training failed", summary written, last record published) and torchrun stops the node.
- Every collective is bounded by ``HIVETRAIN_NODE_TIMEOUT_S`` (default 1800 s): a rank 0 that hangs without dying
  (its keepalive thread stopped too) ends the followers after that long; an inner step must take less.

Followers ignore SIGINT (Ctrl+C reaches every process of the terminal: rank 0 leaves the swarm and sends ``STOP``);
SIGTERM ends them (torchrun's way of stopping a node).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from hivetrain.diloco.held_signals import HeldSignals
from hivetrain.diloco.inner import InnerOptimizer, InnerPhaseResult

logger = logging.getLogger(__name__)

CMD_HELLO, CMD_PHASE, CMD_STOP, CMD_KEEPALIVE, CMD_EVAL = 1, 2, 3, 4, 5  # commands (rank 0 -> followers)
STEP_CONTINUE, STEP_END, STEP_ABORT, STEP_WAIT = 0, 1, 2, 3  # decisions (rank 0 -> followers, after every inner step)
DEFAULT_TIMEOUT_S = 1800.0
KEEPALIVE_INTERVAL_S = 10.0


class NodeRanksFailed(RuntimeError):
    """The node's ranks cannot train together (a rank could not build the model, or a collective failed)."""


class PhaseAborted(Exception):
    """Follower side: rank 0 abandoned the phase (its steps are discarded)."""


@dataclass
class NodeRanks:
    """One rank's end of the node protocol (module docstring). Call it from the training thread; rank 0's keepalive
    thread (``start_keepalive``) is the only other sender, serialized with it by a lock.

    Args:
        rank, world_size: this process's rank and the number of ranks (``cli.node_launch.NodeEnv``).
        control: the gloo process group the control messages travel on (``dist.new_group(backend="gloo")``).
        device: where this rank's model lives (``cuda:LOCAL_RANK`` or cpu).
        sharding: "ddp" (every rank holds the whole model) or "fsdp" (``node_shard``: each rank a 1/N shard); rank
            0 decides (``builder.build_model``) and sends it in HELLO.
    """

    rank: int
    world_size: int
    control: object
    device: torch.device
    sharding: str = "ddp"
    broken: bool = False  # rank 0: a collective is left half done; send nothing more
    # rank 0: what the followers block on now ("command", "decision"; "" = a collective with us): the keepalive
    # thread fills that wait with CMD_KEEPALIVE / STEP_WAIT; every control message is sent under the lock
    _followers_wait: str = field(default="command", repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _keepalive: tuple[threading.Thread, threading.Event] | None = field(default=None, repr=False)
    _gathered: int = field(default=0, repr=False)  # FSDP: parameters gathered at once (``node_shard``)

    # ---- messages ---------------------------------------------------------------------------------------------
    def _bcast(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(t, 0, group=self.control)
        return t.tolist()

    def send_command(self, code: int, a: int = 0, b: int = 0) -> None:
        assert self.rank == 0
        self._bcast([code, a, b])

    def recv_command(self) -> tuple[int, int, int]:
        """Follower: block until rank 0's next command (code, a, b), skipping keepalives. Raises RuntimeError if
        nothing came for the process-group timeout (rank 0 hung) or rank 0's connection closed (it died)."""
        while True:
            code, a, b = self._bcast([0, 0, 0])
            if code != CMD_KEEPALIVE:
                return code, a, b

    @contextlib.contextmanager
    def _sending(self, then: str) -> Iterator[None]:
        """Rank 0: a sequence of control messages, under the lock; afterwards the followers wait for ``then``
        ("command", "decision" or "": nothing the keepalive may send; also after an exception)."""
        with self._lock:
            self._followers_wait = ""
            yield
            self._followers_wait = then

    def followers_wait_for(self, what: str) -> None:
        """Rank 0: the followers now block on ``what`` ("command" or "decision"): keepalives may fill the wait."""
        with self._lock:
            self._followers_wait = what

    def start_keepalive(self, interval_s: float = KEEPALIVE_INTERVAL_S) -> None:
        """Rank 0: every ``interval_s`` seconds, while the followers wait for a command or a decision (rank 0
        averaging, downloading state, paused), send them a keepalive, so that only a hung or dead rank 0 runs into
        their process-group timeout. Stops at the first failed send (a follower is gone)."""
        assert self.rank == 0 and self._keepalive is None
        done = threading.Event()

        def beat() -> None:
            while not done.wait(interval_s):
                with self._lock:
                    wait = "" if self.broken else self._followers_wait
                    try:
                        if wait == "command":
                            self._bcast([CMD_KEEPALIVE, 0, 0])
                        elif wait == "decision":
                            self._bcast([STEP_WAIT])
                    except Exception as exc:  # noqa: BLE001 - the main thread meets the same failure and reports it
                        logger.warning("node keepalive failed, no more keepalives: %s", exc)
                        return

        thread = threading.Thread(target=beat, name="node-keepalive", daemon=True)
        thread.start()
        self._keepalive = (thread, done)

    def stop_keepalive(self, timeout_s: float = 5.0) -> None:
        if self._keepalive is not None:
            thread, done = self._keepalive
            done.set()
            thread.join(timeout_s)
            self._keepalive = None

    def _bcast_bytes(self, data: bytes) -> bytes:
        (size,) = self._bcast([len(data)])
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        else:
            buf = torch.empty(size, dtype=torch.uint8)
        if size:
            dist.broadcast(buf, 0, group=self.control)
        return bytes(buf.numpy().tobytes())

    def hello(self, payload: dict) -> None:
        """Rank 0: send the run to the followers and wait until every rank built its model.

        Raises:
            NodeRanksFailed: a follower could not (the ranks are named; their logs say why).
        """
        with self._sending("command"):
            self.send_command(CMD_HELLO)
            self._bcast_bytes(json.dumps(payload).encode())
            not_ready = self.gather_ready(True)
        if not_ready:
            self.broken = True  # the followers have returned: nothing more to send them
            raise NodeRanksFailed(f"node rank(s) {not_ready} could not build the run's model (see their log)")

    def recv_hello(self) -> dict:
        """Follower, after ``recv_command`` returned ``CMD_HELLO``: the payload rank 0 sent."""
        return json.loads(self._bcast_bytes(b"").decode())

    def gather_ready(self, ready: bool) -> list[int]:
        """Every rank says whether it is ready; returns the ranks that are not (the same list on every rank)."""
        flags = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(flags, torch.tensor([int(ready)], dtype=torch.int64), group=self.control)
        return [r for r, f in enumerate(flags) if not int(f.item())]

    def broadcast_params(self, model: torch.nn.Module) -> None:
        """Rank 0's parameters (the phase's start point θ) into every rank's model, in place (default group)."""
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p.data, 0)

    def phase_start(self, model: torch.nn.Module, sharded: torch.nn.Module | None) -> None:
        """θ from rank 0 into every rank's training model: DDP, ``broadcast_params(model)``; FSDP, rank 0's
        ``model`` (the host model; followers pass their sharded model, ignored) scattered into ``sharded``."""
        if sharded is None:
            self.broadcast_params(model)
        else:
            from hivetrain.diloco.node_shard import scatter_params

            scatter_params(sharded, model if self.rank == 0 else None)

    def phase_end(self, model: torch.nn.Module, sharded: torch.nn.Module | None) -> None:
        """FSDP: every rank's shards gathered into rank 0's host ``model`` (θ_local), a collective; DDP: nothing
        (rank 0's model already holds θ_local)."""
        if sharded is not None:
            from hivetrain.diloco.node_shard import gather_params

            gather_params(sharded, model if self.rank == 0 else None)

    def evaluate(self, sharded: torch.nn.Module, windows_NT: torch.Tensor | None, model: torch.nn.Module | None):
        """FSDP: the eval loss of rank 0's host ``model`` θ on rank 0's (N, T+1) int64 ``windows_NT``, every rank
        evaluating a share (``node_shard.evaluate_sharded``). Rank 0 sends ``CMD_EVAL`` first; followers call it
        with None, None after receiving it (``follow``). Returns the loss (nats per token) on every rank."""
        from hivetrain.diloco.node_shard import evaluate_sharded, scatter_params

        if self.rank == 0:
            assert windows_NT is not None
            shape = torch.tensor(windows_NT.shape, dtype=torch.int64)
            windows = windows_NT.to(torch.int64).contiguous()
        else:
            shape = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(shape, 0, group=self.control)
        if self.rank != 0:
            windows = torch.empty(tuple(shape.tolist()), dtype=torch.int64)
        if windows.numel():  # a run without eval windows evaluates nothing (loss 0.0, as ``evaluate``)
            dist.broadcast(windows, 0, group=self.control)
        scatter_params(sharded, model if self.rank == 0 else None)
        return evaluate_sharded(sharded, windows, self.control)

    def send_decision(self, code: int) -> None:
        assert self.rank == 0
        self._bcast([code])

    def recv_decision(self) -> int:
        """Follower: rank 0's decision after an inner step (``STEP_*``), skipping keepalives (rank 0 paused)."""
        while True:
            decision = self._bcast([STEP_CONTINUE])[0]
            if decision != STEP_WAIT:
                return decision

    def all_finite(self, finite: bool) -> bool:
        """Whether a microbatch's loss is finite on every rank (``InnerOptimizer.agree_finite``)."""
        t = torch.tensor([int(finite)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return bool(t.item())

    # ---- model --------------------------------------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel:
        """``model`` (already on ``self.device``) in DDP; a collective: every rank calls it once, after HELLO."""
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)

    def shard(self, meta_model: torch.nn.Module, host_model: torch.nn.Module | None, config) -> torch.nn.Module:
        """FSDP: ``meta_model`` (the run's model on the meta device) sharded over the node's ranks on
        ``self.device`` (``node_shard.shard_model``), its buffers rank 0's ``host_model``'s (followers: None). A
        collective: every rank calls it once, after HELLO. Its parameters receive θ at each phase start.

        Raises:
            ValueError: the run's precision is fp16 on this device (``node_shard.param_dtype``).
        """
        from hivetrain.diloco.inner import cuda_native_bf16, resolve_precision
        from hivetrain.diloco.node_shard import broadcast_buffers, gathered_parameters, param_dtype, shard_model

        precision = resolve_precision(config.precision, self.device.type, cuda_native_bf16(self.device))
        self._gathered = gathered_parameters(meta_model)  # for the memory check after the first phase
        sharded = shard_model(meta_model, self.device, param_dtype(precision.autocast_dtype))
        broadcast_buffers(sharded, host_model if self.rank == 0 else None)
        return sharded

    def inner_optimizer(self, model: torch.nn.Module, config) -> InnerOptimizer:
        """An ``InnerOptimizer`` over the DDP (or FSDP) model that agrees on non-finite losses with the other ranks.
        Under FSDP the model casts its own compute (``MixedPrecisionPolicy``: no autocast) and is not compiled (the
        compiled FSDP step is not measured yet; "on" is logged as overridden)."""
        if self.sharding == "fsdp":
            if config.compile == "on":
                logger.warning("diloco.compile = 'on' is ignored under --node-sharding fsdp: inner steps run eager")
            inner = InnerOptimizer(model, replace(config, compile="off"), autocast=False)
            inner.shards, inner.gathered_parameters = self.world_size, self._gathered
        else:
            inner = InnerOptimizer(model, config)
        inner.agree_finite = self.all_finite
        return inner

    def stream_name(self, peer_id: str) -> str:
        """The name this rank's training stream is seeded with (``hivetrain.data.stream_seed``)."""
        return f"{peer_id}/rank{self.rank}"

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Rank 0: tell the followers to exit (unless the node is broken); errors are logged, not raised."""
        if self.rank != 0 or self.broken:
            return
        try:
            with self._sending(""):
                self.send_command(CMD_STOP)
        except Exception as exc:  # noqa: BLE001 - a follower already gone: nothing left to tell
            logger.warning("could not tell the node's other ranks to stop: %s", exc)


class NodeInner:
    """Rank 0's inner optimizer for the whole node: ``PhaseRunner`` calls it like an ``InnerOptimizer``.

    ``run`` starts the followers' phase (``PHASE``, then θ), runs the inner steps through DDP, broadcasts the
    schedule's decision after every step (``should_end`` sees the node's samples: N times rank 0's) and returns the
    node's result (samples and tokens times N). Any other attribute is the wrapped optimizer's.

    Under FSDP (``sharded`` given) the phase starts by scattering θ from ``model`` (the host model) into the shards
    and ends by gathering θ_local back into it; ``evaluate_model`` evaluates on the shards with every rank.

    Args:
        inner: an ``InnerOptimizer`` over the DDP-wrapped (or sharded) model (``NodeRanks.inner_optimizer``).
        ranks: rank 0's end of the protocol.
        model: the unwrapped model the trainer loads θ into before each phase and reads θ_local from after it (FSDP:
            an unsharded host copy).
        sharded: FSDP: rank 0's sharded model (``NodeRanks.shard``); None with DDP.
    """

    def __init__(
        self, inner: InnerOptimizer, ranks: NodeRanks, model: torch.nn.Module, sharded: torch.nn.Module | None = None
    ):
        self.inner, self.ranks, self.model, self.sharded = inner, ranks, model, sharded

    def evaluate_model(self, model: torch.nn.Module, windows_NT: torch.Tensor) -> float:
        """``hivetrain.model.evaluate``'s loss of ``model`` (rank 0's host model, holding the θ to evaluate) on
        ``windows_NT``: with DDP on rank 0 alone; with FSDP on the shards, every rank taking part (``CMD_EVAL``).
        Raises ``NodeRanksFailed`` if the node is broken; a failure inside the collectives breaks it."""
        from hivetrain.model import evaluate

        if self.sharded is None:
            return evaluate(model, windows_NT)
        if self.ranks.broken:
            raise NodeRanksFailed("the node's ranks are out of step after a failed collective; restart the node")
        try:
            with self.ranks._sending("command"):
                self.ranks.send_command(CMD_EVAL)
                return self.ranks.evaluate(self.sharded, windows_NT, model)
        except BaseException:
            self.ranks.broken = True
            raise

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def run(
        self,
        batches: Iterator[torch.Tensor],
        first_step: int,
        num_steps: int,
        on_step: Callable[[int, float], None] | None = None,
        should_end: Callable[[int, int], bool] | None = None,
    ) -> InnerPhaseResult:
        """As ``InnerOptimizer.run``, for the node. Raises what it raises, and ``NodeRanksFailed`` if the node is
        broken (an earlier phase failed inside an inner step)."""
        if self.ranks.broken:
            raise NodeRanksFailed("the node's ranks are out of step after a failed inner step; restart the node")
        with HeldSignals() as held:  # Ctrl+C mid-step would leave the followers inside a collective
            return self._run(held, batches, first_step, num_steps, on_step, should_end)

    def _run(self, held: HeldSignals, batches, first_step, num_steps, on_step, should_end) -> InnerPhaseResult:
        ranks, n = self.ranks, self.ranks.world_size
        with ranks._sending(""):  # from here on the followers are in the phase's collectives with us
            ranks.send_command(CMD_PHASE, first_step, num_steps)
            ranks.phase_start(self.model, self.sharded)
        pending = False  # a step is done and the followers wait for its decision

        def step_done(i: int, loss: float) -> None:
            nonlocal pending
            pending = True
            ranks.followers_wait_for("decision")
            held.deliver()  # a SIGINT/SIGTERM that came during the step raises here (join-swarm: Interrupted)
            if on_step is not None:
                on_step(i, loss)

        def decide(num_steps_done: int, num_samples: int) -> bool:
            nonlocal pending
            end = should_end(num_steps_done, num_samples * n) if should_end is not None else False
            with ranks._sending("command" if end and self.sharded is None else ""):  # FSDP: the gathers come next
                ranks.send_decision(STEP_END if end else STEP_CONTINUE)
            pending = False
            return end

        def abort() -> None:
            with ranks._sending("command"):
                ranks.send_decision(STEP_ABORT)

        try:
            result = self.inner.run(batches, first_step, num_steps, step_done, decide)
        except FloatingPointError:
            if pending:
                abort()
            else:  # every rank raised it together (all_finite)
                ranks.followers_wait_for("command")
            raise
        except BaseException:
            if pending:
                abort()
            else:
                ranks.broken = True
            raise
        try:
            ranks.phase_end(self.model, self.sharded)  # FSDP: θ_local gathered from the shards
        except BaseException:
            ranks.broken = True
            raise
        ranks.followers_wait_for("command")  # the phase ended on every rank (END, or out of steps)
        return replace(result, num_samples=result.num_samples * n, num_tokens=result.num_tokens * n)


@dataclass
class FollowerStats:
    """What a follower did: (first_step, inner steps run) per phase, phases that were aborted or diverged, and (FSDP)
    evaluations it took part in."""

    phases: list[tuple[int, int]] = field(default_factory=list)
    aborted: int = 0
    diverged: int = 0
    evaluations: int = 0  # FSDP: evaluations rank 0 ran with us


def follow(
    ranks: NodeRanks,
    inner: InnerOptimizer,
    batches: Iterator[torch.Tensor],
    model: torch.nn.Module,
    on_phase: Callable[[torch.nn.Module], None] | None = None,
) -> FollowerStats:
    """Follower loop after the handshake: run each phase rank 0 starts until ``STOP``.

    Args:
        ranks: this follower's end of the protocol.
        inner: an ``InnerOptimizer`` over the DDP-wrapped model (``NodeRanks.inner_optimizer``).
        batches: this rank's (B, T+1) int64 windows.
        model: the unwrapped model (receives θ at each phase start); FSDP: the sharded model (``NodeRanks.shard``).
        on_phase: optional callback(model) right after θ arrived (tests).

    Raises:
        RuntimeError: a collective failed or timed out (rank 0 died or hung; the process should exit non-zero).
        NodeRanksFailed: an unknown command (ranks of different hivetrain versions).
    """
    stats = FollowerStats()
    sharded = model if ranks.sharding == "fsdp" else None
    while True:
        code, first_step, max_steps = ranks.recv_command()
        if code == CMD_STOP:
            return stats
        if code == CMD_EVAL and sharded is not None:
            ranks.evaluate(sharded, None, None)
            stats.evaluations += 1
            continue
        if code != CMD_PHASE:
            raise NodeRanksFailed(f"unexpected node command {code} (are all ranks the same hivetrain version?)")
        ranks.phase_start(model, sharded)
        if on_phase is not None:
            on_phase(model)

        def should_end(num_steps: int, num_samples: int) -> bool:
            decision = ranks.recv_decision()
            if decision == STEP_ABORT:
                raise PhaseAborted()
            return decision == STEP_END

        try:
            result = inner.run(batches, first_step, max_steps, None, should_end)
        except PhaseAborted:
            stats.aborted += 1
            continue
        except FloatingPointError as exc:
            logger.warning("inner phase diverged on the node (all ranks discard it): %s", exc)
            stats.diverged += 1
            continue
        ranks.phase_end(model, sharded)
        stats.phases.append((first_step, result.num_steps))
