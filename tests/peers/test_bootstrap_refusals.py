"""A refused join says why (issue 12, item 7): a reused identity and a skewed clock are not network failures.

The real cases run hivemind's own checks on 127.0.0.1 (the skewed clock is the joiner's DHT process's clock, patched
before the process is forked); the pure cases pin the messages for each cause."""

import os
import shutil
import time
from pathlib import Path

import hivemind.dht.protocol
import pytest

from hivetrain.peers.identity import load_or_create_identity
from hivetrain.peers.node import (
    BootstrapFailed,
    NodeConfig,
    clock_skew_problem,
    explain_bootstrap_failure,
    identity_in_use,
    start_node,
)
from hivetrain.peers.validators import RecordBounds

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
PEER = "/ip4/127.0.0.1/tcp/9/p2p/QmZaPV7t8Ru4TUBX6qryUsdLzF6JuQCx8oH3c9xuuuBkGm"


@pytest.mark.slow
def test_a_reused_identity_is_named_with_the_fix(make_node, tmp_path):
    boot = make_node()
    make_node(boot.visible_maddrs(), name="twin")  # the twin: tmp_path/twin.key, live
    copy = tmp_path / "copied.key"  # the same key, copied to another machine (or path)
    shutil.copy(tmp_path / "twin.key", copy)
    # hivemind finds a taken identity by asking the bootstrap peer's daemon for the twin's addresses (a kad FIND_PEER
    # from an anonymous daemon). The daemon answers only once it has them from libp2p's identify exchange, which lags
    # the connection on a loaded machine (CI: connected, yet the copy started unchallenged). A long-running twin, the
    # real case, is long past that: wait until the daemon can answer, then start the copy.
    deadline = time.monotonic() + 30.0
    config = NodeConfig(initial_peers=tuple(boot.visible_maddrs()), host_maddrs=LOOPBACK, identity_path=str(copy))
    while not identity_in_use(load_or_create_identity(copy), config):
        assert time.monotonic() < deadline, "the bootstrap peer's daemon never learned the twin's addresses"
        time.sleep(0.5)
    with pytest.raises(BootstrapFailed) as info:
        start_node(config)
    assert info.value.cause == "identity_in_use"
    assert str(copy) in str(info.value) and "--identity-path" in str(info.value)
    assert "firewall" not in str(info.value)


@pytest.mark.slow
def test_a_skewed_clock_is_named_with_the_fix(make_node, monkeypatch):
    boot = make_node()
    monkeypatch.setattr(hivemind.dht.protocol, "get_dht_time", lambda: time.time() + 120.0)
    with pytest.raises(BootstrapFailed) as info:
        start_node(NodeConfig(initial_peers=tuple(boot.visible_maddrs()), host_maddrs=LOOPBACK, startup_timeout_s=20))
    assert info.value.cause == "clock_skew"
    message = str(info.value)
    assert "120" in message and "ahead of" in message and "NTP" in message and "firewall" not in message


@pytest.mark.slow
def test_the_clock_offset_is_measured_against_neighbours(make_node, monkeypatch):
    a = make_node()
    monkeypatch.setattr(hivemind.dht.protocol, "get_dht_time", lambda: time.time() + 2.0)  # within hivemind's 3 s
    make_node(a.visible_maddrs())  # b, whose DHT process runs 2 s ahead
    monkeypatch.undo()
    offset_a = a.clock_offset_s(timeout_s=5.0)  # b answers pings with its DHT time
    assert -2.5 < offset_a < -1.5, offset_a
    bounds = RecordBounds(max_clock_skew_s=3.0)
    assert "behind" in clock_skew_problem(offset_a, bounds) and clock_skew_problem(0.1, bounds) is None


# ---- the messages, pure -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def identity(tmp_path_factory):
    return load_or_create_identity(tmp_path_factory.mktemp("id") / "me.key")


@pytest.mark.parametrize(
    "error, cause, says, not_says",
    [
        (
            "P2PDaemonError: Identity from `/x/me.key` is already taken by another peer",
            "identity_in_use",
            "own",
            "nc -vz",
        ),
        (
            "local time must be within 3 seconds  of others(local: 1000.50000, peer: 1060.50000)",
            "clock_skew",
            "60.0 s behind",
            "firewall",
        ),
        (
            "Peer Qm can't access this node. Probably, libp2p has failed to bypass the firewall",
            "not_dialable",
            "NAT",
            "",
        ),
        ("DHTNode bootstrap failed: none of the initial_peers responded to a ping.", "unreachable", "Check that", ""),
    ],
)
def test_each_cause_has_its_message(identity, error, cause, says, not_says):
    got_cause, message = explain_bootstrap_failure(NodeConfig(initial_peers=(PEER,)), identity, error, 1.0)
    assert got_cause == cause and says in message, message
    assert not not_says or not_says not in message
    if cause == "identity_in_use":
        assert str(identity.path) in message and identity.peer_id in message


def test_a_new_swarm_that_fails_says_so(identity):
    cause, message = explain_bootstrap_failure(NodeConfig(), identity, "p2pd died", 0.5)
    assert cause == "start_failed" and "p2pd died" in message and isinstance(identity.path, Path)
    # a start-up that timed out may be a busy machine, not the network: the message says how busy it was
    assert f"on {os.cpu_count()} CPU(s)" in message and "p2pd daemon(s) running" in message
