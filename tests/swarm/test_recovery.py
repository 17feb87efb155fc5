"""A trainer's view of its stage servers' health (``swarm.recovery``): one ``ServerHealth`` value per server, its
transitions pure on made-up times, and ``Recovery`` storing them in one place."""

from __future__ import annotations

import asyncio
import types
from collections import deque

import pytest
from hivemind.proto import runtime_pb2

from hivetrain.swarm import wire
from hivetrain.swarm.client import CallFailed
from hivetrain.swarm.failures import FailureConfig, PeerHealth
from hivetrain.swarm.ledger import GradientLedger, LedgerEntry
from hivetrain.swarm.recovery import Recovery, ServerHealth

from .test_decisions import NOW

CONFIG = FailureConfig(dead_after_timeouts=3, window_s=8.0, dead_ban_time_s=12.0)
INTERVAL_S = 2.0


def test_a_failed_call_makes_a_suspect_and_an_answer_clears_it():
    health, verdict = ServerHealth().failed("timeout", NOW, CONFIG, sent_at=NOW - 1)
    assert health.suspect and health.calls == verdict.health and health.calls.num_failures == 1
    answered, kind = health.answered(NOW + 1)
    assert kind == "alive" and answered == ServerHealth()


def test_a_reply_sent_before_the_death_verdict_leaves_the_server_dead():
    dead, verdict = ServerHealth().failed("unreachable", NOW, CONFIG, sent_at=NOW - 1)
    assert verdict.declare_dead and dead.calls.dead
    assert dead.answered(NOW - 0.5) == (dead, "before_death")
    revived, kind = dead.answered(NOW + 0.5)
    assert kind == "false_death" and revived == ServerHealth()


def test_declared_dead_spends_the_signal_and_clears_the_suspect_only_when_replaying():
    suspect = ServerHealth(suspect=True)
    assert suspect.declared_dead(replay_now=True) == ServerHealth()
    assert suspect.declared_dead(replay_now=False) == ServerHealth(suspect=True)


def test_a_server_is_gone_after_two_missing_reads_two_announce_intervals_apart():
    health = ServerHealth(calls=PeerHealth(num_failures=1, last_failure_at=NOW))
    health, gone = health.read(False, NOW, INTERVAL_S)
    assert not gone and (health.missing_since, health.missing_reads) == (NOW, 1)
    health, gone = health.read(False, NOW + 1.0, INTERVAL_S)  # two reads, but too close together
    assert not gone and (health.missing_since, health.missing_reads) == (NOW, 2)
    back, gone = health.read(True, NOW + 2.0, INTERVAL_S)  # a record again: the count starts over
    assert not gone and back.missing_reads == 0 and back.calls == health.calls
    health, gone = health.read(False, NOW + 2 * INTERVAL_S, INTERVAL_S)
    assert gone and health == ServerHealth()  # its failures are forgotten with its ledger entries


def _entry(peer_id: str) -> LedgerEntry:
    tensor = runtime_pb2.Tensor(buffer=b"x")
    return LedgerEntry(0, f"mb-{peer_id}", peer_id, "inc", 0, tensor, tensor)


def _recovery() -> tuple[Recovery, list[LedgerEntry]]:
    resent: list[LedgerEntry] = []

    async def resend(entry: LedgerEntry):
        resent.append(entry)
        return "other", wire.ReplyMeta(status="ok")

    stats = types.SimpleNamespace(
        cancelled_calls=0, false_deaths=0, replays=0, replayed_at=deque(), replayed_from=deque()
    )
    return Recovery(GradientLedger(), CONFIG, INTERVAL_S, stats, resend), resent


def test_recovery_keeps_one_health_per_server_and_forgets_servers_it_knows_nothing_of():
    async def scenario():
        recovery, resent = _recovery()
        recovery.accepted(_entry("a"))
        recovery.judge("a", "timeout", NOW, NOW - 1)
        assert recovery.health("a").suspect
        assert await recovery.settle_once(0.0) == 1  # its entry is unresolved while it is a suspect
        recovery.answered("a", NOW + 1, wire.ReplyMeta(status="ok", incarnation="inc"))
        assert recovery.health("a") == ServerHealth() and "a" not in recovery._servers
        assert await recovery.settle_once(0.0) == 0 and resent == []

    asyncio.run(scenario())


def test_declaring_a_server_dead_abandons_its_watched_calls_and_replays_its_gradients():
    async def scenario():
        recovery, resent = _recovery()
        recovery.accepted(_entry("a"))
        never = asyncio.get_running_loop().create_future()

        async def call(peer_id: str):
            await never
            return None, None

        watched = asyncio.ensure_future(recovery.watched("a", call))
        await asyncio.sleep(0)
        assert recovery.health("a").death is not None
        verdict = recovery.judge("a", "unreachable", NOW, NOW - 1)
        recovery.declare_dead("a", verdict.replay_now)
        with pytest.raises(CallFailed, match="declared dead"):
            await watched
        assert recovery.stats.cancelled_calls == 1
        health = recovery.health("a")
        assert health.death is None and not health.suspect and health.calls.dead
        assert await recovery.settle_once(1.0) == 0 and [e.peer_id for e in resent] == ["a"]
        never.cancel()

    asyncio.run(scenario())


def test_a_server_missing_from_the_records_is_replayed_once_gone():
    async def scenario():
        recovery, resent = _recovery()
        recovery.accepted(_entry("a"))
        recovery.read([], NOW)
        recovery.read([], NOW + 2 * INTERVAL_S)
        assert await recovery.settle_once(1.0) == 0 and [e.peer_id for e in resent] == ["a"]
        assert recovery.health("a") == ServerHealth()

    asyncio.run(scenario())
