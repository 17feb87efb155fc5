"""Network faults: the delaying TCP proxy, and network namespaces with tc bandwidth limits and partitions.

The namespace tests need root (``ip netns``); they are skipped with that reason elsewhere. Every namespace is
deleted in a fixture's finally; traffic stays on the namespaces' own addresses.
"""

import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from hivetrain.chaos.network import Member, NetnsTopology, TcpProxy, netns_available


@pytest.fixture
def echo_server():
    """An echo server on 127.0.0.1; yields its port, closed in finally."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(10)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                while data := conn.recv(65536):
                    conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        server.close()
        thread.join(5)


def round_trip_s(port: int, payload: bytes = b"ping") -> float:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        started = time.monotonic()
        conn.sendall(payload)
        received = b""
        while len(received) < len(payload):
            received += conn.recv(65536)
        assert received == payload
        return time.monotonic() - started


def test_proxy_adds_latency_each_way(echo_server):
    direct = round_trip_s(echo_server)
    proxy = TcpProxy("127.0.0.1", echo_server, latency_ms=100)
    try:
        port = proxy.start()
        delayed = round_trip_s(port)
    finally:
        proxy.close()
    assert delayed >= 0.2 > direct  # 100 ms there and 100 ms back
    assert delayed < 1.0
    assert proxy.num_bytes_forwarded == 8 and proxy.num_connections == 1


def test_proxy_loss_is_seeded_and_costs_a_retransmission():
    draws = [TcpProxy("127.0.0.1", 1, latency_ms=10, loss=0.3, rto_ms=200, seed=3) for _ in range(2)]
    a = [draws[0].delay_s() for _ in range(200)]
    b = [draws[1].delay_s() for _ in range(200)]
    assert a == b
    assert set(a) == {0.01, 0.21}
    assert 30 <= draws[0].num_chunks_lost <= 90  # ~60 of 200
    with pytest.raises(ValueError):
        TcpProxy("127.0.0.1", 1, loss=1.0)


def test_proxy_keeps_order_under_jitter(echo_server):
    proxy = TcpProxy("127.0.0.1", echo_server, latency_ms=20, jitter_ms=20, seed=1)
    try:
        port = proxy.start()
        payload = bytes(range(256)) * 4000  # 1 MB in many chunks with different delays
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            sender = threading.Thread(target=conn.sendall, args=(payload,))
            sender.start()
            received = bytearray()
            while len(received) < len(payload):
                received += conn.recv(1 << 16)
            sender.join(10)
        assert bytes(received) == payload
    finally:
        proxy.close()


NETNS_OK, NETNS_WHY = netns_available()
needs_netns = pytest.mark.skipif(not NETNS_OK, reason=f"network namespaces unavailable (needs root): {NETNS_WHY}")

_SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], 5000)); s.settimeout(20)
print("ready", flush=True)
c, _ = s.accept(); c.settimeout(20); n = 0
while d := c.recv(1 << 16): n += len(d)
print(n, flush=True)
"""
_CLIENT = """
import socket, sys, time
t = time.monotonic()
c = socket.create_connection((sys.argv[1], 5000), timeout=float(sys.argv[3]))
c.sendall(b"x" * int(sys.argv[2])); c.close()
print(time.monotonic() - t, flush=True)
"""


@pytest.fixture
def topology():
    topo = NetnsTopology()
    try:
        topo.create()
        yield topo
    finally:
        topo.close()
        assert topo.hub not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def send(topo, sender, receiver, num_bytes: int, connect_timeout_s: float = 5.0):
    """Send ``num_bytes`` from one member to another; returns (seconds, bytes received) or raises on failure."""
    server = subprocess.Popen(
        [*receiver.exec_prefix, sys.executable, "-c", _SERVER, receiver.ip],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout.readline().strip() == "ready"
        client = subprocess.run(
            [*sender.exec_prefix, sys.executable, "-c", _CLIENT, receiver.ip, str(num_bytes), str(connect_timeout_s)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if client.returncode != 0:
            raise ConnectionError(client.stderr.strip().splitlines()[-1])
        return float(client.stdout), int(server.communicate(timeout=30)[0])
    finally:
        server.kill()
        server.wait(10)


@pytest.mark.slow
@needs_netns
def test_bandwidth_limit_slows_a_member(topology):
    a, b = topology.add_member(), topology.add_member()
    assert (a.ip, b.ip) == ("10.231.0.1", "10.231.0.2")
    fast, n = send(topology, a, b, 2_000_000)
    assert n == 2_000_000
    topology.set_bandwidth(a, 8.0)  # 8 Mbit/s = 1 MB/s
    slow, n = send(topology, a, b, 2_000_000)
    assert n == 2_000_000
    assert slow > 0.8 and slow > 5 * fast, (fast, slow)  # 2 MB at 1 MB/s, less what the socket buffers hold


@pytest.mark.slow
@needs_netns
def test_partition_cuts_and_heal_restores(topology):
    a, b, c = topology.add_member(), topology.add_member(), topology.add_member()
    topology.isolate([c])
    with pytest.raises(ConnectionError, match="timed out|unreachable|No route"):
        send(topology, a, c, 1000, connect_timeout_s=1.5)
    assert send(topology, a, b, 1000)[1] == 1000  # same side still connected
    topology.heal()
    assert send(topology, a, c, 1000)[1] == 1000


_PEER_ADDR_SERVER = """
import socket, sys
s = socket.create_server(("0.0.0.0", 5000)); s.settimeout(20)
print("ready", flush=True)
c, addr = s.accept(); print(addr[0], flush=True)
"""
_DIAL = "import socket, sys; socket.create_connection((sys.argv[1], 5000), timeout=1.5)"


def dial(member: Member, address: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*member.exec_prefix, sys.executable, "-c", _DIAL, address], capture_output=True, text=True, timeout=30
    )


@pytest.mark.slow
@needs_netns
@pytest.mark.skipif(shutil.which("iptables") is None, reason="iptables not installed (Debian package iptables)")
def test_nat_member_dials_out_under_the_routers_address_and_cannot_be_dialed(topology):
    public, natted = topology.add_member(), topology.add_nat_member()
    assert natted.ip.startswith("192.168.") and natted.public_ip == "10.231.0.2"
    for receiver, dialer, addresses in ((public, natted, [public.ip]), (natted, public, [natted.ip, natted.public_ip])):
        server = subprocess.Popen(
            [*receiver.exec_prefix, sys.executable, "-c", _PEER_ADDR_SERVER], stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout.readline().strip() == "ready"
            results = [dial(dialer, address) for address in addresses]
            if receiver is public:  # MASQUERADE: the server sees the router's address
                assert results[0].returncode == 0, results[0].stderr
                assert server.communicate(timeout=30)[0].strip() == natted.public_ip
            else:  # no route to the LAN; the router drops connections from the WAN side (no port forwarding)
                assert "unreachable" in results[0].stderr, results[0].stderr
                assert "timed out" in results[1].stderr, results[1].stderr
        finally:
            server.kill()
            server.wait(10)
