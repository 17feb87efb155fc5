"""The pipeline trainer: sends microbatches through one server per stage, reroutes around failures, replays lost
gradients.

Per microbatch (SWARM parallelism, Ryabinin et al., ICML 2023, Sec. 3.2):

1. forward: for s = 0..S-1 pick a server of stage s by stochastic wiring (``routing.choose_server``), send it the
   stage input and keep that input (serialized, as sent); its output is the next stage's input.
2. loss: next-token cross-entropy of the logits on the trainer, and its gradient w.r.t. the logits.
3. backward: for s = S-1..0 send the kept input and the output gradient to the server that ran the forward; it
   recomputes the stage and returns the input gradient, adding the parameter gradients to its accumulator.

A call that fails (timeout, dead server, malformed or non-finite tensor) bans the server with backoff and resends
the same kept input to another server of the stage. A server whose daemon is gone (reset stream, refused dial) or
that timed out repeatedly is declared dead at once (``hivetrain.swarm.failures.judge_failure``): every other call in
flight to it is cancelled and rerouted, and for an unreachable one the gradients it held are replayed right away
instead of after its DHT record lapses. Rerouting: a forward is replayed from the stage input, a backward is
recomputed there from the kept input, so the gradients are those of the no-failure run. "busy" replies (the server
is syncing or moving) are retried elsewhere without a ban, and so are "expired" ones (the server was too loaded to
meet the deadline: overloaded, not faulty). Accepted backward calls enter the ``GradientLedger``,
which replays them if the server's phase is lost (see ``hivetrain.swarm.ledger``).

Layout: this file holds routing (one hop: choose a server, call it, ban or reroute) and the step; the
``recovery.Recovery`` it owns keeps the servers' health (death verdicts, abandoning calls to a dead server) and
replays lost gradients through this trainer's ``_resend``.

Shape legend: B = windows per microbatch, T = tokens per window, D = hidden size, V = vocabulary size.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from hivemind.proto import runtime_pb2
from transformers import LlamaConfig

from hivetrain.faults import NO_FAULTS, FaultInjector
from hivetrain.peers.bans import BanConfig, BanList
from hivetrain.peers.loop import LoopThread
from hivetrain.peers.node import PeerNode
from hivetrain.swarm import wire
from hivetrain.swarm.announce import StageRecord, fetch_stage_records
from hivetrain.swarm.client import CallFailed, StageClient
from hivetrain.swarm.config import SwarmConfig
from hivetrain.swarm.failures import FailureConfig
from hivetrain.swarm.ledger import GradientLedger, LedgerEntry
from hivetrain.swarm.recovery import Recovery
from hivetrain.swarm.routing import choose_server

logger = logging.getLogger(__name__)

_NAN_STRIKES = 4
_WAIT_FOR_SERVER_S = 0.2


class PipelineStalled(RuntimeError):
    """A microbatch could not pass a stage: no usable server, too many failures, or the step timed out."""


@dataclass(frozen=True)
class StepResult:
    """One trainer step. Units: nats, microbatches, seconds."""

    loss: float
    num_microbatches: int
    reroutes: int
    duration_s: float


@dataclass
class TrainerStats:
    """Counters over the trainer's life."""

    microbatches: int = 0
    reroutes: int = 0
    replays: int = 0
    busy_retries: int = 0
    expired: int = 0  # "expired" replies: the server was too loaded to meet the deadline (rerouted, not banned)
    deaths: int = 0  # servers declared dead from failed calls
    false_deaths: int = 0  # ... that answered afterwards
    cancelled_calls: int = 0  # calls in flight to a server declared dead, rerouted without waiting for them
    # (the call itself is left to end by its error or timeout: cancelling a hivemind unary call as the daemon's error
    # for it arrives kills the daemon connection's reader, and every later call then times out)
    bans: Counter = field(default_factory=Counter)
    ban_reasons: list[str] = field(default_factory=list)
    served_by: Counter = field(default_factory=Counter)
    completed_at: deque = field(default_factory=lambda: deque(maxlen=1_000_000))  # unix time per microbatch
    rerouted_completed_at: deque = field(default_factory=lambda: deque(maxlen=100_000))  # ... that needed a reroute
    replayed_at: deque = field(default_factory=lambda: deque(maxlen=100_000))  # unix time per finished replay
    rerouted_around: deque = field(default_factory=lambda: deque(maxlen=100_000))  # (unix time, failed peers) per ...
    replayed_from: deque = field(default_factory=lambda: deque(maxlen=100_000))  # (unix time, lost-at peer) per ...


class PipelineTrainer:
    """Trains through stage servers found in the DHT.

    Args:
        node: this trainer's DHT node.
        run_id: the run whose ``{run_id}.swarm.servers`` records list the stage servers.
        swarm: pipeline settings (S, compression, timeouts, bans).
        model_config: the model's config (D, V; stage servers hold the same).
        fingerprint: model fingerprint; servers of another model are ignored.
        seed: seeds stochastic wiring.
        router: the wiring policy, ``routing.choose_server`` or a function with its signature (tests pin routes).
    """

    def __init__(
        self,
        node: PeerNode,
        run_id: str,
        swarm: SwarmConfig,
        model_config: LlamaConfig,
        fingerprint: str,
        faults: FaultInjector = NO_FAULTS,
        seed: int = 0,
        loop: LoopThread | None = None,
        router: Callable[..., tuple[StageRecord | None, str]] = choose_server,
    ):
        self.node, self.run_id, self.swarm, self.model_config = node, run_id, swarm, model_config
        self.fingerprint, self.faults = fingerprint, faults
        self.loop = loop or LoopThread(name="swarm-trainer")
        self._owns_loop = loop is None
        self.rng = random.Random(seed)
        self.router = router
        self.bans = BanList(BanConfig(ban_base_s=swarm.ban_base_s, ban_max_s=swarm.ban_max_s))
        self.ledger = GradientLedger()
        self.stats = TrainerStats()
        self.inflight: Counter[str] = Counter()
        self.trainer_tag = f"{node.peer_id[-6:]}{secrets.token_hex(3)}"
        self.client: StageClient | None = None
        self._records: list[StageRecord] = []
        self._records_at = -1e9
        self.failure_config = FailureConfig.for_swarm(swarm.record_ttl_s, swarm.announce_interval_s)
        # dead servers and the gradients replayed from them (``recovery``); replays resend through our routing
        self.recovery = Recovery(
            self.ledger, self.failure_config, swarm.announce_interval_s, self.stats, resend=self._resend
        )
        self._step = 0

    # ---- lifecycle -----------------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> None:
        """Connect to the DHT's P2P daemon. Raises TimeoutError if it does not answer within ``timeout_s``."""
        p2p = self.loop.run(self.node.dht.replicate_p2p(), timeout_s)
        self.client = StageClient(p2p, self.run_id, self.swarm, self.model_config)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Cancel replays in flight and stop the loop this trainer owns; idempotent."""
        self.recovery.cancel(self.loop.loop)
        if self._owns_loop:
            self.loop.stop(timeout_s)

    # ---- public API ----------------------------------------------------------------------------------------------

    def step(self, batch_BT1: torch.Tensor) -> StepResult:
        """One training step on (B, T+1) int64 windows (B a multiple of ``swarm.microbatch_size``).

        Every microbatch is forwarded and backpropagated through one server per stage; servers accumulate the
        parameter gradients. Returns the mean loss of the microbatches.

        Raises:
            ValueError: B is not a multiple of the microbatch size, or T+1 < 2.
            PipelineStalled: a microbatch could not be completed within ``swarm.step_timeout_s``.
        """
        num_microbatches = self.swarm.num_microbatches(batch_BT1.shape[0])
        if batch_BT1.ndim != 2 or batch_BT1.shape[1] < 2:
            raise ValueError(f"expected (B, T+1) windows, got shape {tuple(batch_BT1.shape)}")
        self._step += 1
        started, reroutes_before = time.perf_counter(), self.stats.reroutes
        chunks = batch_BT1.split(self.swarm.microbatch_size)
        ids = [f"{self.trainer_tag}:{self._step}:{i}" for i in range(num_microbatches)]
        losses = self.loop.run(self._run_step(chunks, ids, train=True), self.swarm.step_timeout_s + 5.0)
        return StepResult(
            loss=sum(losses) / len(losses),
            num_microbatches=num_microbatches,
            reroutes=self.stats.reroutes - reroutes_before,
            duration_s=time.perf_counter() - started,
        )

    def evaluate(self, windows_NT1: torch.Tensor) -> float:
        """Mean next-token loss (nats) of the pipeline on (N, T+1) windows (forward passes only).

        Raises:
            PipelineStalled: as ``step``.
        """
        chunks = windows_NT1.split(self.swarm.microbatch_size)
        self._step += 1
        ids = [f"{self.trainer_tag}:eval{self._step}:{i}" for i in range(len(chunks))]
        losses = self.loop.run(self._run_step(chunks, ids, train=False), self.swarm.step_timeout_s + 5.0)
        sizes = [c.shape[0] for c in chunks]
        return sum(loss * n for loss, n in zip(losses, sizes, strict=False)) / sum(sizes)

    def settle(self, timeout_s: float) -> bool:
        """Wait until the gradients at servers that failed a call are resolved: replayed elsewhere once their records
        expire (dead), or kept because they answer again (alive), and no replay is pending. Returns False if that did
        not happen within ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            wait_s = max(deadline - time.monotonic(), 0.1)
            try:  # + 5 s: the record read that precedes the wait
                pending = self.loop.run(self._settle_once(wait_s), wait_s + 5.0)
            except TimeoutError:
                return False
            if not pending:
                return True
            time.sleep(min(0.5, self.swarm.announce_interval_s))
        return False

    def records(self) -> list[StageRecord]:
        """The stage records seen at the last refresh."""
        return list(self._records)

    def summary(self) -> dict:
        """Counters for summary.json: microbatches, reroutes, replays, bans, bytes."""
        return {
            "microbatches": self.stats.microbatches,
            "reroutes": self.stats.reroutes,
            "replays": self.stats.replays,
            "busy_retries": self.stats.busy_retries,
            "expired": self.stats.expired,
            "deaths": self.stats.deaths,
            "false_deaths": self.stats.false_deaths,
            "cancelled_calls": self.stats.cancelled_calls,
            "bans": dict(self.stats.bans),
            "ban_reasons": self.stats.ban_reasons[-20:],
            "pending_replays": len(self.recovery.pending),
            "unprotected_gradients": self.ledger.num_unprotected,
            "bytes_sent": self.client.bytes_sent if self.client else 0,
            "bytes_received": self.client.bytes_received if self.client else 0,
        }

    # ---- step internals --------------------------------------------------------------------------------------------

    async def _run_step(self, chunks, ids: list[str], train: bool) -> list[float]:
        await self._refresh_records(force=True)
        semaphore = asyncio.Semaphore(self.swarm.max_inflight_microbatches)
        deadline = time.monotonic() + self.swarm.step_timeout_s

        async def one(chunk: torch.Tensor, microbatch_id: str) -> float:
            async with semaphore:
                return await self._microbatch(chunk, microbatch_id, deadline, train)

        tasks = [asyncio.create_task(one(c, i)) for c, i in zip(chunks, ids, strict=True)]
        try:
            done, pending = await asyncio.wait(tasks, timeout=self.swarm.step_timeout_s, return_when="FIRST_EXCEPTION")
            failed = [t for t in done if t.exception() is not None]
            if failed:
                raise failed[0].exception()
            if pending:
                raise PipelineStalled(f"step did not finish within {self.swarm.step_timeout_s:.0f}s")
            return [t.result() for t in tasks]
        finally:
            for task in tasks:  # a failed step leaves no microbatch running into the next one
                task.cancel()

    async def _microbatch(self, chunk_BT1: torch.Tensor, microbatch_id: str, deadline: float, train: bool) -> float:
        num_stages = self.swarm.num_stages
        inputs: list[runtime_pb2.Tensor] = [wire.encode(chunk_BT1[:, :-1].contiguous())]  # (B, T) int64 ids
        servers: list[str] = []
        trace: list[str] = []  # failures this microbatch met
        logits_BTV = None
        for stage in range(num_stages):
            peer, out_proto, out = await self._hop_forward(stage, microbatch_id, inputs[stage], deadline, trace)
            servers.append(peer)
            if stage + 1 < num_stages:
                inputs.append(out_proto)
            else:
                logits_BTV = out
        targets_BT = chunk_BT1[:, 1:]
        logits_BTV.requires_grad_(True)
        loss = torch.nn.functional.cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten())
        if not train:
            return loss.item()
        (grad_BTV,) = torch.autograd.grad(loss, [logits_BTV])
        grad = wire.encode(grad_BTV, self.swarm.compression)
        for stage in reversed(range(num_stages)):
            grad = await self._hop_backward(stage, microbatch_id, inputs[stage], grad, servers[stage], deadline, trace)
        self.stats.microbatches += 1
        self.stats.completed_at.append(time.time())
        if trace:
            self.stats.rerouted_completed_at.append(time.time())
            self.stats.rerouted_around.append((time.time(), tuple(trace)))
        return loss.item()

    def _live_records(self) -> list[StageRecord]:
        return [r for r in self._records if r.model_fingerprint == self.fingerprint]

    async def _choose(self, stage: int, exclude: set[str], deadline: float) -> StageRecord:
        """A server for ``stage``; waits (refreshing records) while none is usable, until ``deadline``."""
        while True:
            record, reason = self.router(
                self._live_records(), stage, time.monotonic(), self.bans, self.rng, self.inflight, exclude
            )
            if record is not None:
                return record
            exclude.clear()  # servers that were busy or failed this hop may be tried again (bans still apply)
            if time.monotonic() + _WAIT_FOR_SERVER_S > deadline:
                raise PipelineStalled(f"no usable server: {reason}")
            await asyncio.sleep(_WAIT_FOR_SERVER_S)
            await self._refresh_records(force=True)

    def _ban(self, peer_id: str, stage: int, reason: str, strikes: int = 1) -> None:
        self.bans.ban(peer_id, time.monotonic(), reason=reason, weight=strikes)
        self.stats.bans[peer_id] += 1
        self.stats.ban_reasons.append(f"stage {stage} {peer_id[:12]}: {reason}")
        self.stats.reroutes += 1
        logger.info("banned stage %d server %s: %s", stage, peer_id[:12], reason)

    async def _hop(self, stage: int, deadline: float, call, preferred: str | None = None, trace: list | None = None):
        """Run ``call(peer_id)`` on servers of ``stage`` until one answers "ok"; returns (peer_id, reply, result)."""
        exclude: set[str] = set()
        failures = 0
        while True:
            if preferred is not None and not self.bans.is_banned(preferred, time.monotonic()):
                peer_id, preferred = preferred, None
            else:
                peer_id, preferred = (await self._choose(stage, exclude, deadline)).peer_id, None
            self.inflight[peer_id] += 1
            sent_at = time.monotonic()
            try:
                reply, result, answered_at = await self.recovery.watched(peer_id, call)
            except wire.BadTensor as exc:
                self._ban(peer_id, stage, f"bad tensor: {exc}", strikes=_NAN_STRIKES)
                reply = None
            except CallFailed as exc:
                self._call_failed(peer_id, stage, exc, sent_at)
                reply = None
            finally:
                self.inflight[peer_id] -= 1
            if reply is not None:
                alive = self.recovery.answered(peer_id, answered_at, reply)
                if reply.status == "ok":
                    if alive:
                        self.bans.forgive(peer_id)
                    self.stats.served_by[peer_id] += 1
                    return peer_id, reply, result
                if reply.status == "busy":
                    self.stats.busy_retries += 1
                    exclude.add(peer_id)
                    continue
                if reply.status == "expired":  # overloaded, not faulty: another server for this hop, no ban
                    self.stats.expired += 1
                    self.stats.reroutes += 1
                else:
                    self._ban(peer_id, stage, f"replied {reply.status}: {reply.detail}")
            failures += 1
            exclude.add(peer_id)
            if trace is not None:
                trace.append(peer_id)
            if failures >= self.swarm.max_attempts_per_hop or time.monotonic() > deadline:
                raise PipelineStalled(f"stage {stage}: {failures} failed attempt(s)")

    def _call_failed(self, peer_id: str, stage: int, exc: CallFailed, sent_at: float) -> None:
        """Ban the server, and if ``judge_failure`` declares it dead, cancel its other calls and maybe replay now."""
        now = time.monotonic()
        verdict = self.recovery.judge(peer_id, exc.kind, now, sent_at)
        if verdict.ban_time_s:
            self.bans.ban(peer_id, now, ban_time_s=verdict.ban_time_s, reason=verdict.reason)
            self.stats.reroutes += 1
        elif verdict.strike:
            self._ban(peer_id, stage, str(exc))
        else:  # no new evidence: the ban it already has stands
            self.stats.reroutes += 1
        if not verdict.declare_dead:
            return
        self.stats.deaths += 1
        self.stats.ban_reasons.append(f"stage {stage} {peer_id[:12]}: dead: {verdict.reason} ({exc})")
        logger.info("stage %d server %s declared dead: %s (%s)", stage, peer_id[:12], verdict.reason, exc)
        self.recovery.declare_dead(peer_id, verdict.replay_now)

    async def _hop_forward(
        self, stage: int, microbatch_id: str, x: runtime_pb2.Tensor, deadline: float, trace: list | None = None
    ):
        async def call(peer_id: str):
            reply, proto, out = await self.client.forward(
                peer_id, stage, microbatch_id, x, self._timeout(deadline), urgent=bool(trace)
            )
            return reply, (proto, out)

        peer_id, _, (proto, out) = await self._hop(stage, deadline, call, trace=trace)
        return peer_id, proto, out

    async def _hop_backward(
        self,
        stage: int,
        microbatch_id: str,
        x: runtime_pb2.Tensor,
        grad: runtime_pb2.Tensor,
        preferred: str,
        deadline: float,
        trace: list | None = None,
    ) -> runtime_pb2.Tensor | None:
        async def call(peer_id: str):
            return await self.client.backward(
                peer_id, stage, microbatch_id, x, grad, self._timeout(deadline), urgent=bool(trace)
            )

        peer_id, reply, grad_input = await self._hop(stage, deadline, call, preferred=preferred, trace=trace)
        if reply.window >= 0:
            self.recovery.accepted(LedgerEntry(stage, microbatch_id, peer_id, reply.incarnation, reply.window, x, grad))
        return grad_input

    def _timeout(self, deadline: float) -> float:
        return max(0.1, min(self.swarm.request_timeout_s, deadline - time.monotonic()))

    # ---- replays and records -------------------------------------------------------------------------------------

    async def _resend(self, entry: LedgerEntry) -> tuple[str, wire.ReplyMeta] | None:
        """``Recovery``'s replay: the same backward on another server of the entry's stage, with ``replay=True`` (the
        server only adds the parameter gradients). Returns (server, reply), or None if the stage stalled (logged; the
        entry stays pending and ``settle`` retries it)."""
        deadline = time.monotonic() + self.swarm.step_timeout_s

        async def call(peer_id: str):
            return await self.client.backward(
                peer_id,
                entry.stage,
                entry.microbatch_id + ":replay",
                entry.stage_input,
                entry.grad_output,
                self._timeout(deadline),
                replay=True,
            )

        try:
            peer_id, reply, _ = await self._hop(entry.stage, deadline, call)
        except PipelineStalled as exc:
            logger.warning("replay of %s at stage %d failed (%s); will retry", entry.microbatch_id, entry.stage, exc)
            return None
        return peer_id, reply

    async def _settle_once(self, wait_s: float) -> int:
        await self._refresh_records(force=True)
        return await self.recovery.settle_once(wait_s)

    async def _refresh_records(self, force: bool = False) -> None:
        """Re-read stage records (at most every half announce interval unless ``force``).

        A server whose record is missing from two reads at least two announce intervals apart is dead (a live one
        re-announces every interval): its ledger entries are replayed. A read that returns no record at all is
        treated as a failed read (the DHT did not answer), not as every server gone.
        """
        now = time.monotonic()
        if not force and now - self._records_at < self.swarm.announce_interval_s / 2:
            return
        records = await asyncio.get_running_loop().run_in_executor(
            None, fetch_stage_records, self.node.dht, self.run_id
        )
        if not records and self._records:
            return
        self._records, self._records_at = records, time.monotonic()
        self.recovery.read(records, self._records_at)

    def wait_for_stages(self, timeout_s: float) -> None:
        """Block until every stage has a serving server. Raises PipelineStalled after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.loop.run(self._refresh_records(force=True), timeout_s)
            served = {r.stage for r in self._live_records() if r.status == "serving"}
            if served >= set(range(self.swarm.num_stages)):
                return
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.swarm.num_stages)) - served)
                raise PipelineStalled(f"no server for stage(s) {missing} after {timeout_s:.0f}s")
            time.sleep(0.5)
