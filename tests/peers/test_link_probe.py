"""``peers.link_probe``: the coordinator's side of ``join-swarm --check`` dials only the caller's own address, and
measures rates within its bounds, on a real libp2p pair on loopback."""

import socket

import pytest

from hivetrain.peers.link_probe import (
    MAX_PROBE_BYTES,
    MAX_REPLY_BYTES,
    LinkProbeServer,
    credit_reply,
    fetch_credit,
    probe_dial,
    probe_rate,
    stream_ip,
)
from hivetrain.peers.loop import LoopThread


def test_stream_ip_is_the_streams_own_ip_or_nothing():
    assert stream_ip("/ip4/10.1.2.3/tcp/4001") == "10.1.2.3"
    assert stream_ip("/ip6/::1/tcp/4001") == "::1"
    assert stream_ip("/ip4/10.1.2.3/tcp/4001/p2p/QmX/p2p-circuit") is None  # relayed: no address of the caller
    assert stream_ip("/dns4/example.org/tcp/4001") is None
    assert stream_ip("/ip4/not-an-ip/tcp/1") is None


@pytest.fixture
def pair(make_node):
    coordinator = make_node(name="coordinator")
    volunteer = make_node(coordinator.visible_maddrs(), name="volunteer")
    loop = LoopThread(name="probe-test")
    table = [("QmWitnessed", "alice", 960, 1000), ("QmClaims", "", 0, 5000)]
    server = LinkProbeServer(credit_table=lambda limit: table[:limit])
    try:
        loop.run(server.register(loop.run(coordinator.dht.replicate_p2p(), 30), "run"), 30)
        client = loop.run(volunteer.dht.replicate_p2p(), 30)
        yield loop, server, client, coordinator.peer_id
    finally:
        loop.stop(timeout_s=2)


@pytest.mark.slow
def test_the_coordinator_dials_a_listening_port_and_reports_a_closed_one(pair):
    loop, server, client, coordinator = pair
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
        ok, detail = loop.run(probe_dial(client, coordinator, "run", port), 30)
        assert ok, detail
        assert f"127.0.0.1:{port}" in detail
    ok, detail = loop.run(probe_dial(client, coordinator, "run", port), 30)  # nobody listens there now
    assert not ok and "could not dial" in detail
    assert server.served == 2


@pytest.mark.slow
def test_rates_are_measured_and_oversized_probes_refused(pair):
    loop, server, client, coordinator = pair
    for direction in ("up", "down"):
        assert loop.run(probe_rate(client, coordinator, "run", direction, 1 << 20), 30) > 0
    with pytest.raises(ValueError, match="bytes must be"):
        loop.run(probe_rate(client, coordinator, "run", "up", MAX_PROBE_BYTES + 1), 30)
    assert server.served == 2


def test_each_caller_has_a_budget_of_dials_and_bytes():
    """A 256-byte request must not buy the coordinator's uplink over and over: per caller address and window."""
    from hivetrain.peers.link_probe import BUDGET_BYTES, BUDGET_DIALS

    server = LinkProbeServer()
    assert all(server._allow("10.0.0.1", 0) == "" for _ in range(BUDGET_DIALS))
    assert "dial checks" in server._allow("10.0.0.1", 0)
    assert all(server._allow("10.0.0.1", MAX_PROBE_BYTES) == "" for _ in range(BUDGET_BYTES // MAX_PROBE_BYTES))
    assert "MiB of rate checks" in server._allow("10.0.0.1", 1)
    assert server._allow("10.0.0.2", MAX_PROBE_BYTES) == ""  # another caller has its own


@pytest.mark.slow
def test_status_gets_the_coordinators_credit_table_over_libp2p(pair):
    loop, server, client, coordinator = pair
    assert loop.run(fetch_credit(client, coordinator, "run"), 30) == [
        ("QmWitnessed", "alice", 960, 1000),
        ("QmClaims", "", 0, 5000),
    ]
    server.credit_table = None  # a coordinator without an observer says so
    with pytest.raises(ValueError, match="keeps no credit"):
        loop.run(fetch_credit(client, coordinator, "run"), 30)


def test_a_credit_reply_is_cut_to_fit_one_message():
    import msgpack

    rows = [(f"Qm{i:044d}", "n" * 64, i, i) for i in range(2000)]
    reply = credit_reply(rows)
    assert len(msgpack.packb(reply)) <= MAX_REPLY_BYTES
    assert 0 < len(reply["credit"]) < 2000 and reply["credit"][0][0] == rows[0][0]  # the top rows are the ones kept
