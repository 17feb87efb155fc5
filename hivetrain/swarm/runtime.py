"""A stage server's compute loop: one worker thread runs forward/backward tasks and the stage's DiLoCo inner steps.

Tasks wait in a priority queue (control > urgent > replay > backward > forward, FIFO within a class, like hivemind's
TaskPool priorities): finishing backward passes first frees trainers' kept activations and keeps the pipeline moving;
what a server's death left behind goes first of all, so that it costs one reroute and the replay work, not a wait in
the survivor's queue (``scripts/bench/swarm_throughput.py``'s ``recovery_s``): the calls of microbatches rerouted
around the failure ("urgent": a trainer is waiting on each), then replays (gradients a dead or reset server lost,
recomputed here).

Gradient accounting (what trainers rely on for "no microbatch lost, none applied twice"):

* A backward call recomputes the stage from the input the trainer kept and backpropagates the trainer's output
  gradient; parameter gradients are summed into the server's accumulator only if the call is still within its deadline
  (minus ``deadline_margin_s``) and this microbatch was not accumulated before by this server (retries are idempotent).
* Every ``microbatches_per_inner_step`` accumulated microbatches the server takes one inner AdamW step on their mean
  gradient (DiLoCo's inner optimizer, with its warmup/cosine schedule); every ``diloco.inner_steps`` inner steps the
  *phase* ends and the server runs the stage's outer step (``on_phase_end``). Contributions of a phase become durable
  when that outer step commits. An outer step whose averaging round failed all-or-nothing (``RoundFailed``: nothing
  was applied anywhere) *keeps* the phase: its inner steps go on and the next outer step's pseudo-gradient covers the
  longer phase, as the data-parallel trainer carries a failed round (``StagePhase.kept``); trainers replay nothing.
  A phase that diverged, or that the server gives up (it moves stage, adopts a state its peers committed without it,
  or was stalled long enough for trainers to presume it dead), is *abandoned*: θ goes back to the stage's last
  committed state and trainers replay the phase's microbatches on other servers. A restarted or reset server has a
  new ``incarnation``; trainers replay everything they had sent to the old one.

Shape legend: B = windows per microbatch, T = tokens per window, D = hidden size, V = vocabulary size.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import queue
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from hivetrain.averaging.base import RoundFailed
from hivetrain.diloco.config import DilocoConfig
from hivetrain.diloco.inner import lr_multiplier
from hivetrain.diloco.state import TrainingState
from hivetrain.faults import NO_FAULTS, FaultInjector
from hivetrain.swarm.config import SwarmConfig
from hivetrain.swarm.phase import StagePhase
from hivetrain.swarm.stages import PipelineStage

logger = logging.getLogger(__name__)

_PRIORITY_CONTROL, _PRIORITY_URGENT, _PRIORITY_REPLAY, _PRIORITY_BACKWARD, _PRIORITY_FORWARD = 0, 1, 2, 3, 4
_EMA = 0.2
_MAX_REMEMBERED_IDS = 65536


class TaskExpired(RuntimeError):
    """The task's deadline passed before it finished; nothing was accumulated."""


class ServerBusy(RuntimeError):
    """The server is syncing or moving; the caller should use another server of the stage."""


@dataclass(frozen=True)
class BackwardResult:
    """What a backward task produced.

    Attributes:
        grad_input: (B, T, D) float32 CPU gradient w.r.t. the stage input; None on the first stage and for replays.
        window: the phase the parameter gradients went into (-1 = not accumulated).
    """

    grad_input: torch.Tensor | None
    window: int


@dataclass(order=True)
class _Task:
    priority: int
    order: int
    fn: Callable[[], Any] = field(compare=False)
    future: Future = field(compare=False)
    deadline: float = field(compare=False, default=math.inf)


class StageRuntime:
    """Owns a stage module, its gradient accumulator, inner optimizer and committed state; thread-safe entry points.

    Args:
        module: the stage (moved to ``device``).
        state: the stage's committed state (θ at ``state.epoch``, outer momentum); the module starts from it.
        swarm: pipeline settings (inner-step cadence, deadlines).
        diloco: inner/outer hyper-parameters (inner_lr, warmup, grad_clip, inner_steps = H, ...).
        on_phase_end: called on the worker thread when a phase ends, with (runtime, pseudo_gradient list);
            returns the next committed TrainingState, raises ``RoundFailed`` to keep the phase open (retried after a
            backoff, or after H more inner steps without ``external_phase_end``) or anything else to abandon it.
            None = commit locally.
        deadline_margin_s: a backward finishing later than ``deadline - deadline_margin_s`` is not accumulated.
        external_phase_end: phases end only when ``request_phase_end`` is called (the server does when the stage's
            servers together reached their target, so they all enter the outer step together); False = after
            ``diloco.inner_steps`` local inner steps.
    """

    def __init__(
        self,
        module: PipelineStage,
        state: TrainingState,
        swarm: SwarmConfig,
        diloco: DilocoConfig,
        device: torch.device,
        faults: FaultInjector = NO_FAULTS,
        on_phase_end: Callable[[StageRuntime, list[torch.Tensor]], TrainingState] | None = None,
        deadline_margin_s: float = 0.5,
        label: str = "",
        external_phase_end: bool = False,
    ):
        self.swarm, self.diloco, self.device, self.faults = swarm, diloco, device, faults
        self.on_phase_end = on_phase_end
        self.external_phase_end = external_phase_end
        self._phase_end_pending = False
        self.deadline_margin_s = deadline_margin_s
        self.label = label
        self._queue: queue.PriorityQueue[_Task] = queue.PriorityQueue()
        self._order = itertools.count()
        self._stopping = threading.Event()
        self.accepting = True
        self.in_progress = 0
        self.fwd_s_ema: float | None = None
        self.bwd_s_ema: float | None = None
        self.busy_s = 0.0
        self.num_forward = self.num_backward = self.num_expired = 0
        self._install(module, state)
        self._thread = threading.Thread(target=self._main, name=f"swarm-runtime-{label}", daemon=True)
        self._thread.start()

    # ---- state ---------------------------------------------------------------------------------------------------

    def _install(self, module: PipelineStage, state: TrainingState) -> None:
        self.module = module.to(self.device)
        self.spec = module.spec
        self.state = state
        self._load_theta()
        self.optimizer = torch.optim.AdamW(
            self.module.parameters(), lr=self.diloco.inner_lr, weight_decay=self.diloco.weight_decay, betas=(0.9, 0.95)
        )
        self.params = dict(self.module.named_parameters())
        self.grad_acc = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.num_accumulated = 0
        self.incarnation = secrets.token_hex(8)
        self._set_phase(StagePhase.first(state.epoch, self.diloco.inner_steps))
        self.abandoned: collections.deque[int] = collections.deque(maxlen=64)
        self._accumulated_ids: collections.OrderedDict[str, int] = collections.OrderedDict()

    def _set_phase(self, phase: StagePhase) -> None:
        """The one place the open phase changes (worker thread, or before the worker starts)."""
        self.phase_record = phase

    @property
    def phase(self) -> int:
        """Index of the open phase (the window trainers' ledgers key on)."""
        return self.phase_record.window

    @property
    def phase_microbatches(self) -> int:
        return self.phase_record.num_microbatches

    @property
    def phase_inner_steps(self) -> int:
        return self.phase_record.num_inner_steps

    @property
    def inner_step(self) -> int:
        return self.phase_record.inner_step

    def _load_theta(self) -> None:
        with torch.no_grad():
            for name, param in self.module.named_parameters():
                param.copy_(self.state.params[name])

    def _zero_accumulator(self) -> None:
        for acc in self.grad_acc.values():
            acc.zero_()
        self.num_accumulated = 0

    def _abandon_phase(self, reason: str) -> None:
        logger.info("%s: abandoning phase %d of stage %d (%s)", self.label, self.phase, self.spec.index, reason)
        self._zero_accumulator()
        self._load_theta()
        self.abandoned.append(self.phase)
        self._set_phase(self.phase_record.next(self.state.epoch, self.diloco.inner_steps))

    def _keep_phase(self, reason: str) -> None:
        """The phase's outer step failed all-or-nothing: keep its inner steps, microbatches and θ_local; trainers'
        ledger entries for this window stay pending until an outer step of it commits (or it is abandoned)."""
        self._set_phase(self.phase_record.kept(time.monotonic()))
        logger.info(
            "%s: keeping phase %d of stage %d open after %d failed outer step(s) (%s)",
            self.label,
            self.phase,
            self.spec.index,
            self.phase_record.num_failed_outer_steps,
            reason,
        )

    def _commit(self, new_state: TrainingState) -> None:
        self.state = new_state
        self._load_theta()
        self._set_phase(self.phase_record.next(new_state.epoch, self.diloco.inner_steps))

    # ---- entry points (any thread) -------------------------------------------------------------------------------

    def queue_len(self) -> int:
        return self._queue.qsize() + self.in_progress

    def throughput(self) -> float:
        """Estimated capacity in microbatches/s (one forward + one backward each); 0 before any measurement."""
        if self.fwd_s_ema is None or self.bwd_s_ema is None:
            return 0.0
        return 1.0 / max(self.fwd_s_ema + self.bwd_s_ema, 1e-6)

    def _submit(self, priority: int, fn: Callable[[], Any], deadline: float = math.inf) -> Future:
        future: Future = Future()
        if self._stopping.is_set():
            future.set_exception(ServerBusy("runtime is shut down"))
            return future
        self._queue.put(_Task(priority, next(self._order), fn, future, deadline))
        return future

    def submit_forward(self, x: torch.Tensor, microbatch_id: str, deadline: float, urgent: bool = False) -> Future:
        """Queue a forward pass; the future yields the (B, T, D) or (B, T, V) float32 CPU output. ``urgent`` (a
        microbatch rerouted around a failure) runs before every other forward, backward and replay."""
        priority = _PRIORITY_URGENT if urgent else _PRIORITY_FORWARD
        return self._submit(priority, lambda: self._forward(x, microbatch_id), deadline)

    def submit_backward(
        self,
        x: torch.Tensor,
        grad_output: torch.Tensor,
        microbatch_id: str,
        deadline: float,
        accumulate: bool,
        replay: bool,
        urgent: bool = False,
    ) -> Future:
        """Queue a backward pass (recomputing the forward from ``x``); the future yields a BackwardResult. Urgent calls
        run first, then replays, then other backward passes, then forward passes."""
        return self._submit(
            _PRIORITY_URGENT if urgent else _PRIORITY_REPLAY if replay else _PRIORITY_BACKWARD,
            lambda: self._backward(x, grad_output, microbatch_id, deadline, accumulate, replay),
            deadline,
        )

    def submit_control(self, fn: Callable[[], Any]) -> Future:
        """Queue ``fn`` to run on the worker thread before any queued forward/backward; does not wait."""
        return self._submit(_PRIORITY_CONTROL, fn)

    def call(self, fn: Callable[[], Any], timeout_s: float) -> Any:
        """Run ``fn`` on the worker thread between tasks (state swaps, reads) and return its result.

        Raises:
            TimeoutError: it did not run within ``timeout_s`` seconds.
        """
        return self._submit(_PRIORITY_CONTROL, fn).result(timeout=timeout_s)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the worker; queued tasks fail with ServerBusy. Idempotent."""
        self._stopping.set()
        self._queue.put(_Task(-1, -1, lambda: None, Future()))
        self._thread.join(timeout_s)
        self._fail_queued(ServerBusy("server is shutting down"))

    def _fail_queued(self, exc: Exception) -> None:
        while True:
            try:
                task = self._queue.get_nowait()
            except queue.Empty:
                return
            if not task.future.done():
                task.future.set_exception(exc)

    def reject_queued(self, reason: str) -> None:
        """Answer every queued forward/backward with ServerBusy (before a long sync or a move)."""
        keep = []
        while True:
            try:
                task = self._queue.get_nowait()
            except queue.Empty:
                break
            if task.priority == _PRIORITY_CONTROL:
                keep.append(task)
            elif not task.future.done():
                task.future.set_exception(ServerBusy(reason))
        for task in keep:
            self._queue.put(task)

    # ---- worker thread -------------------------------------------------------------------------------------------

    def _main(self) -> None:
        if self.swarm.num_threads:
            torch.set_num_threads(self.swarm.num_threads)
        while not self._stopping.is_set():
            task = self._queue.get()
            if self._stopping.is_set():
                task.future.set_exception(ServerBusy("server is shutting down"))
                break
            if task.future.done():
                continue
            if time.time() > task.deadline - self.deadline_margin_s:
                self.num_expired += 1
                task.future.set_exception(TaskExpired("deadline passed while queued"))
                continue
            self.in_progress = 1
            started = time.perf_counter()
            try:
                task.future.set_result(task.fn())
            except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
                task.future.set_exception(exc)
            finally:
                self.busy_s += time.perf_counter() - started
                self.in_progress = 0

    @staticmethod
    def _ema(old: float | None, value: float) -> float:
        return value if old is None else (1 - _EMA) * old + _EMA * value

    def _forward(self, x: torch.Tensor, microbatch_id: str, hooks: bool = True) -> torch.Tensor:
        started = time.perf_counter()
        with torch.no_grad():
            out = self.module(x.to(self.device)).float().cpu()  # (B, T, D) or (B, T, V)
        self.fwd_s_ema = self._ema(self.fwd_s_ema, time.perf_counter() - started)
        self.num_forward += 1
        if hooks:
            self.faults.check(
                "swarm.server.mid_forward",
                stage=self.spec.index,
                microbatch_id=microbatch_id,
                peer=self.label,
                output=out,
            )
        return out

    def _backward(
        self,
        x: torch.Tensor,
        grad_output: torch.Tensor,
        microbatch_id: str,
        deadline: float,
        accumulate: bool,
        replay: bool,
        hooks: bool = True,
    ) -> BackwardResult:
        started = time.perf_counter()
        x = x.to(self.device)
        wants_input_grad = not self.spec.is_first and not replay
        if wants_input_grad:
            x.requires_grad_(True)
        names = list(self.params)
        with torch.enable_grad():
            out = self.module(x)  # recomputed forward: (B, T, D) or (B, T, V)
            inputs = ([x] if wants_input_grad else []) + [self.params[n] for n in names]
            grads = torch.autograd.grad(out, inputs, grad_output.to(self.device, out.dtype), allow_unused=True)
        grad_input = grads[0].float().cpu() if wants_input_grad else None
        param_grads = grads[1:] if wants_input_grad else grads
        self.bwd_s_ema = self._ema(self.bwd_s_ema, time.perf_counter() - started)
        self.num_backward += 1
        if hooks:
            self.faults.check(
                "swarm.server.mid_backward", stage=self.spec.index, microbatch_id=microbatch_id, peer=self.label
            )
        if not accumulate:
            return BackwardResult(grad_input, -1)
        if microbatch_id in self._accumulated_ids:  # a retry of a call we already counted
            return BackwardResult(grad_input, self._accumulated_ids[microbatch_id])
        if time.time() > deadline - self.deadline_margin_s:
            self.num_expired += 1
            raise TaskExpired("finished after the deadline; gradients dropped")
        for name, grad in zip(names, param_grads, strict=False):
            if grad is not None:
                self.grad_acc[name].add_(grad)
        window = self.phase
        self._accumulated_ids[microbatch_id] = window
        while len(self._accumulated_ids) > _MAX_REMEMBERED_IDS:
            self._accumulated_ids.popitem(last=False)
        self.num_accumulated += 1
        self._set_phase(self.phase_record.with_microbatch())
        if self.swarm.microbatches_per_inner_step and self.num_accumulated >= self.swarm.microbatches_per_inner_step:
            self._inner_step()
            if not self.external_phase_end and self.phase_inner_steps >= self.diloco.inner_steps * (
                1 + self.phase_record.num_failed_outer_steps
            ):
                self._end_phase()
        return BackwardResult(grad_input, window)

    def _inner_step(self) -> None:
        """One AdamW step on the mean accumulated gradient (the caller decides whether the phase ends)."""
        scale = 1.0 / self.num_accumulated
        for name, param in self.params.items():
            param.grad = self.grad_acc[name] * scale
        if self.diloco.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.diloco.grad_clip)
        lr = self.diloco.inner_lr * lr_multiplier(self.inner_step, self.diloco)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._zero_accumulator()
        self._set_phase(self.phase_record.with_inner_step())

    def request_phase_end(self) -> bool:
        """Queue the end of the open phase (the outer step) on the worker thread without waiting for it.
        Returns False if one is already queued or the phase holds no microbatch."""
        if self._phase_end_pending or self.phase_microbatches == 0:
            return False
        self._phase_end_pending = True

        def end() -> None:
            try:
                if self.phase_microbatches:
                    if self.num_accumulated:
                        self._inner_step()
                    self._end_phase()
            finally:
                self._phase_end_pending = False

        self._submit(_PRIORITY_CONTROL, end)
        return True

    def _end_phase(self) -> None:
        # a copy: for CPU fp32 parameters .to() returns the live tensor, which the optimizer would change under the
        # committed state (its hash and the chunks served to downloaders would then disagree)
        local = {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in self.params.items()}
        deltas = [self.state.params[n] - local[n] for n in self.state.params]
        if not all(torch.isfinite(d).all() for d in deltas):
            self._abandon_phase("the inner phase diverged (non-finite pseudo-gradient)")
            return
        if self.on_phase_end is None:
            self._commit(TrainingState(self.state.epoch + 1, local, dict(self.state.momentum)))
            return
        try:
            new_state = self.on_phase_end(self, deltas)
        except RoundFailed as exc:  # all-or-nothing: applied nowhere, so the phase goes on (never applied alone)
            self._keep_phase(f"outer step failed: {exc}")
            return
        except Exception as exc:  # noqa: BLE001 - a refused outer step (moving), anything unexpected: discarded
            self._abandon_phase(f"outer step failed: {exc}")
            return
        self._commit(new_state)

    # ---- control operations (run them through ``call``) -------------------------------------------------------------

    def replace(self, module: PipelineStage, state: TrainingState) -> None:
        """Serve another stage (or a downloaded state): drops the open phase and starts a new incarnation."""
        self._install(module, state)

    def adopt_state(self, state: TrainingState) -> None:
        """Load a downloaded committed state of the same stage. An open phase that took inner steps is abandoned
        (they were taken from the old θ); gradients only accumulated so far are kept for the next inner step."""
        if self.phase_inner_steps:
            self._abandon_phase(f"adopting downloaded state of epoch {state.epoch}")
        self.state = state
        self._load_theta()
        self._set_phase(self.phase_record.rebased(state.epoch, self.diloco.inner_steps))

    def reincarnate(self, reason: str) -> None:
        """Forget every uncommitted contribution (trainers presumed us dead and replayed them)."""
        logger.warning("%s: new incarnation of stage %d server (%s)", self.label, self.spec.index, reason)
        self._zero_accumulator()
        self._load_theta()
        self.incarnation = secrets.token_hex(8)
        self._set_phase(StagePhase.first(self.state.epoch, self.diloco.inner_steps))
        self.abandoned.clear()
        self._accumulated_ids.clear()

    def accumulated_gradients(self) -> tuple[dict[str, torch.Tensor], int]:
        """(name -> summed parameter gradient (CPU fp32 copy), number of microbatches) of the open inner step."""
        return {n: g.detach().cpu().clone() for n, g in self.grad_acc.items()}, self.num_accumulated

    def benchmark(self, batch_shape: tuple[int, int], repeats: int = 3) -> float:
        """Measure forward+backward time on random input of (B, T) windows (after one warm-up pass, which is not
        counted); returns microbatches/s. Run it on the worker thread (``call``)."""
        num_windows, num_tokens = batch_shape
        for i in range(repeats + 1):
            if self.spec.is_first:
                x = torch.randint(0, self.module.config.vocab_size, (num_windows, num_tokens))
            else:
                x = torch.randn(num_windows, num_tokens, self.module.config.hidden_size)
            out = self._forward(x, "benchmark", hooks=False)
            self._backward(x, torch.randn_like(out), "benchmark", math.inf, accumulate=False, replay=False, hooks=False)
            if i == 0:
                self.fwd_s_ema = self.bwd_s_ema = None
        self.num_forward = self.num_backward = 0
        return self.throughput()
