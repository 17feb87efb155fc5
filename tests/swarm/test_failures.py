"""Death detection from failed calls (``swarm.failures``): pure decisions on made-up times, and their reroute."""

from __future__ import annotations

import math
import random

import pytest

from hivetrain.peers.bans import BanConfig, BanList
from hivetrain.swarm.failures import FailureConfig, PeerHealth, classify_error, judge_answer, judge_failure
from hivetrain.swarm.routing import choose_server

from .test_decisions import NOW, rec

CONFIG = FailureConfig(dead_after_timeouts=3, window_s=8.0, dead_ban_time_s=12.0)


def test_daemon_errors_of_a_dead_peer_are_unreachable_and_handler_errors_are_not():
    assert classify_error("P2PDaemonError('stream reset')") == "unreachable"
    assert classify_error("P2PDaemonError('failed to dial: dial tcp 127.0.0.1:4242: connect: connection refused')") == (
        "unreachable"
    )
    assert classify_error("P2PHandlerError('Failed to call handler `r.swarm.forward`: ValueError')") == "error"
    assert classify_error("P2PDaemonError('Handler for protocol x is not registered')") == "error"


def test_an_unreachable_server_is_dead_at_once_and_its_gradients_replay_now():
    verdict = judge_failure(PeerHealth(), "unreachable", NOW, CONFIG)
    assert verdict.declare_dead and verdict.replay_now and verdict.ban_time_s == CONFIG.dead_ban_time_s
    assert verdict.health.dead and verdict.health.dead_since == NOW and verdict.health.replayed
    # the calls that were in flight there fail next: already dead, not declared (or replayed, or banned) again
    again = judge_failure(verdict.health, "unreachable", NOW + 0.01, CONFIG)
    assert again.health == verdict.health and not (again.declare_dead or again.replay_now or again.strike)


def test_timeouts_declare_a_server_dead_for_routing_only_when_repeated_within_the_window():
    first = judge_failure(PeerHealth(), "timeout", NOW, CONFIG, sent_at=NOW - 5)
    assert (
        not first.declare_dead and first.strike and first.ban_time_s == 0
    )  # the ordinary backoff: it may only be slow
    second = judge_failure(first.health, "timeout", NOW + 2.0, CONFIG, sent_at=NOW + 0.5)
    assert not second.declare_dead and second.strike  # two timeouts happen to live servers of a busy machine
    third = judge_failure(second.health, "error", NOW + 5.0, CONFIG, sent_at=NOW + 4.0)
    assert third.declare_dead and not third.replay_now and third.ban_time_s == 0  # its gradients wait for its record
    assert third.health.dead and not third.health.replayed
    assert "3 failed calls (2 timeouts) in 5.0s" in third.reason

    late = judge_failure(second.health, "timeout", NOW + CONFIG.window_s + 0.1, CONFIG)
    assert not late.declare_dead and late.health.num_failures == 1  # old failures do not count


def test_calls_queued_together_that_time_out_together_are_one_outage():
    """Four calls sent within 0.3 s time out within 0.3 s: one piece of evidence, one strike, no death."""
    health = PeerHealth()
    verdicts = []
    for i in range(4):
        verdict = judge_failure(health, "timeout", NOW + 5.0 + 0.1 * i, CONFIG, sent_at=NOW + 0.1 * i)
        health = verdict.health
        verdicts.append(verdict)
    assert [v.strike for v in verdicts] == [True, False, False, False]
    assert not any(v.declare_dead for v in verdicts) and health.num_failures == 1
    # a call sent after that failure was seen is new evidence
    assert judge_failure(health, "timeout", NOW + 11.0, CONFIG, sent_at=NOW + 6.0).strike

    errors = PeerHealth()
    for i in range(5):
        verdict = judge_failure(errors, "error", NOW + i, CONFIG)
        errors = verdict.health
        assert not verdict.declare_dead  # handler errors without a timeout: alive, banned with backoff


def test_an_answer_forgets_failures_reports_a_false_death_and_keeps_a_reply_sent_before_death_dead():
    timed_out = judge_failure(PeerHealth(), "timeout", NOW, CONFIG).health
    assert judge_answer(timed_out, NOW + 1) == (PeerHealth(), "alive")
    dead = judge_failure(PeerHealth(), "unreachable", NOW, CONFIG).health
    assert judge_answer(dead, NOW + 1) == (PeerHealth(), "false_death")
    # a reply that came at NOW - 0.01 but was handled after the verdict: the server stays dead (and replayed)
    assert judge_answer(dead, NOW - 0.01) == (dead, "before_death")
    assert judge_failure(PeerHealth(), "timeout", NOW + 1, CONFIG).health.dead_since == math.inf


def test_the_reroute_is_the_stages_other_server_until_the_dead_ban_ends():
    records = [rec("dead", 1, 50.0), rec("alive", 1, 10.0), rec("other-stage", 2, 99.0)]
    bans = BanList(BanConfig(ban_base_s=1.0, ban_max_s=60.0))
    verdict = judge_failure(PeerHealth(), "unreachable", NOW, CONFIG)
    bans.ban("dead", NOW, ban_time_s=verdict.ban_time_s, reason=verdict.reason)
    for seed in range(50):  # the dead server had 5x the weight: without the verdict it would win most picks
        chosen, _ = choose_server(records, 1, NOW + 0.001, bans, random.Random(seed), exclude={"dead"})
        assert chosen.peer_id == "alive"
        chosen, _ = choose_server(records, 1, NOW + CONFIG.dead_ban_time_s - 0.1, bans, random.Random(seed))
        assert chosen.peer_id == "alive"
    assert not bans.is_banned("dead", NOW + CONFIG.dead_ban_time_s + 0.1)


def test_failure_config_is_sized_by_the_record_lifetime_and_rejects_bad_values():
    config = FailureConfig.for_swarm(record_ttl_s=4.0, announce_interval_s=1.0)
    assert config.window_s == 8.0 and config.dead_ban_time_s == 12.0  # 2 x (ttl + 2 announce intervals)
    with pytest.raises(ValueError, match="dead_after_timeouts"):
        FailureConfig(dead_after_timeouts=0)
    with pytest.raises(ValueError, match="dead_ban_time_s"):
        FailureConfig(dead_ban_time_s=math.inf)
