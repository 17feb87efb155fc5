"""Shared fixtures: DHT nodes on 127.0.0.1 that are always shut down, and CPU hogs beside a test."""

import pytest

from hivetrain.peers.node import NodeConfig, start_node
from hivetrain.testing.hogs import DEFAULT_MAX_DURATION_S, CpuHogs

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


@pytest.fixture
def make_node(tmp_path):
    """make_node(initial_peers=(), name=None) -> PeerNode; every node is shut down after the test."""
    nodes = []

    def factory(initial_peers=(), name=None):
        identity = str(tmp_path / f"{name}.key") if name else None
        node = start_node(
            NodeConfig(
                initial_peers=tuple(initial_peers), host_maddrs=LOOPBACK, identity_path=identity, startup_timeout_s=30
            )
        )
        nodes.append(node)
        return node

    yield factory
    for node in reversed(nodes):
        node.shutdown()


@pytest.fixture
def cpu_hogs():
    """cpu_hogs(count, max_duration_s=1200) -> CpuHogs: ``count`` busy-loop processes (one core each) run beside the
    test until it ends, then are killed by PID. A hog that exited before the test ended fails the test at teardown:
    the test did not run loaded to its end."""
    started: list[CpuHogs] = []

    def factory(count: int, max_duration_s: float = DEFAULT_MAX_DURATION_S) -> CpuHogs:
        hogs = CpuHogs(count, max_duration_s)
        started.append(hogs)
        return hogs.start()

    try:
        yield factory
    finally:
        for hogs in started:
            hogs.stop()
    for hogs in started:
        print(f"\n{hogs.describe()}")
        assert not hogs.exited_early, f"CPU hogs {hogs.exited_early} ended before the test did: {hogs.describe()}"
