"""A pipeline trainer's recovery from stage servers that fail: which servers it counts as dead, and the gradients it
replays elsewhere.

``Recovery`` applies, for one ``PipelineTrainer``, the pure rules of ``failures`` (when failed calls declare a server
dead, what a later answer means) and of ``ledger`` (which accepted gradients are durable, which must be replayed):

* **Calls**: every call to a server runs under ``watched``, which abandons it as soon as another call declares that
  server dead (the microbatch reroutes at once, not at its timeout; the call itself ends on its own).
* **Verdicts**: ``judge`` counts a failed call into the server's health; ``declare_dead`` wakes its abandoned calls and,
  for an unreachable server, replays its ledger entries right away. ``answered`` counts a reply (a server that answers
  after being declared dead is a false death) and applies what it says about its windows.
* **Records**: ``read`` applies a fresh read of the DHT's stage records: a server missing from two reads at least two
  announce intervals apart is dead (a live one re-announces every interval), and its entries are replayed.
* **Replays**: a lost gradient is recomputed on another server of its stage by the trainer's ``resend`` (the same
  backward, ``replay=True``), at most ``MAX_REPLAYS_IN_FLIGHT`` at once; one that finds no server stays pending and
  is retried by ``settle_once``.

Every method runs on the trainer's event loop. Units: seconds on ``time.monotonic()``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

from hivetrain.swarm import wire
from hivetrain.swarm.announce import StageRecord
from hivetrain.swarm.client import CallFailed
from hivetrain.swarm.failures import FailureConfig, FailureKind, FailureVerdict, PeerHealth, judge_answer, judge_failure
from hivetrain.swarm.ledger import GradientLedger, LedgerEntry

logger = logging.getLogger(__name__)

MAX_REPLAYS_IN_FLIGHT = 2
"""Replays one trainer has in flight at once: a dead server's whole ledger sent at once would wait in the survivors'
queues past its timeout (expired replies, the stage's last server then excluded) instead of finishing."""


class Counters(Protocol):
    """What ``Recovery`` counts, in the trainer's ``TrainerStats``."""

    cancelled_calls: int  # calls abandoned because their server was declared dead meanwhile
    false_deaths: int  # servers that answered after being declared dead
    replays: int  # replays finished
    replayed_at: deque  # unix time per finished replay
    replayed_from: deque  # (unix time, the server the gradient was lost at) per finished replay


Resend = Callable[[LedgerEntry], Awaitable[tuple[str, wire.ReplyMeta] | None]]


def _consume_result(task: asyncio.Task) -> None:
    """Retrieve an abandoned call's outcome (asyncio would log an exception nobody retrieved)."""
    if not task.cancelled():
        task.exception()


class Recovery:
    """Dead servers and lost gradients of one trainer (module docstring).

    Args:
        ledger: the trainer's accepted, not yet durable backward calls.
        config: when failed calls declare a server dead.
        announce_interval_s: how often live servers re-announce their records, seconds.
        stats: the trainer's counters (``Counters``: the ones counted here).
        resend: recomputes an entry's backward on another server of its stage; returns (server, reply), or None if
            the stage had no usable server in time (the entry stays pending).
    """

    def __init__(
        self,
        ledger: GradientLedger,
        config: FailureConfig,
        announce_interval_s: float,
        stats: Counters,
        resend: Resend,
    ):
        self.ledger, self.config, self.announce_interval_s = ledger, config, announce_interval_s
        self.stats, self.resend = stats, resend
        self.suspects: set[str] = set()  # servers whose last call failed in the network (maybe dead)
        self.pending: list[LedgerEntry] = []  # replays not finished yet
        self._health: dict[str, PeerHealth] = {}
        self._death_signals: dict[str, asyncio.Future] = {}  # peer -> set when it is declared dead
        self._missing: dict[str, tuple[float, int]] = {}  # peer -> (first read it was missing from, reads)
        self._tasks: set[asyncio.Task] = set()
        self._slots = asyncio.Semaphore(MAX_REPLAYS_IN_FLIGHT)

    # ---- calls and verdicts --------------------------------------------------------------------------------------
    async def watched(self, peer_id: str, call):
        """``await call(peer_id)``, returning (reply, result, when the reply came).

        Raises CallFailed (kind "unreachable") as soon as another call declares ``peer_id`` dead: microbatches in flight
        there reroute at once, not at their timeout."""

        async def timed():
            reply, result = await call(peer_id)
            return reply, result, time.monotonic()

        task = asyncio.ensure_future(timed())
        death = self._death_signals.get(peer_id)
        if death is None or death.done():
            death = self._death_signals[peer_id] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait([task, death], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # this hop itself was cancelled
            task.cancel()
            raise
        if not task.done():  # declared dead meanwhile: reroute now, let the call end on its own
            task.add_done_callback(_consume_result)
            self.stats.cancelled_calls += 1
            raise CallFailed(f"call to {peer_id[:12]} abandoned: declared dead by another call", "unreachable")
        return task.result()

    def judge(self, peer_id: str, kind: FailureKind, now: float, sent_at: float) -> FailureVerdict:
        """Count a call of ``kind`` sent at ``sent_at`` that failed at ``now`` (``failures.judge_failure``); the
        server is a suspect until it answers again. The caller bans it as the verdict says."""
        verdict = judge_failure(self._health.get(peer_id, PeerHealth()), kind, now, self.config, sent_at)
        self._health[peer_id] = verdict.health
        self.suspects.add(peer_id)
        return verdict

    def declare_dead(self, peer_id: str, replay_now: bool) -> None:
        """``peer_id`` was just declared dead: abandon its calls in flight, and with ``replay_now`` (it is unreachable)
        replay the gradients it holds at once."""
        death = self._death_signals.pop(peer_id, None)
        if death is not None and not death.done():
            death.set_result(None)
        if replay_now:
            self.suspects.discard(peer_id)
            self.queue(self.ledger.forget(peer_id))

    def answered(self, peer_id: str, answered_at: float, reply: wire.ReplyMeta) -> bool:
        """Count a reply of ``peer_id`` and apply what it says about its windows. Returns False if it was sent before
        the server was declared dead (it stays dead)."""
        alive = self._alive(peer_id, answered_at)
        self.observe(peer_id, reply)
        if alive:
            self.suspects.discard(peer_id)
        return alive

    def _alive(self, peer_id: str, answered_at: float) -> bool:
        health = self._health.get(peer_id)
        if health is None:
            return True
        health, kind = judge_answer(health, answered_at)
        if kind == "before_death":
            return False
        del self._health[peer_id]
        if kind == "false_death":
            self.stats.false_deaths += 1
            logger.warning("server %s answered after being declared dead", peer_id[:12])
        return True

    # ---- ledger and replays --------------------------------------------------------------------------------------
    def accepted(self, entry: LedgerEntry) -> None:
        """Keep an accepted backward call; replayed at once if its server was already declared dead and replayed."""
        self.ledger.add(entry)
        if self._health.get(entry.peer_id, PeerHealth()).replayed:
            self.queue(self.ledger.forget(entry.peer_id))

    def observe(self, peer_id: str, reply: wire.ReplyMeta) -> None:
        """Apply a server's report of its windows: durable entries leave the ledger, lost ones are replayed."""
        self.queue(self.ledger.observe(peer_id, reply.incarnation, reply.open_window, reply.abandoned))

    def read(self, records: list[StageRecord], read_at: float) -> None:
        """Apply a fresh read (at ``read_at``) of the stage records: each server's windows, and servers gone."""
        live = {r.peer_id: (r.incarnation, r.open_window, r.abandoned) for r in records}
        replays = []
        for peer_id in list(self.ledger.entries):
            if peer_id in live:
                self._missing.pop(peer_id, None)
                replays.extend(self.ledger.observe(peer_id, *live[peer_id]))
                continue
            first_miss, reads = self._missing.get(peer_id, (read_at, 0))
            self._missing[peer_id] = (first_miss, reads + 1)
            if reads + 1 >= 2 and read_at - first_miss >= 2 * self.announce_interval_s:
                del self._missing[peer_id]
                self._health.pop(peer_id, None)
                replays.extend(self.ledger.forget(peer_id))
        self.queue(replays)

    def queue(self, entries: list[LedgerEntry]) -> None:
        """Replay ``entries`` (all lost at one server) in the background."""
        if not entries:
            return
        logger.info("replaying %d gradient(s) lost at %s", len(entries), entries[0].peer_id[:12])
        self.pending.extend(entries)
        for entry in entries:
            task = asyncio.get_running_loop().create_task(self._replay(entry))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _replay(self, entry: LedgerEntry) -> None:
        async with self._slots:
            sent = await self.resend(entry)
            if sent is None:
                return
            peer_id, reply = sent
            self.pending.remove(entry)
            self.stats.replays += 1
            self.stats.replayed_at.append(time.time())
            self.stats.replayed_from.append((time.time(), entry.peer_id))
            if reply.window >= 0:
                self.accepted(
                    LedgerEntry(
                        entry.stage,
                        entry.microbatch_id,
                        peer_id,
                        reply.incarnation,
                        reply.window,
                        entry.stage_input,
                        entry.grad_output,
                    )
                )

    async def settle_once(self, wait_s: float) -> int:
        """Wait at most ``wait_s`` seconds for the replays in flight, requeue pending ones that have none; returns
        how many gradients are unresolved (pending replays and the entries held at suspects)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=wait_s)
        orphans = list(self.pending)
        if orphans and not self._tasks:
            self.pending = []
            self.queue(orphans)
        at_suspects = sum(len(self.ledger.entries.get(p, ())) for p in self.suspects)
        return len(self.pending) + len(self._tasks) + at_suspects

    def cancel(self, loop: asyncio.AbstractEventLoop) -> None:
        """Cancel the replays in flight (from any thread; ``loop`` is the trainer's)."""
        if self._tasks:
            for task in list(self._tasks):
                loop.call_soon_threadsafe(task.cancel)
