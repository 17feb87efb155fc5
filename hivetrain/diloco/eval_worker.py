"""Evaluation off the critical path (``diloco.eval_overlap``; issue 24 item 2).

After every outer step (every ``diloco.eval_every``) a peer measures the new θ's loss on its held-out windows. On
the trainer's thread that blocks the next inner phase: 64 windows of the ``base`` preset are ~1 s of a GPU per
outer step, 5-6 s in all with the rest of the outer step on the H100 run of 2026-11-28. ``BackgroundEval`` runs it
on a thread of its own with its own replica of the model (one more copy of the parameters on the device, fp32) and
its own CUDA stream, while the next phase trains; the trainer collects the results (``drain``) on its own thread
and reports each as an ``eval`` event for its epoch.

Its own schedule: one evaluation runs at a time, and one waits. A state submitted while another waits replaces it
(the older epoch is skipped, counted in ``skipped`` and logged): a slow evaluation never queues up behind training.
Evaluations see immutable states (each outer step builds new tensors; ``TrainingState``), so training never waits on
them and they never see a half-written θ.

What happens on failure: an exception in an evaluation (out of memory for the replica, a CUDA error) is logged, the
worker stops evaluating in the background, and ``failed`` says why; the trainer then evaluates on its own thread
as before (nothing is lost but the overlap).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hivetrain.diloco.state import TrainingState

logger = logging.getLogger(__name__)

OVERLAP_CHOICES = ("auto", "on", "off")


def resolve_eval_overlap(requested: str, device_type: str, sharded: bool) -> bool:
    """Whether evaluations run in the background: "on" (not in an FSDP node, whose evaluation is a collective of all
    ranks and must not interleave with the training collectives), "off", or "auto" = on for CUDA (a GPU interleaves
    the two streams' kernels; on a CPU the evaluation takes the cores the inner steps use, so it only moves time).

    Raises:
        ValueError: an unknown setting.
    """
    if requested not in OVERLAP_CHOICES:
        raise ValueError(f"diloco.eval_overlap={requested!r}: choose one of {', '.join(OVERLAP_CHOICES)}")
    if sharded:
        return False
    return requested == "on" or (requested == "auto" and device_type == "cuda")


@dataclass(frozen=True)
class EvalResult:
    """The eval loss (nats per token) of the state of ``epoch``, and the seconds it took on the worker."""

    epoch: int
    loss: float
    seconds: float


class BackgroundEval:
    """A thread evaluating submitted states on a replica of ``model`` (module docstring).

    Args:
        model: the peer's model (its architecture and device are copied once, at construction).
        evaluate: (model, (N, T+1) int64 windows) -> loss; ``hivetrain.model.evaluate``.
        windows_NT: the held-out windows.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        evaluate: Callable[[torch.nn.Module, torch.Tensor], float],
        windows_NT: torch.Tensor,
    ):
        self.replica = copy.deepcopy(model).eval()
        self.evaluate, self.windows = evaluate, windows_NT
        device = next(self.replica.parameters()).device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._lock = threading.Condition()
        self._waiting: TrainingState | None = None
        self._results: list[EvalResult] = []
        self._closed = False
        self.skipped = 0  # epochs replaced before they were evaluated
        self.failed: str | None = None
        self._thread = threading.Thread(target=self._loop, name="background-eval", daemon=True)
        self._thread.start()

    def submit(self, state: TrainingState) -> bool:
        """Queue ``state`` for evaluation, replacing a waiting one. Returns False if the worker failed or is closed
        (the caller evaluates on its own thread)."""
        with self._lock:
            if self.failed is not None or self._closed:
                return False
            if self._waiting is not None:
                self.skipped += 1
                logger.info(
                    "background evaluation of epoch %d skipped: epoch %d is newer", self._waiting.epoch, state.epoch
                )
            self._waiting = state
            self._lock.notify_all()
            return True

    def drain(self) -> list[EvalResult]:
        """The results finished since the last call, oldest first."""
        with self._lock:
            results, self._results = self._results, []
            return results

    def close(self, timeout_s: float) -> list[EvalResult]:
        """Finish the waiting and running evaluations (at most ``timeout_s`` seconds), stop the thread and return
        the undrained results. An evaluation still running after the timeout is abandoned (its thread is a daemon)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("a background evaluation outlasted %.0f s at shutdown; its result is dropped", timeout_s)
        return self.drain()

    def _loop(self) -> None:
        from hivetrain.diloco.outer import load_into_model

        while True:
            with self._lock:
                while self._waiting is None and not self._closed:
                    self._lock.wait()
                if self._waiting is None:
                    return  # closed and nothing left
                state, self._waiting = self._waiting, None
            t0 = time.perf_counter()
            try:
                context = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
                with context:
                    load_into_model(state, self.replica)
                    loss = self.evaluate(self.replica, self.windows)  # .item() waits for this stream's kernels
            except Exception as exc:  # noqa: BLE001 - reported; the trainer evaluates on its own thread from now on
                logger.warning("background evaluation failed, evaluating on the trainer's thread from now on: %s", exc)
                with self._lock:
                    self.failed = f"{type(exc).__name__}: {exc}"
                return
            with self._lock:
                self._results.append(EvalResult(state.epoch, loss, time.perf_counter() - t0))


class Evaluations:
    """Every evaluation a trainer runs, on its thread or in the background (``BackgroundEval``): the trainer's own θ
    at start, after its outer steps and at finish, and a candidate state's loss for the sync policy.

    Args:
        model: the peer's model; it is left holding the trainer's own θ after every call.
        evaluate: (model holding θ, (N, T+1) int64 windows) -> eval loss in nats per token: ``hivetrain.model.
            evaluate``, or an FSDP node's (its ranks evaluate the shards: ``NodeInner.evaluate_model``).
        windows_NT: the held-out windows, (N, T+1) int64.
        stats: the trainer's counters (``last_eval_loss``, the ``evaluate`` part's time).
        emit: the trainer's event sink: one ``eval`` event per background result, for its epoch.
        background: evaluate after outer steps on a replica (``builder.eval_in_background``), from ``start``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        evaluate: Callable[[torch.nn.Module, torch.Tensor], float],
        windows_NT: torch.Tensor,
        stats,
        emit: Callable[..., None],
        background: bool,
    ):
        self.model, self.evaluate, self.windows = model, evaluate, windows_NT
        self.stats, self.emit, self._background = stats, emit, background
        self.worker: BackgroundEval | None = None

    def start(self) -> None:
        """Start the background worker if asked; a replica that does not fit after all leaves evaluation on the
        trainer's thread (logged)."""
        if self._background:
            try:
                self.worker = BackgroundEval(self.model, self.evaluate, self.windows)
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                logger.warning("evaluating between phases: no room for a background replica of the model (%s)", exc)

    def loss(self, own: TrainingState, candidate: TrainingState | None = None) -> float:
        """Eval loss of ``candidate`` (default: ``own``, then recorded in the stats) on the windows, on this thread;
        the model is left holding ``own``."""
        from hivetrain.diloco.outer import load_into_model

        load_into_model(candidate or own, self.model)
        loss = self.evaluate(self.model, self.windows)
        if candidate is None:
            self.stats.last_eval_loss = loss
        else:
            load_into_model(own, self.model)
        return loss

    def after_outer_step(self, own: TrainingState, due: bool) -> float | None:
        """After an outer step: if ``due`` (``diloco.eval_every``), hand ``own`` to the worker, or evaluate it here
        when there is none (or it failed) and return the loss (None when handed over or not due); then report the
        background results finished so far."""
        loss = None
        if due and (self.worker is None or not self.worker.submit(own)):
            loss = self.stats.timed("evaluate", self.loss, own)
        self.report()
        return loss

    def report(self, results: list[EvalResult] | None = None) -> None:
        """Background evaluations finished since the last call (or ``results``): an ``eval`` event each, for its
        epoch, and the newest loss in the stats (and so in our record)."""
        if self.worker is None:
            return
        for result in self.worker.drain() if results is None else results:
            self.stats.last_eval_loss = result.loss
            self.emit("eval", epoch=result.epoch, eval_loss=result.loss, eval_s=round(result.seconds, 6))

    def close(self, timeout_s: float) -> None:
        """Wait for the background evaluations (at most ``timeout_s`` seconds) and report them."""
        if self.worker is not None:
            self.report(self.worker.close(timeout_s=timeout_s))
