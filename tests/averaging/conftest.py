"""Shared fixtures for averaging tests: DHT nodes on 127.0.0.1, averagers, and running calls on threads."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hivetrain.peers.node import NodeConfig, PeerNode, start_node

NUM_NODES = 8
LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


def start_swarm(num_nodes: int) -> list[PeerNode]:
    """``num_nodes`` DHT nodes on 127.0.0.1, all bootstrapped from the first. Caller shuts them down."""
    nodes: list[PeerNode] = []
    try:
        nodes.append(start_node(NodeConfig(host_maddrs=LOOPBACK, startup_timeout_s=30)))
        initial = tuple(nodes[0].visible_maddrs())
        for _ in range(num_nodes - 1):
            nodes.append(start_node(NodeConfig(host_maddrs=LOOPBACK, initial_peers=initial, startup_timeout_s=30)))
    except BaseException:
        for node in nodes:
            node.shutdown()
        raise
    return nodes


@pytest.fixture(scope="session")
def swarm() -> Iterator[list[PeerNode]]:
    """Eight DHT nodes shared by every averaging test of the session (tests use distinct prefixes)."""
    nodes = start_swarm(NUM_NODES)
    try:
        yield nodes
    finally:
        for node in nodes:
            node.shutdown()


@pytest.fixture
def prefix() -> str:
    """A fresh DHT prefix, so tests sharing the swarm never see each other's records."""
    return f"test-{uuid.uuid4().hex[:10]}.avg"


def run_threads(calls: list[Callable[[], Any]], timeout_s: float) -> list[Any]:
    """Run ``calls`` concurrently; returns each call's result or the exception it raised.

    Raises:
        AssertionError: a call is still running after ``timeout_s`` seconds.
    """
    results: list[Any] = [None] * len(calls)

    def wrap(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            results[i] = exc

    threads = [threading.Thread(target=wrap, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"calls still running after {timeout_s}s"
    return results


@pytest.fixture
def make_averagers(swarm: list[PeerNode], prefix: str):
    """Factory: ``make_averagers(n, config, faults=None)`` -> n started GroupAveragers on distinct swarm nodes."""
    from hivetrain.averaging import GroupAverager
    from hivetrain.faults import NO_FAULTS

    made: list = []

    def make(num: int, config, faults: list | None = None, first: int = 0, prefix_: str | None = None) -> list:
        out = []
        for i in range(num):
            injector = faults[i] if faults is not None and faults[i] is not None else NO_FAULTS
            avg = GroupAverager(swarm[first + i], prefix_ or prefix, config, faults=injector, listen_host="127.0.0.1")
            avg.start()
            made.append(avg)
            out.append(avg)
        return out

    try:
        yield make
    finally:
        for avg in made:
            avg.shutdown()


@pytest.fixture
def servers():
    """Factory of started data-plane servers on 127.0.0.1 (1 s timeouts, OS buffers); all shut down at the end."""
    from hivetrain.averaging.dataplane import DataPlaneServer

    made: list = []

    def make(**kw):
        defaults = dict(connect_timeout_s=1.0, part_timeout_s=1.0, buffer_num_bytes=0, join_wait_s=1.0)
        server = DataPlaneServer("127.0.0.1", **{**defaults, **kw})
        server.start()
        made.append(server)
        return server

    try:
        yield make
    finally:
        for s in made:
            s.shutdown()
