"""Network faults: private network namespaces on a bridge (bandwidth limits, partitions) and a delaying TCP proxy.

Namespaces (root only; ``ip`` and ``tc`` from iproute2)::

    <tag>-hub  : bridges br0 (the swarm) and br1 (the far side of a partition), no addresses
    <tag>-m<i> : one per process: lo + eth0 (10.231.x.y/16), the other end "m<i>" of its veth on a hub bridge
    <tag>-r<i> : for a member behind NAT (``add_nat_member``): a home router, wan0 (10.231.x.y/16) on the hub bridge
                 and lan0 (192.168.n.1/24); the member <tag>-m<i> sits on its LAN (192.168.n.2, default route via it)

Nothing is created in the host's namespace: traffic stays on addresses inside these namespaces. A bandwidth limit is
a ``tc tbf`` qdisc on both ends of the member's veth (its upload and its download). A partition moves members' hub
ports to br1, so the two sides share no L2 segment (packets between them are dropped, TCP connections stall as they
would on a real cut) until they are moved back. ``netem`` is not available here; latency and loss come from
``TcpProxy``, which delays each chunk it forwards and, with probability ``loss``, adds ``rto_ms`` to model the
retransmission a lost segment costs TCP.

A NAT router is real: ``iptables`` (Debian package ``iptables``) MASQUERADEs the LAN's connections out of wan0, and
drops every connection that starts on the WAN side (no port forwarding), as a home router does; nobody outside can
dial the member, and it dials out under the router's address. Its rules live in the router's namespace and go with it.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import subprocess
import threading
import time
from dataclasses import dataclass

SUBNET_PREFIX = "10.231"
_CMD_TIMEOUT_S = 10.0


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed (not root, missing iproute2, or a kernel without bridge/veth/tbf)."""


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(argv)}: {exc}") from exc
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
    return proc


@dataclass(frozen=True)
class Member:
    """One namespace attached to the hub: ``exec_prefix`` runs a command inside it; ``ip`` is its address."""

    index: int
    netns: str
    ip: str
    hub_port: str
    public_ip: str = ""  # behind NAT: the router's address, which others see (else empty: ``ip`` is public)

    @property
    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]


class NetnsTopology:
    """Creates the hub and members on demand; ``close()`` deletes every namespace it created (idempotent).

    Args:
        tag: prefix of the namespace names; default a fresh unique one.

    Raises:
        NetnsError: from ``create``/``add_member``/... when a command fails.
    """

    def __init__(self, tag: str | None = None):
        self.tag = tag or f"htc{secrets.token_hex(3)}"
        self.hub = f"{self.tag}-hub"
        self.members: dict[int, Member] = {}
        self._created: list[str] = []
        self._isolated: set[int] = set()
        self._num_nat = 0

    def create(self) -> None:
        _sh("ip", "netns", "add", self.hub)
        self._created.append(self.hub)
        for bridge in ("br0", "br1"):
            _sh("ip", "-n", self.hub, "link", "add", bridge, "type", "bridge")
            _sh("ip", "-n", self.hub, "link", "set", bridge, "up")

    def add_member(self) -> Member:
        """A new namespace on br0 with the next address (10.231.0.1, 10.231.0.2, ...)."""
        index, ip = self._next_address()
        netns = f"{self.tag}-m{index}"
        _sh("ip", "netns", "add", netns)
        self._created.append(netns)
        port = self._attach(netns, "eth0", index, ip)
        _sh("ip", "-n", netns, "link", "set", "lo", "up")
        member = Member(index=index, netns=netns, ip=ip, hub_port=port)
        self.members[index] = member
        return member

    def add_nat_member(self) -> Member:
        """A new namespace behind its own NAT router (no port forwarding): it connects out, nobody can dial it.

        The returned member's ``ip`` is its private LAN address, ``public_ip`` the router's; ``set_bandwidth`` limits
        its LAN link and the router's hub port, ``isolate`` cuts the router off.

        Raises:
            NetnsError: a command failed, e.g. ``iptables`` is missing (``apt-get install iptables``).
        """
        index, public_ip = self._next_address()
        if self._num_nat >= 254:
            raise NetnsError("too many NAT members")
        self._num_nat += 1
        lan = f"192.168.{self._num_nat}"
        router, netns = f"{self.tag}-r{index}", f"{self.tag}-m{index}"
        for name in (router, netns):
            _sh("ip", "netns", "add", name)
            self._created.append(name)
        port = self._attach(router, "wan0", index, public_ip)
        _sh("ip", "-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", netns)
        _sh("ip", "-n", router, "addr", "add", f"{lan}.1/24", "dev", "lan0")
        _sh("ip", "-n", router, "link", "set", "lan0", "up")
        _sh("ip", "-n", netns, "addr", "add", f"{lan}.2/24", "dev", "eth0")
        for dev in ("eth0", "lo"):
            _sh("ip", "-n", netns, "link", "set", dev, "up")
        _sh("ip", "-n", netns, "route", "add", "default", "via", f"{lan}.1")
        run = ["ip", "netns", "exec", router]
        _sh(*run, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        ipt = [*run, "iptables", "-w", "5"]
        _sh(*ipt, "-t", "nat", "-A", "POSTROUTING", "-s", f"{lan}.0/24", "-o", "wan0", "-j", "MASQUERADE")
        established = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
        for chain, extra in (("FORWARD", ["-o", "lan0"]), ("INPUT", [])):
            _sh(*ipt, "-A", chain, "-i", "wan0", *extra, *established)
            _sh(*ipt, "-A", chain, "-i", "wan0", "-j", "DROP")
        member = Member(index=index, netns=netns, ip=f"{lan}.2", hub_port=port, public_ip=public_ip)
        self.members[index] = member
        return member

    def _next_address(self) -> tuple[int, str]:
        index = len(self.members)
        if index >= 250 * 250:
            raise NetnsError("too many members")
        return index, f"{SUBNET_PREFIX}.{index // 250}.{index % 250 + 1}"

    def _attach(self, netns: str, dev: str, index: int, ip: str) -> str:
        """Wire ``netns`` to br0 by a veth (``dev`` inside, "m<index>" on the hub) with address ``ip``/16."""
        port = f"m{index}"
        _sh("ip", "-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", netns)
        _sh("ip", "-n", self.hub, "link", "set", port, "master", "br0", "up")
        _sh("ip", "-n", netns, "addr", "add", f"{ip}/16", "dev", dev)
        _sh("ip", "-n", netns, "link", "set", dev, "up")
        return port

    def set_bandwidth(self, member: Member, mbps: float, download_mbps: float | None = None) -> None:
        """Limit the member's upload to ``mbps`` and its download to ``download_mbps`` (default the same) megabit/s
        (tc tbf on its side of the veth and on the hub's, burst >= one 4 ms tick)."""
        for netns, dev, rate in ((member.netns, "eth0", mbps), (self.hub, member.hub_port, download_mbps or mbps)):
            burst_bytes = max(16 * 1024, int(rate * 1e6 / 8 / 250))
            _sh(
                "ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                "rate", f"{rate}mbit", "burst", str(burst_bytes), "latency", "200ms",
            )  # fmt: skip

    def isolate(self, members: list[Member]) -> None:
        """Partition: move ``members`` to br1; they reach each other but nobody on br0."""
        for member in members:
            _sh("ip", "-n", self.hub, "link", "set", member.hub_port, "master", "br1")
            self._isolated.add(member.index)

    def heal(self) -> None:
        """Move every isolated member back to br0."""
        for index in sorted(self._isolated):
            _sh("ip", "-n", self.hub, "link", "set", self.members[index].hub_port, "master", "br0")
        self._isolated.clear()

    def close(self) -> None:
        """Delete every namespace created here (their veths go with them). Safe to call twice."""
        while self._created:
            _sh("ip", "netns", "del", self._created.pop(), check=False)

    def __enter__(self) -> NetnsTopology:
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def netns_available() -> tuple[bool, str]:
    """Can this process create network namespaces? Returns (ok, reason)."""
    probe = NetnsTopology(tag=f"htp{secrets.token_hex(3)}")
    try:
        probe.create()
        return True, "ok"
    except NetnsError as exc:
        return False, str(exc)
    finally:
        probe.close()


class TcpProxy:
    """Forwards TCP connections from ``listen_host:port`` to ``target``, delaying every chunk each way.

    Each chunk read (<= 64 KiB) is delivered ``latency_ms`` ± ``jitter_ms`` later, plus ``rto_ms`` with probability
    ``loss``; order is kept. Runs its own asyncio loop in a daemon thread. Deterministic given ``seed`` and the
    sequence of chunks. When either side closes or resets, both directions of that connection are closed.

    Args:
        target_host, target_port: where connections go.
        latency_ms, jitter_ms, loss, rto_ms: the delay model (ms; loss is a probability in [0, 1)).
        seed: seeds jitter and loss draws.
        listen_host: address to listen on (port chosen by the OS).
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        latency_ms: float = 0.0,
        jitter_ms: float = 0.0,
        loss: float = 0.0,
        rto_ms: float = 200.0,
        seed: int = 0,
        listen_host: str = "127.0.0.1",
    ):
        if latency_ms < 0 or jitter_ms < 0 or rto_ms < 0 or not 0.0 <= loss < 1.0:
            raise ValueError("latency_ms, jitter_ms, rto_ms must be >= 0 and loss in [0, 1)")
        self.target = (target_host, target_port)
        self.latency_ms, self.jitter_ms, self.loss, self.rto_ms = latency_ms, jitter_ms, loss, rto_ms
        self.listen_host = listen_host
        self.port: int | None = None
        self.num_bytes_forwarded = 0
        self.num_chunks_lost = 0
        self.num_connections = 0
        self._rng = random.Random(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def delay_s(self) -> float:
        """The delay of the next chunk, seconds (draws from the seeded generator)."""
        delay = self.latency_ms + (self._rng.uniform(-1.0, 1.0) * self.jitter_ms if self.jitter_ms else 0.0)
        if self.loss and self._rng.random() < self.loss:
            self.num_chunks_lost += 1
            delay += self.rto_ms
        return max(0.0, delay) / 1000.0

    def start(self, timeout_s: float = 10.0) -> int:
        """Start listening; returns the port. Raises RuntimeError if not listening within ``timeout_s``."""
        self._thread = threading.Thread(target=self._run, name="chaos-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self.port is None:
            raise RuntimeError(f"proxy did not start: {self._error!r}")
        return self.port

    def close(self, timeout_s: float = 5.0) -> None:
        loop = self._loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            self._server = loop.run_until_complete(asyncio.start_server(self._handle, self.listen_host, 0))
            self.port = self._server.sockets[0].getsockname()[1]
            self._ready.set()
            loop.run_forever()
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
            self._ready.set()
        finally:
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.run_until_complete(asyncio.sleep(0))
            if self._server is not None:
                self._server.close()
            loop.close()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            upstream_r, upstream_w = await asyncio.wait_for(asyncio.open_connection(*self.target), timeout=10.0)
        except (OSError, asyncio.TimeoutError):
            client_w.close()
            return
        await asyncio.gather(self._pump(client_r, upstream_w, client_w), self._pump(upstream_r, client_w, upstream_w))

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, src_w: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                deliver_at, data = await queue.get()
                if data is None:
                    return
                wait_s = deliver_at - time.monotonic()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                dst.write(data)
                await dst.drain()
                self.num_bytes_forwarded += len(data)

        writer = asyncio.ensure_future(deliver())
        last_at = 0.0
        try:
            while data := await src.read(65536):
                last_at = max(last_at, time.monotonic() + self.delay_s())
                await queue.put((last_at, data))
            await queue.put((last_at, None))
            await writer
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.cancel()
            for w in (dst, src_w):
                w.close()
