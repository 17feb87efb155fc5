"""The data plane and the butterfly round without a DHT: authentication against strangers, empty slices, and
heartbeats that keep a member waiting on a slow third peer from being declared stalled."""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from hivetrain.averaging import AveragingConfig
from hivetrain.averaging.allreduce import ButterflyRound
from hivetrain.averaging.base import RoundFailed
from hivetrain.averaging.handshake import RoundKeys, dial, send_declaration
from hivetrain.averaging.reduce import BufferPool, Member, RoundOutcome
from hivetrain.averaging.wire import VERSION, AuthFailed, LinkClosed
from hivetrain.faults import NO_FAULTS, Fault, FaultInjector
from hivetrain.peers.bans import BanList

from .conftest import run_threads

TIMEOUTS = dict(connect_timeout_s=1.0, part_timeout_s=1.0, buffer_num_bytes=0)


def _public(secret: X25519PrivateKey) -> bytes:
    return secret.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _dropped(sock: socket.socket) -> bool:
    """Whether the server closed (or reset) the connection without sending anything."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _wait_until(predicate, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < end:
        time.sleep(0.01)
    return predicate()


def test_only_the_member_holding_its_announced_key_can_open_a_link(servers) -> None:
    server = servers()
    ours, theirs, stranger = X25519PrivateKey.generate(), X25519PrivateKey.generate(), X25519PrivateKey.generate()
    attached = []
    keys = RoundKeys("round-1", "A", ours, {"B": _public(theirs)}, attached.append)
    server.register(keys)
    # a stranger claiming to be B, with a key of its own: it cannot answer the challenge
    fake = RoundKeys("round-1", "B", stranger, {"A": _public(ours)}, lambda link: None)
    with pytest.raises((AuthFailed, LinkClosed)):
        dial("127.0.0.1", server.port, fake, "A", **TIMEOUTS)
    # bytes that are not a frame, and a HELLO for a round nobody registered
    with socket.create_connection(("127.0.0.1", server.port), timeout=2) as raw:
        raw.sendall(os.urandom(64))
        assert _dropped(raw)
    other = RoundKeys("round-2", "B", theirs, {"A": _public(ours)}, lambda link: None)
    with pytest.raises((AuthFailed, LinkClosed)):
        dial("127.0.0.1", server.port, other, "A", **TIMEOUTS, join_wait_s=1.0)
    assert _wait_until(lambda: server.rejected >= 3, 3.0)
    assert attached == []
    # the real B gets in, and both sides measured the round trip
    real = RoundKeys("round-1", "B", theirs, {"A": _public(ours)}, lambda link: None)
    link = dial("127.0.0.1", server.port, real, "A", **TIMEOUTS)
    assert _wait_until(lambda: len(attached) == 1, 3.0)
    assert attached[0].peer_id == "B" and attached[0].key == link.key and link.rtt_s > 0
    link.close()
    attached[0].close()


def test_a_forged_declaration_push_is_dropped(servers) -> None:
    offered = []

    def on_declaration(raw) -> bool:
        offered.append(raw)
        return False  # what Matchmaker.offer answers for a declaration that does not verify

    server = servers(on_declaration=on_declaration)
    send_declaration("127.0.0.1", server.port, {"leader": "X"}, timeout_s=2.0)
    assert _wait_until(lambda: server.rejected == 1, 3.0)
    assert offered == [{"leader": "X"}]


def test_an_oversized_frame_header_is_refused_before_reading_it(servers) -> None:
    server = servers()
    with socket.create_connection(("127.0.0.1", server.port), timeout=2) as raw:
        raw.sendall(struct.pack("<4sBBHIQ", b"HVA1", VERSION, 1, 0, 1 << 30, 0))  # claims 1 GiB of metadata
        assert _dropped(raw)
    assert _wait_until(lambda: server.rejected == 1, 3.0)


def _round(servers, num: int, numel: int, faults=None, deadline_s: float = 20.0, drop_failed=True, outs=None,
           rates=None, **cfg):  # fmt: skip
    config = AveragingConfig(**{"part_timeout_s": 1.0, "connect_timeout_s": 1.0, "commit_timeout_s": 1.0, **cfg})
    srv = [servers(part_timeout_s=config.part_timeout_s) for _ in range(num)]  # it times out inbound links
    secrets = [X25519PrivateKey.generate() for _ in range(num)]
    ids = [f"peer{i}" for i in range(num)]
    members = [Member(ids[i], "127.0.0.1", srv[i].port, _public(secrets[i]), (rates or {}).get(i)) for i in range(num)]
    rounds = [
        ButterflyRound(round_id="r", members=members, me=ids[i], secret=secrets[i], server=srv[i], config=config,
                       faults=(faults or {}).get(i, NO_FAULTS), epoch=0, bans=BanList(), pool=BufferPool(),
                       drop_failed=drop_failed)
        for i in range(num)
    ]  # fmt: skip
    g = torch.Generator().manual_seed(0)
    flats = [torch.randn(numel, generator=g) for _ in range(num)]
    results = run_threads(
        [
            lambda r=r, f=f, o=o: r.run(f, 1.0, time.monotonic() + deadline_s, out=o)
            for r, f, o in zip(rounds, flats, outs or [None] * num, strict=True)
        ],
        deadline_s + 5,
    )
    return results, flats


def test_fewer_elements_than_members_leaves_empty_slices_that_still_commit(servers) -> None:
    results, flats = _round(servers, 4, 3)
    assert all(isinstance(r, RoundOutcome) for r in results), results
    expected = sum(flats) / 4
    for r in results:
        assert torch.equal(r.flat, results[0].flat)
        torch.testing.assert_close(r.flat, expected, atol=1e-6, rtol=0)


def test_heartbeats_keep_a_member_waiting_on_a_slow_peer_alive(servers) -> None:
    # peer2 is slow to send its parts (0.6 part timeouts); peer1 then also pauses 0.6 part timeouts after reducing.
    # peer0 hears nothing from peer1's data for 1.2 part timeouts, but peer1 sent heartbeats while it waited.
    slow, pausing = FaultInjector(), FaultInjector()
    slow.arm(Fault("averaging.before_send", "sleep", seconds=0.6))
    pausing.arm(Fault("averaging.after_reduce", "sleep", seconds=0.6))
    results, flats = _round(servers, 3, 3000, faults={1: pausing, 2: slow})
    assert slow.fired_count("averaging.before_send") == 1 and pausing.fired_count("averaging.after_reduce") == 1
    assert all(isinstance(r, RoundOutcome) for r in results), results
    assert all(torch.equal(r.flat, results[0].flat) for r in results)


def test_a_member_that_votes_late_but_before_the_deadline_commits_with_everyone(servers) -> None:
    # On a home uplink a vote queues behind the member's RESULT frames for seconds. The others must wait for it (up
    # to the deadline), not abort after commit_timeout_s: the late voter has every vote and would commit alone.
    late = FaultInjector()
    late.arm(Fault("averaging.before_commit", "sleep", seconds=2.5))
    results, _ = _round(servers, 3, 3000, faults={1: late}, part_timeout_s=5.0, commit_timeout_s=1.0)
    assert late.fired_count("averaging.before_commit") == 1
    assert all(isinstance(r, RoundOutcome) for r in results), results
    assert all(torch.equal(r.flat, results[0].flat) for r in results)


def test_a_member_that_reaches_its_vote_after_the_deadline_makes_everyone_abort(servers) -> None:
    late = FaultInjector()
    late.arm(Fault("averaging.before_commit", "sleep", seconds=4.0))
    results, _ = _round(servers, 3, 3000, faults={1: late}, deadline_s=3.0, part_timeout_s=6.0, commit_timeout_s=0.5)
    assert late.fired_count("averaging.before_commit") == 1
    assert all(isinstance(r, RoundFailed) and r.reason == "timeout" for r in results), results  # nobody commits


def _survivors_mean(flats, dead: set[int]) -> torch.Tensor:
    kept = [f for i, f in enumerate(flats) if i not in dead]
    return sum(kept) / len(kept)


def _expected(flats, outcome: RoundOutcome, dead: set[int]) -> torch.Tensor:
    """What ``outcome`` must hold: per slice of the round's cut, the mean of the parts its reducer averaged
    (``slice_members``; every survivor when empty). Checks that each slice averages every survivor, and that no
    dead member's own slice holds its part (only the dead member had it)."""
    from hivetrain.averaging.groups import butterfly_partition

    order = [f"peer{i}" for i in range(len(flats))]
    survivors = {order[i] for i in range(len(flats)) if i not in dead}
    cut = butterfly_partition(flats[0].numel(), order)
    slices = outcome.slice_members or tuple((start, end, tuple(sorted(survivors))) for start, end in cut)
    assert [(start, end) for start, end, _ in slices] == list(cut)
    out = torch.empty_like(flats[0])
    for k, (start, end, used) in enumerate(slices):
        assert survivors <= set(used), (k, used)
        assert k not in dead or order[k] not in used, (k, used)
        out[start:end] = sum(flats[order.index(p)][start:end] for p in used) / len(used)
    return out


@pytest.mark.parametrize("point", ["averaging.before_send", "averaging.after_reduce"])
def test_a_member_that_dies_mid_round_costs_only_its_own_contribution(servers, point) -> None:
    """Issue 23, item 2: before, one member failing failed the round everywhere; the engine matched again and every
    survivor sent everything again. Now the survivors drop it and commit the mean of their own contributions in the
    same round, bit-identical: before any part left (its slice reassigned), or after every member had counted its
    part (the slices already reduced keep its part; its own slice, which only it held, is reduced again without it
    by the next member). Its link closes as a killed process's would."""
    dying = FaultInjector()
    dying.arm(Fault(point, "raise"))
    results, flats = _round(servers, 4, 4001, faults={2: dying})
    assert dying.fired_count(point) == 1
    assert isinstance(results[2], RoundFailed), results[2]
    survivors = [results[i] for i in (0, 1, 3)]
    assert all(isinstance(r, RoundOutcome) for r in survivors), survivors
    assert all(torch.equal(r.flat, survivors[0].flat) for r in survivors)
    assert all(r.contributors == ("peer0", "peer1", "peer3") and r.excluded == ("peer2",) for r in survivors)
    assert all(r.total_weight == 3.0 for r in survivors)
    torch.testing.assert_close(survivors[0].flat, _expected(flats, survivors[0], {2}), atol=1e-6, rtol=0)
    if point == "averaging.before_send":  # never in the contributors: every slice is the survivors' mean
        torch.testing.assert_close(survivors[0].flat, _survivors_mean(flats, {2}), atol=1e-6, rtol=0)


def test_a_member_that_stalls_past_the_part_timeout_is_dropped_and_the_others_commit(servers) -> None:
    """A volunteer's machine stops (SIGSTOP, swapping) after its parts left: the others notice no byte for
    ``part_timeout_s`` and commit without it; it wakes to closed links and commits nothing."""
    stalling = FaultInjector()
    stalling.arm(Fault("averaging.after_reduce", "sleep", seconds=3.0))
    results, flats = _round(servers, 4, 4001, faults={1: stalling})
    assert stalling.fired_count("averaging.after_reduce") == 1
    assert isinstance(results[1], RoundFailed), results[1]
    survivors = [results[i] for i in (0, 2, 3)]
    assert all(isinstance(r, RoundOutcome) for r in survivors), survivors
    assert all(torch.equal(r.flat, survivors[0].flat) and r.excluded == ("peer1",) for r in survivors)
    torch.testing.assert_close(survivors[0].flat, _expected(flats, survivors[0], {1}), atol=1e-6, rtol=0)


def test_slices_reduced_before_a_member_stalled_are_kept_and_only_its_own_is_reduced_again(servers) -> None:
    """Issue 23: a member lost after the others counted its part used to cost a whole new gather (every reducer
    reduced again without it and resent its slice): under churn at 100 members each such loss took a gather's time,
    during which others left (the simulator: 6,000 s outer steps at 1 h sessions). Now a slice already reduced by a
    member still counted stays as it is, with the lost member's part in it; only the lost member's own slice (its part
    of it only it held) is reduced again, by the next member, and sent once more. The others reduce right after the
    HAVE frames, and the stalled member is noticed only ``part_timeout_s`` (2 s) later: their slices hold its part."""
    stalling = FaultInjector()
    stalling.arm(Fault("averaging.after_reduce", "sleep", seconds=3.0))
    results, flats = _round(servers, 4, 4001, faults={3: stalling}, part_timeout_s=2.0)
    assert stalling.fired_count("averaging.after_reduce") == 1
    survivors = [results[i] for i in (0, 1, 2)]
    assert all(isinstance(r, RoundOutcome) for r in survivors), results
    assert all(torch.equal(r.flat, survivors[0].flat) and r.excluded == ("peer3",) for r in survivors)
    assert [("peer3" in used) for _, _, used in survivors[0].slice_members] == [True, True, True, False]
    torch.testing.assert_close(survivors[0].flat, _expected(flats, survivors[0], {3}), atol=1e-6, rtol=0)
    assert survivors[0].total_weight == 3.0  # the lost member's samples are not counted as committed


def test_two_members_dying_at_different_stages_leave_the_rest_one_result(servers) -> None:
    early, late = FaultInjector(), FaultInjector()
    early.arm(Fault("averaging.before_send", "raise"))
    late.arm(Fault("averaging.after_reduce", "raise"))
    results, flats = _round(servers, 5, 5003, faults={0: early, 3: late}, compression="int8")
    assert early.fired_count("averaging.before_send") == 1 and late.fired_count("averaging.after_reduce") == 1
    survivors = [results[i] for i in (1, 2, 4)]
    assert all(isinstance(r, RoundOutcome) for r in survivors), results
    assert all(torch.equal(r.flat, survivors[0].flat) for r in survivors)
    assert survivors[0].excluded == ("peer0", "peer3")
    torch.testing.assert_close(survivors[0].flat, _expected(flats, survivors[0], {0, 3}), atol=0.05, rtol=0)


def test_a_member_dying_just_before_the_vote_never_leaves_two_results(servers) -> None:
    """Whether the others had voted when it died decides whether they go on without it (not yet: nobody can have
    committed) or fail holding what they voted for (the two-phase-commit gap); never a mix of results."""
    dying = FaultInjector()
    dying.arm(Fault("averaging.before_commit", "raise"))
    results, flats = _round(servers, 4, 4001, faults={3: dying})
    assert dying.fired_count("averaging.before_commit") == 1
    committed = [r for r in results if isinstance(r, RoundOutcome)]
    assert all(torch.equal(r.flat, committed[0].flat) and r.excluded == ("peer3",) for r in committed)
    assert not committed or len(committed) == 3, results
    if committed:
        torch.testing.assert_close(committed[0].flat, _expected(flats, committed[0], {3}), atol=1e-6, rtol=0)
        # it died holding every result: each other slice was reduced with its part and is kept; only its own slice
        # (whose part of its own slice only it held) was reduced again, by the next member
        assert ["peer3" in used for _, _, used in committed[0].slice_members] == [True, True, True, False]


def test_contributors_are_those_every_have_frame_holds_with_one_weight() -> None:
    from hivetrain.averaging.agreement import agree_contributors

    order = ["a", "b", "c", "d"]
    full = {"a": 1.0, "b": 2.0, "c": 1.0, "d": 1.0}
    haves = {p: {"have": dict(full)} for p in "abc"}  # d sent none: its link to every reducer failed
    haves["c"]["have"].pop("b")  # c found b's part bad (or never got it)
    contributors, weights = agree_contributors(haves, order)
    assert contributors == {"a", "c"} and weights == {"a": 1.0, "c": 1.0}
    haves = {p: {"have": dict(full)} for p in "abcd"}
    haves["d"]["have"]["a"] = 5.0  # a claimed another weight to d
    assert agree_contributors(haves, order)[0] == {"b", "c", "d"}
    haves["b"] = {"have": {"zz": 1.0}}  # malformed: b's HAVE does not count, nor does b
    assert "b" not in agree_contributors(haves, order)[0]
    assert "b" not in agree_contributors(haves, order, silent={"b"})[0]  # and a malformed HAVE is not silence


def test_a_member_whose_have_reached_only_some_members_counts_alike_everywhere() -> None:
    """A member that dies while its HAVE frames leave: ``a`` got d's HAVE, ``b`` and ``c`` did not and dropped d. Every
    member must compute the same contributors (a slice reduced with d's part is then expected with it everywhere);
    leaving a silent d out made the survivors abort the round (test_engine_faults at after_reduce, 2026-12-02)."""
    from hivetrain.averaging.agreement import agree_contributors

    order = ["a", "b", "c", "d"]
    full = {"a": 1.0, "b": 2.0, "c": 1.0, "d": 3.0}
    with_d = {p: {"have": dict(full)} for p in "abcd"}
    without_d = {p: {"have": dict(full)} for p in "abc"}
    seen_by_a = agree_contributors(with_d, order)
    assert seen_by_a == (frozenset("abcd"), full)
    assert agree_contributors(without_d, order, silent={"d"}) == seen_by_a
    assert agree_contributors(without_d, order)[0] == frozenset("abc")  # the rule before: another set than a's
    without_d["c"]["have"].pop("d")  # c never got d's part: d is out for everyone, silent or not
    with_d["c"]["have"].pop("d")
    assert (
        agree_contributors(without_d, order, silent={"d"})[0] == agree_contributors(with_d, order)[0] == {"a", "b", "c"}
    )


def test_without_a_strict_majority_of_the_declared_members_nobody_commits(servers) -> None:
    """The two sides of a network partition each go on without the other: only a strict majority of the members the
    round was declared with may commit, so at most one side does. Two of four leaving leaves two: nobody commits."""
    early, late = FaultInjector(), FaultInjector()
    early.arm(Fault("averaging.before_send", "raise"))
    late.arm(Fault("averaging.after_reduce", "raise"))
    results, _ = _round(servers, 4, 4001, faults={0: early, 3: late})
    assert early.fired_count("averaging.before_send") == 1 and late.fired_count("averaging.after_reduce") == 1
    assert all(isinstance(r, RoundFailed) for r in results), results
    assert {results[1].reason, results[2].reason} == {"aborted"}, results


def test_an_all_or_nothing_round_fails_everywhere_when_a_member_dies(servers) -> None:
    """``drop_failed=False`` (the two-stage grid's columns and confirms): a member lost fails the round for all."""
    dying = FaultInjector()
    dying.arm(Fault("averaging.after_reduce", "raise"))
    results, _ = _round(servers, 4, 4001, faults={2: dying}, drop_failed=False)
    assert dying.fired_count("averaging.after_reduce") == 1
    assert all(isinstance(r, RoundFailed) for r in results), results
    assert {results[i].reason for i in (0, 1, 3)} <= {"peer_failed", "aborted"}, results


def test_a_result_committed_after_a_repair_is_in_the_callers_buffer(servers) -> None:
    """The two-stage grid reads its column's result from the ``out`` it passed: after a member was dropped the result
    is reduced into another buffer, and must still end in ``out``."""
    dying = FaultInjector()
    dying.arm(Fault("averaging.after_reduce", "raise"))
    outs = [torch.full((4001,), float("nan")) for _ in range(4)]
    results, flats = _round(servers, 4, 4001, faults={1: dying}, outs=outs)
    assert dying.fired_count("averaging.after_reduce") == 1
    for i in (0, 2, 3):
        assert isinstance(results[i], RoundOutcome), results[i]
        assert results[i].flat is outs[i] and torch.equal(outs[i], results[0].flat)
    torch.testing.assert_close(outs[0], _expected(flats, results[0], {1}), atol=1e-6, rtol=0)


def test_slices_follow_the_members_claimed_upload_rates(servers) -> None:
    """One 10 Mbit/s member among 100 Mbit/s ones reduces a smaller slice, so it uploads less (its parts, and results
    of its small slice), and every member still commits the same exact mean; without rates the cut is equal."""
    rates = {0: 100.0, 1: 100.0, 2: 100.0, 3: 10.0}
    results, flats = _round(servers, 4, 40_000, rates=rates)
    assert all(isinstance(r, RoundOutcome) for r in results), results
    expected = sum(flats) / 4
    assert len({r.flat.numpy().tobytes() for r in results}) == 1
    torch.testing.assert_close(results[0].flat, expected, atol=1e-6, rtol=0)
    sent = [r.bytes_sent for r in results]
    # equal cut: each uploads 3 parts of 10,000 and 3 results of 10,000; the slow one now reduces (almost) nothing
    assert sent[3] < 0.7 * min(sent[:3]), sent
    equal, _ = _round(servers, 4, 40_000)
    assert max(r.bytes_sent for r in equal) - min(r.bytes_sent for r in equal) < 0.05 * equal[0].bytes_sent
    # a claim is bounded: a member claiming 1,000x the others reduces at most 2 equal shares (half of 4)
    liar, _ = _round(servers, 4, 40_000, rates={0: 10.0, 1: 10.0, 2: 10.0, 3: 10_000.0})
    assert all(isinstance(r, RoundOutcome) for r in liar), liar
    # its slice is 20,000 of 40,000: it uploads 20,000 part elements and 3 x 20,000 result ones, 80,000 fp32 more than
    # the equal cut's 30,000 + 3 x 10,000 (the frames around them are the same)
    assert liar[3].bytes_sent == equal[3].bytes_sent + 4 * 20_000
