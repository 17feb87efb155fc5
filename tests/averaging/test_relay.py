"""The libp2p fallback of the data plane: members whose announced data port cannot be dialed still average."""

from __future__ import annotations

import hashlib

import torch

from hivetrain.averaging import AveragingConfig, GroupAverager, RoundFailed, RoundResult
from hivetrain.averaging.relay import UnreachableCache

from .conftest import run_threads

CFG = dict(target_group_size=2, matchmaking_time_s=2.0, part_timeout_s=5.0, commit_timeout_s=5.0, connect_timeout_s=3.0)
UNREACHABLE_HOST = "127.0.0.2"  # loopback, but our data ports listen on 127.0.0.1 only: a direct dial is refused


def _averagers(swarm, prefix: str, config: AveragingConfig) -> list[GroupAverager]:
    avgs = []
    for node in swarm[:2]:
        avg = GroupAverager(node, prefix, config, listen_host="127.0.0.1", announce_host=UNREACHABLE_HOST)
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
                lambda a=a, x=x, w=w, e=epoch: a.average(x, w, e, 30.0)
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


def test_unreachable_cache_forgets_after_its_period() -> None:
    cache = UnreachableCache(remember_s=60.0)
    cache.mark("a", now=100.0)
    assert cache.is_unreachable("a", now=159.0) and not cache.is_unreachable("b", now=100.0)
    assert not cache.is_unreachable("a", now=161.0)
