"""The libp2p fallback of the data plane: members whose announced data port cannot be dialed still average."""

from __future__ import annotations

import hashlib

import pytest
import torch

from hivetrain.averaging import AveragingConfig, GroupAverager, RoundFailed, RoundResult
from hivetrain.averaging.relay import UnreachableCache

from .conftest import run_threads

CFG = dict(target_group_size=2, matchmaking_time_s=2.0, part_timeout_s=5.0, commit_timeout_s=5.0, connect_timeout_s=3.0)
UNREACHABLE_HOST = "127.0.0.2"  # loopback, but our data ports listen on 127.0.0.1 only: a direct dial is refused


def _everyone(avgs) -> frozenset[str]:
    """Every averager's id: as a trainer passes the live peers it sees at the epoch (the group closes once all are in,
    not at the window)."""
    return frozenset(a.node.peer_id for a in avgs)


def _averagers(swarm, prefix: str, config: AveragingConfig, unreachable=(0, 1)) -> list[GroupAverager]:
    avgs = []
    for i, node in enumerate(swarm[:2]):
        announce = UNREACHABLE_HOST if i in unreachable else "127.0.0.1"
        avg = GroupAverager(node, prefix, config, listen_host="127.0.0.1", announce_host=announce)
        avg.start()
        avgs.append(avg)
    return avgs


def _digest(r: RoundResult) -> str:
    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in r.tensors)).hexdigest()


def test_members_unreachable_over_tcp_average_over_libp2p(swarm, prefix) -> None:
    avgs = _averagers(swarm, prefix, AveragingConfig(**CFG))
    try:
        g = torch.Generator().manual_seed(0)
        inputs = [[torch.randn(1000, generator=g), torch.randn(7, 3, generator=g)] for _ in range(2)]
        weights = [1.0, 3.0]
        for epoch in range(2):  # the second round dials over libp2p at once (the peer is remembered unreachable)
            calls = [
                lambda a=a, x=x, w=w, e=epoch: a.average(x, w, e, 30.0, expected_peers=_everyone(avgs))
                for a, x, w in zip(avgs, inputs, weights, strict=True)
            ]
            results = run_threads(calls, timeout_s=45)
            assert all(isinstance(r, RoundResult) for r in results), results
            assert _digest(results[0]) == _digest(results[1])
            for k in range(2):
                want = (inputs[0][k] * 1.0 + inputs[1][k] * 3.0) / 4.0
                torch.testing.assert_close(results[0].tensors[k], want, atol=1e-6, rtol=0)
        dialer, other = sorted(avgs, key=lambda a: a.node.peer_id)
        assert dialer.fallback is not None and dialer.fallback.prefers_libp2p(other.node.peer_id)
        # both behind "NAT": the other could not dial back either, so each round's link was a libp2p stream
        assert dialer.fallback.dial_backs_requested == 2 and other.fallback.dial_backs_served == 0
        assert dialer.fallback.streams_opened == 2
    finally:
        for avg in avgs:
            avg.shutdown()


@pytest.mark.parametrize("unreachable", [0, 1])
def test_a_member_behind_nat_dials_back_and_the_link_stays_direct_tcp(swarm, prefix, unreachable) -> None:
    """One member of the pair announces an undialable data port (member 0 in one case, member 1 in the other, so
    across the two cases the smaller peer id, which dials, is once the reachable one and once not). Either way the
    link is direct TCP: the undialable member dials out itself, or is asked over libp2p to dial back."""
    avgs = _averagers(swarm, prefix, AveragingConfig(**CFG), unreachable=(unreachable,))
    try:
        inputs = [[torch.full((500,), 1.0)], [torch.full((500,), 3.0)]]
        for epoch in range(2):
            calls = [
                lambda a=a, x=x, e=epoch: a.average(x, 1.0, e, 30.0, expected_peers=_everyone(avgs))
                for a, x in zip(avgs, inputs, strict=True)
            ]
            results = run_threads(calls, timeout_s=45)
            assert all(isinstance(r, RoundResult) for r in results), results
            assert all(torch.equal(r.tensors[0], torch.full((500,), 2.0)) for r in results)
        assert all(a.fallback.streams_opened == 0 for a in avgs), "no byte went over a libp2p stream"
        dialer, other = sorted(avgs, key=lambda a: a.node.peer_id)
        if other is avgs[unreachable]:  # the dialer could not reach it: it was asked to dial back, every round
            assert dialer.fallback.dial_backs_requested == 2 and other.fallback.dial_backs_served == 2
        else:  # the undialable member dials out itself: no dial-back needed
            assert dialer.fallback.dial_backs_requested == 0 and other.fallback.dial_backs_served == 0
    finally:
        for avg in avgs:
            avg.shutdown()


def test_without_the_fallback_unreachable_members_fail_the_round(swarm, prefix) -> None:
    avgs = _averagers(swarm, prefix, AveragingConfig(libp2p_fallback=False, **CFG))
    try:
        x = [torch.ones(10)]
        results = run_threads([lambda a=a: a.average(x, 1.0, 0, 20.0) for a in avgs], timeout_s=35)
        assert all(isinstance(r, RoundFailed) and r.reason == "peer_failed" for r in results), results
    finally:
        for avg in avgs:
            avg.shutdown()


def test_a_dial_back_request_for_a_round_we_are_not_in_is_refused(swarm, prefix) -> None:
    avgs = _averagers(swarm, prefix, AveragingConfig(**CFG), unreachable=())
    try:
        asker, other = avgs
        assert not asker.fallback.request_dial_back(other.node.peer_id, "no-such-round", timeout_s=15.0)
        assert other.fallback.dial_backs_served == 0 and asker.fallback.dial_backs_requested == 1
    finally:
        for avg in avgs:
            avg.shutdown()


def test_unreachable_cache_forgets_after_its_period() -> None:
    cache = UnreachableCache(remember_s=60.0)
    cache.mark("a", now=100.0)
    assert cache.is_unreachable("a", now=159.0) and not cache.is_unreachable("b", now=100.0)
    assert not cache.is_unreachable("a", now=161.0)
