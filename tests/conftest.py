"""Shared fixtures: DHT nodes on 127.0.0.1 that are always shut down."""

import pytest

from hivetrain.peers.node import NodeConfig, start_node

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
