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

Everything the trainer knows of one server's health is one ``ServerHealth`` value (its failed calls, whether it is a
suspect, the record reads it was missing from, the signal that wakes its watched calls). Its pure methods compute the
next value; ``Recovery._set`` is the one place it is stored, as ``swarm.phase.StagePhase`` is for a server's phase.

Every method runs on the trainer's event loop. Units: seconds on ``time.monotonic()``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from hivetrain.swarm import wire
from hivetrain.swarm.announce import StageRecord
from hivetrain.swarm.client import CallFailed
from hivetrain.swarm.failures import (
    AnswerKind,
    FailureConfig,
    FailureKind,
    FailureVerdict,
    PeerHealth,
    judge_answer,
    judge_failure,
)
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


@dataclass(frozen=True)
class ServerHealth:
    """One stage server's health as one trainer sees it (replaced, never mutated: ``Recovery._set``).

    Attributes:
        calls: its failed calls since its last answer and any death verdict (``failures.PeerHealth``).
        suspect: its last call failed in the network, so it may be dead: the gradients it holds count as unresolved
            (``Recovery.settle_once``) until it answers or they are replayed.
        missing_since: when the first of the consecutive record reads it was missing from happened (meaningless when
            ``missing_reads`` is 0).
        missing_reads: consecutive reads of the stage records it was missing from (0 = in the last read).
        death: resolved when it is declared dead, to abandon the calls watched there (``Recovery.watched``); None =
            no call has watched it since.
    """

    calls: PeerHealth = PeerHealth()
    suspect: bool = False
    missing_since: float = 0.0
    missing_reads: int = 0
    death: asyncio.Future | None = None

    def failed(
        self, kind: FailureKind, now: float, config: FailureConfig, sent_at: float
    ) -> tuple[ServerHealth, FailureVerdict]:
        """After a call of ``kind`` sent at ``sent_at`` failed at ``now`` (``failures.judge_failure``): a suspect."""
        verdict = judge_failure(self.calls, kind, now, config, sent_at)
        return dataclasses.replace(self, calls=verdict.health, suspect=True), verdict

    def answered(self, answered_at: float) -> tuple[ServerHealth, AnswerKind]:
        """After a reply at ``answered_at`` (``failures.judge_answer``): its failures are forgotten and it is no
        suspect, unless the reply came before its death verdict (it stays dead, unchanged)."""
        calls, kind = judge_answer(self.calls, answered_at)
        if kind == "before_death":
            return self, kind
        return dataclasses.replace(self, calls=calls, suspect=False), kind

    def declared_dead(self, replay_now: bool) -> ServerHealth:
        """After its death was signalled (``death`` is spent); with ``replay_now`` its gradients are being replayed,
        so it is no suspect."""
        return dataclasses.replace(self, death=None, suspect=self.suspect and not replay_now)

    def read(self, present: bool, read_at: float, announce_interval_s: float) -> tuple[ServerHealth, bool]:
        """After a read of the stage records at ``read_at`` that held its record or not. Returns the new value and
        whether it is gone: missing from two reads at least two announce intervals apart (a live server re-announces
        every interval); a gone server's failures are forgotten with its ledger entries."""
        if present:
            return dataclasses.replace(self, missing_since=0.0, missing_reads=0), False
        since = self.missing_since if self.missing_reads else read_at
        reads = self.missing_reads + 1
        if reads >= 2 and read_at - since >= 2 * announce_interval_s:
            return dataclasses.replace(self, calls=PeerHealth(), missing_since=0.0, missing_reads=0), True
        return dataclasses.replace(self, missing_since=since, missing_reads=reads), False


_UNKNOWN = ServerHealth()
"""A server nothing is known of: never failed, present, no call watching it."""


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
        self.pending: list[LedgerEntry] = []  # replays not finished yet
        self._servers: dict[str, ServerHealth] = {}  # peer -> its health; absent = _UNKNOWN
        self._tasks: set[asyncio.Task] = set()
        self._slots = asyncio.Semaphore(MAX_REPLAYS_IN_FLIGHT)

    def health(self, peer_id: str) -> ServerHealth:
        """What this trainer knows of ``peer_id``'s health."""
        return self._servers.get(peer_id, _UNKNOWN)

    def _set(self, peer_id: str, health: ServerHealth) -> None:
        """The one place a server's health changes. A server back to knowing nothing leaves the dict (memory stays
        bounded by the servers with something to remember)."""
        if health == _UNKNOWN:
            self._servers.pop(peer_id, None)
        else:
            self._servers[peer_id] = health

    # ---- calls and verdicts --------------------------------------------------------------------------------------
    async def watched(self, peer_id: str, call):
        """``await call(peer_id)``, returning (reply, result, when the reply came).

        Raises CallFailed (kind "unreachable") as soon as another call declares ``peer_id`` dead: microbatches in flight
        there reroute at once, not at their timeout."""

        async def timed():
            reply, result = await call(peer_id)
            return reply, result, time.monotonic()

        task = asyncio.ensure_future(timed())
        health = self.health(peer_id)
        death = health.death
        if death is None or death.done():
            death = asyncio.get_running_loop().create_future()
            self._set(peer_id, dataclasses.replace(health, death=death))
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
        health, verdict = self.health(peer_id).failed(kind, now, self.config, sent_at)
        self._set(peer_id, health)
        return verdict

    def declare_dead(self, peer_id: str, replay_now: bool) -> None:
        """``peer_id`` was just declared dead: abandon its calls in flight, and with ``replay_now`` (it is unreachable)
        replay the gradients it holds at once."""
        health = self.health(peer_id)
        if health.death is not None and not health.death.done():
            health.death.set_result(None)
        self._set(peer_id, health.declared_dead(replay_now))
        if replay_now:
            self.queue(self.ledger.forget(peer_id))

    def answered(self, peer_id: str, answered_at: float, reply: wire.ReplyMeta) -> bool:
        """Count a reply of ``peer_id`` and apply what it says about its windows. Returns False if it was sent before
        the server was declared dead (it stays dead)."""
        health, kind = self.health(peer_id).answered(answered_at)
        self._set(peer_id, health)
        if kind == "false_death":
            self.stats.false_deaths += 1
            logger.warning("server %s answered after being declared dead", peer_id[:12])
        self.observe(peer_id, reply)
        return kind != "before_death"

    # ---- ledger and replays --------------------------------------------------------------------------------------
    def accepted(self, entry: LedgerEntry) -> None:
        """Keep an accepted backward call; replayed at once if its server was already declared dead and replayed."""
        self.ledger.add(entry)
        if self.health(entry.peer_id).calls.replayed:
            self.queue(self.ledger.forget(entry.peer_id))

    def observe(self, peer_id: str, reply: wire.ReplyMeta) -> None:
        """Apply a server's report of its windows: durable entries leave the ledger, lost ones are replayed."""
        self.queue(self.ledger.observe(peer_id, reply.incarnation, reply.open_window, reply.abandoned))

    def read(self, records: list[StageRecord], read_at: float) -> None:
        """Apply a fresh read (at ``read_at``) of the stage records: each server's windows, and servers gone."""
        live = {r.peer_id: (r.incarnation, r.open_window, r.abandoned) for r in records}
        replays = []
        for peer_id in list(self.ledger.entries):
            health, gone = self.health(peer_id).read(peer_id in live, read_at, self.announce_interval_s)
            self._set(peer_id, health)
            if peer_id in live:
                replays.extend(self.ledger.observe(peer_id, *live[peer_id]))
            elif gone:
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
        at_suspects = sum(len(self.ledger.entries.get(p, ())) for p, h in self._servers.items() if h.suspect)
        return len(self.pending) + len(self._tasks) + at_suspects

    def cancel(self, loop: asyncio.AbstractEventLoop) -> None:
        """Cancel the replays in flight (from any thread; ``loop`` is the trainer's)."""
        if self._tasks:
            for task in list(self._tasks):
                loop.call_soon_threadsafe(task.cancel)
