"""Start a peer's DHT node: persistent identity, listen/announce addresses, bootstrap with a bounded wait.

The DHT (hivemind, libp2p via the p2pd daemon shipped in hivemind's wheel) runs in a child process. Records signed by
the peer's identity are validated by every node (``RSASignatureValidator`` with the identity's key), and hivetrain's
records are bounded by ``RecordGuard`` (``peers/validators.py``: schema, size, expiration, timestamps, epochs).

A failed bootstrap says why: an initial peer that cannot be reached, an identity another live peer already uses, a
clock too far from the initial peer's, or an initial peer that cannot dial us back (``explain_bootstrap_failure``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from hivetrain.peers import stacks
from hivetrain.peers.dht_rejoin import REJOIN_INTERVAL_S, routing_table_peers, start_rejoin_watch
from hivetrain.peers.identity import Identity, load_or_create_identity
from hivetrain.peers.membership import AdmissionPolicy
from hivetrain.peers.validators import RecordBounds, RecordGuard

logger = logging.getLogger(__name__)


BootstrapCause = Literal["unreachable", "identity_in_use", "clock_skew", "not_dialable", "start_failed"]


class BootstrapFailed(RuntimeError):
    """The node could not join: the message says why and what to do; ``cause`` is the same for programs."""

    def __init__(self, message: str, cause: BootstrapCause = "unreachable"):
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True)
class NodeConfig:
    """How a peer joins the DHT.

    Args:
        initial_peers: multiaddrs of running peers (``/ip4/HOST/tcp/PORT/p2p/PEERID``); empty = start a new swarm.
        host_maddrs: addresses to listen on (port 0 = any free port).
        announce_maddrs: addresses others should dial (set when behind NAT/port forwarding); empty = the listen ones.
        identity_path: private key file (created if missing); None = a new identity every run.
        startup_timeout_s: give up bootstrapping after this many seconds.
        client_mode: do not accept incoming connections (for peers behind NAT without port forwarding).
        use_relay: allow reaching/being reached through libp2p circuit relays.
        extra_validators: more hivemind record validators for this node.
        run_ids: runs whose peer and stage records this node checks from the start (more can be added once the
            run is known: ``PeerNode.guard_run``).
        record_bounds: the caps every hivetrain record must respect (``RecordGuard``).
        rejoin_interval_s: how often the node pings back initial peers and known neighbours missing from its routing
            table, seconds (``peers/dht_rejoin.py``).
    """

    initial_peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    identity_path: str | None = None
    startup_timeout_s: float = 30.0
    client_mode: bool = False
    use_relay: bool = True
    extra_validators: tuple = field(default_factory=tuple)
    run_ids: tuple[str, ...] = ()
    record_bounds: RecordBounds = RecordBounds()
    rejoin_interval_s: float = REJOIN_INTERVAL_S

    def __post_init__(self) -> None:
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")
        if self.rejoin_interval_s <= 0:
            raise ValueError(f"rejoin_interval_s must be > 0, got {self.rejoin_interval_s}")
        for kind, addrs in (
            ("initial peer", self.initial_peers),
            ("listen address", self.host_maddrs),
            ("announce address", self.announce_maddrs),
        ):
            for addr in addrs:
                try:
                    Multiaddr(addr)
                except Exception as exc:  # noqa: BLE001 - multiaddr raises several types
                    example = (
                        "/ip4/203.0.113.5/tcp/31337/p2p/QmXv... (the address the coordinator prints)"
                        if kind == "initial peer"
                        else "/ip4/0.0.0.0/tcp/31337"
                    )
                    raise ValueError(
                        f"{kind} {addr!r} is not a valid multiaddr ({exc}); expected e.g. {example}"
                    ) from None
        for addr in self.initial_peers:
            if "/p2p/" not in addr:
                raise ValueError(f"initial peer {addr!r} lacks its peer ID: expected .../p2p/<PEER ID> at the end")


@dataclass
class PeerNode:
    """A running DHT node and the identity it runs under."""

    dht: hivemind.DHT
    identity: Identity
    config: NodeConfig

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def owner_marker(self) -> bytes:
        return self.identity.owner_marker

    def visible_maddrs(self) -> list[str]:
        """Full multiaddrs (with /p2p/ID) others can use as initial peers."""
        return [str(a) for a in self.dht.get_visible_maddrs()]

    def guard_run(self, run_id: str, timeout_s: float = 10.0, admission: AdmissionPolicy | None = None) -> None:
        """Have this node check the peer and stage records of ``run_id`` (``RecordGuard``) from now on, and, with an
        ``admission`` policy of that run, refuse the peer records of non-members (``peers/membership.py``).

        Raises:
            TimeoutError: the DHT process did not take the guard within ``timeout_s`` seconds.
        """
        policies = (admission,) if admission is not None else ()
        guard = RecordGuard(self.config.record_bounds, run_ids=(run_id,), admission=policies)
        self.dht.run_coroutine(partial(_add_validator, validator=guard), return_future=True).result(timeout=timeout_s)

    def clock_offset_s(self, timeout_s: float = 5.0, max_peers: int = 8) -> float | None:
        """How far our clock is ahead of the swarm's (negative: behind), seconds: the median over up to
        ``max_peers`` DHT neighbours of our time at the middle of a ping minus the time they answered.

        Returns:
            The offset, or None if no neighbour answered within ``timeout_s`` (alone, or the DHT is down).
        """
        future = self.dht.run_coroutine(partial(_probe_clock, max_peers=max_peers, timeout_s=timeout_s), True)
        try:
            offsets = future.result(timeout=timeout_s + 1.0)
        except Exception as exc:  # noqa: BLE001 - a failed probe means "unknown"
            logger.debug("clock probe failed: %s", exc)
            return None
        return statistics.median(offsets) if offsets else None

    def dht_neighbours(self, timeout_s: float = 5.0) -> list[str] | None:
        """The peer IDs in our DHT routing table now (the nodes our lookups start from); None if the DHT process did
        not answer within ``timeout_s`` seconds. Empty while we have initial peers: we are cut off from the swarm
        (``peers/dht_rejoin.py`` pings them back), and what our reads return is only our own storage."""
        try:
            return self.dht.run_coroutine(routing_table_peers, return_future=True).result(timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - unknown, not empty
            logger.debug("routing table read failed: %r", exc)
            return None

    def cut_off(self) -> bool:
        """True if we joined through initial peers and our routing table is empty now: nothing we read comes from
        the swarm (``dht_neighbours``). False when the table has nodes, when we are the swarm's first node, or when
        the DHT process did not answer (unknown)."""
        return bool(self.config.initial_peers) and self.dht_neighbours() == []

    def shutdown(self) -> None:
        """Stop the DHT process and its p2pd daemon; idempotent."""
        if self.dht.is_alive():
            self.dht.shutdown()


def ip_of(maddr: str) -> str | None:
    """The IPv4/IPv6 address of a multiaddr ("/ip4/1.2.3.4/tcp/5" -> "1.2.3.4"); None for a DNS name, a relay
    address or a string that is no multiaddr."""
    try:
        parsed = Multiaddr(maddr)
        names = {p.name for p in parsed.protocols()}
    except Exception:  # hivemind's multiaddr raises its own parse errors
        return None
    return next((parsed.value_for_protocol(n) for n in ("ip4", "ip6") if n in names), None)


def trusted_ids(initial_peers: tuple[str, ...]) -> set[str]:
    """Peer IDs named in bootstrap multiaddrs (the peers whose signed run config we accept)."""
    ids = set()
    for addr in initial_peers:
        ids.add(str(PeerID.from_base58(Multiaddr(addr).value_for_protocol("p2p"))))
    return ids


def start_node(config: NodeConfig) -> PeerNode:
    """Start the DHT, bootstrapping from ``config.initial_peers`` within ``config.startup_timeout_s``.

    Raises:
        BootstrapFailed: the node could not join (no DHT process is left behind); ``cause`` says why: no initial
            peer reached in time, our identity used by another live peer, our clock too far off, or we cannot be
            dialed back (``explain_bootstrap_failure``).
        ValueError: the identity file is invalid.
    """
    existed = config.identity_path is not None and os.path.isfile(os.path.expanduser(config.identity_path))
    identity = load_or_create_identity(config.identity_path)
    started = time.monotonic()
    if existed and config.initial_peers and identity_in_use(identity, config):
        cause, message = explain_bootstrap_failure(
            config, identity, f"Identity from `{identity.path}` is already taken", time.monotonic() - started
        )
        raise BootstrapFailed(message, cause)
    guard = RecordGuard(config.record_bounds, run_ids=config.run_ids)
    validators = [RSASignatureValidator(identity.private_key), guard, *config.extra_validators]
    dht = hivemind.DHT(
        initial_peers=list(config.initial_peers),
        start=False,
        host_maddrs=list(config.host_maddrs),
        announce_maddrs=list(config.announce_maddrs) or None,
        identity_path=str(identity.path),
        client_mode=config.client_mode,
        use_relay=config.use_relay,
        use_auto_relay=config.use_relay and config.client_mode,
        record_validators=validators,
        startup_timeout=config.startup_timeout_s,
        await_ready=False,
    )
    dht.start()
    dht._outer_pipe = LockedPipe(dht._outer_pipe)  # several of our threads send commands to the DHT process
    try:
        dht.wait_until_ready(timeout=config.startup_timeout_s)
    except BaseException as exc:
        if dht.is_alive():
            _dump_stacks(dht.pid)
            dht.shutdown()
        if isinstance(exc, KeyboardInterrupt):
            raise
        cause, message = explain_bootstrap_failure(config, identity, str(exc), time.monotonic() - started)
        raise BootstrapFailed(message, cause) from None
    logger.info("DHT node %s up in %.1fs", identity.peer_id, time.monotonic() - started)
    # neighbours that forgot us (a laptop lid, a SIGSTOP) are pinged back (``peers/dht_rejoin.py``); the DHT process
    # starts the watchdog when it takes the call, whether or not we wait for its answer here
    watch = partial(start_rejoin_watch, initial_peers=tuple(sorted(trusted_ids(config.initial_peers))),
                    interval_s=config.rejoin_interval_s)  # fmt: skip
    try:
        dht.run_coroutine(watch, return_future=True).result(timeout=config.startup_timeout_s)
    except Exception as exc:  # noqa: BLE001 - the node works without it; a sleeper may then stay cut off
        logger.warning("the DHT rejoin watchdog did not confirm its start: %r", exc)
    return PeerNode(dht=dht, identity=identity, config=config)


def _dump_stacks(pid: int | None) -> None:
    """Have the DHT process that did not start in time write its threads' stacks to our log, if our SIGUSR1 handler
    dumps stacks (``peers.stacks``; the forked process inherits it): where a start-up that
    timed out with no error text was waiting (loaded suites of sessions 22 and 23: "could not start the DHT node after
    33.3s" at a load of 2 on 2 cores). Without that handler SIGUSR1 would end the process, which is being stopped."""
    if pid is None or not stacks.enabled():
        return
    logger.warning("the DHT process (pid %d) did not start in time; its threads' stacks follow", pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGUSR1)
        time.sleep(0.5)


class LockedPipe:
    """The sending end of ``hivemind.DHT``'s command pipe (``DHT._outer_pipe``: every ``get``, ``store`` and
    ``run_coroutine`` is one ``send`` on it), with its sends serialised by a lock.

    A trainer sends from several threads at once (the record heartbeat, the train loop's matchmaking, state downloads'
    quorum reads, the routing-table check), and ``multiprocessing.Connection`` is not thread-safe: a message larger
    than the pipe's atomic write (4 KiB; a signed peer record with its θ sketch is ~4 KiB) goes out in several writes
    once the pipe is full (the DHT process busy, a loaded machine), and another thread's message can land between
    them. The DHT process then reads a corrupt stream and every later call waits forever. Everything else is the
    wrapped connection's."""

    def __init__(self, conn):
        self._conn, self._lock = conn, threading.Lock()

    def send(self, obj) -> None:
        with self._lock:
            self._conn.send(obj)

    def __getattr__(self, name):
        return getattr(self._conn, name)


IDENTITY_CHECKS = 2
"""Our own checks that a kept identity is free, before the one hivemind runs when the node starts (three in all)."""


def identity_in_use(identity: Identity, config: NodeConfig) -> bool:
    """Whether a live peer reachable through ``config.initial_peers`` already runs under ``identity``.

    hivemind's check (``P2P.is_identity_taken``, run once inside ``P2P.create``): a fresh anonymous daemon, connected
    to the initial peers, dials the identity's peer ID, which they route by kad FIND_PEER. A daemon that has just
    connected may not route it yet, and answers "free" for a live twin: 1 start in 20 beside 2 CPU hogs went ahead
    with a copied key (dev/LOG.md 2026-11-30 session 25). Each of our ``IDENTITY_CHECKS`` tries is a fresh daemon,
    so a copy is refused unless all three miss. A check that cannot run (no daemon, a timeout) counts as "free":
    hivemind's own check and the bootstrap then say what is wrong. Costs about one daemon start per try."""

    async def taken() -> bool:
        check = P2P.is_identity_taken(
            str(identity.path), initial_peers=list(config.initial_peers), tls=True, use_auto_relay=False,
            use_ipfs=False, use_relay=config.use_relay,
        )  # fmt: skip
        return await asyncio.wait_for(check, timeout=config.startup_timeout_s)

    for _ in range(IDENTITY_CHECKS):
        try:
            if asyncio.run(taken()):
                return True
        except Exception as exc:  # noqa: BLE001 - see the docstring: the start then reports the real cause
            logger.debug("identity check did not run: %r", exc)
            return False
    return False


_IDENTITY_TAKEN_RE = re.compile(r"Identity from `(.*?)` is already taken")
_CLOCK_RE = re.compile(r"local time must be within ([\d.]+) seconds\s*of others\s*\(local: ([\d.]+), peer: ([\d.]+)\)")
_NOT_DIALABLE_RE = re.compile(r"can't access this node")


def explain_bootstrap_failure(
    config: NodeConfig, identity: Identity, error: str, elapsed_s: float
) -> tuple[BootstrapCause, str]:
    """Why the DHT node failed to start, from hivemind's error text, and what to do about it.

    hivemind refuses to join (all three are correct refusals, not network failures) when another live peer of the
    swarm already uses our identity (``P2P.create``'s identity check), when our DHT time differs from an initial
    peer's by more than 3 s (``DHTProtocol.call_ping``), or when the initial peer cannot dial us back.

    Args:
        config: the node's config (initial peers, limits).
        identity: the identity the node ran under (its file is named in the message).
        error: the text of the exception the DHT process raised.
        elapsed_s: seconds from start to failure.

    Returns:
        (cause, message): the message says what is wrong and what to do.
    """
    if _IDENTITY_TAKEN_RE.search(error):
        return "identity_in_use", (
            f"another live peer already uses the identity in {identity.path} (peer ID {identity.peer_id}), so the "
            "swarm refused this one. Each peer needs its own identity: give this one its own --identity-path (a "
            "missing file is created), or, if the other process is an earlier run of this peer, stop it first."
        )
    clock = _CLOCK_RE.search(error)
    if clock:
        limit_s, local, peer = (float(g) for g in clock.groups())
        offset_s = local - peer
        return "clock_skew", (
            f"your clock is {abs(offset_s):.1f} s {'ahead of' if offset_s > 0 else 'behind'} the initial peer's, "
            f"and peers refuse a node whose clock is more than {limit_s:g} s off. Enable time synchronisation (NTP), "
            "e.g. `sudo timedatectl set-ntp true` on Linux or 'Set time automatically' on Windows/macOS, then retry."
        )
    if not config.initial_peers:
        return "start_failed", f"could not start the DHT node after {elapsed_s:.1f}s: {error}{machine_load_note()}"
    tried = "\n  ".join(config.initial_peers)
    if _NOT_DIALABLE_RE.search(error):
        return "not_dialable", (
            "the initial peer answered but could not connect back to this node.\n"
            f"Tried:\n  {tried}\n"
            "If you are behind NAT without port forwarding, add --client-mode; otherwise forward/open the TCP port of "
            "--host-maddrs and set --announce-maddrs to the public address others should dial."
        )
    cause = error.strip().splitlines()[-1] if error.strip() else "no error text"
    return "unreachable", (
        f"could not reach any initial peer within {elapsed_s:.1f}s (limit {config.startup_timeout_s:.0f}s).\n"
        f"Tried:\n  {tried}\n"
        f"Cause: {cause}{machine_load_note()}\n"
        "Check that: the address is copied exactly from the coordinator's output (host, port and /p2p/ peer ID); "
        "the coordinator is running; its TCP port is open to you (firewall, NAT port forwarding); "
        "and that you can reach the host (e.g. `nc -vz HOST PORT`)."
    )


def machine_load_note() -> str:
    """A sentence on how busy this machine is, for start-up failures that may be slowness rather than the network:
    the 1-minute load average against the CPU count, and how many p2pd daemons run (each node starts one; a pile of
    them is a leak). Empty if neither can be read."""
    try:
        import psutil

        load, cores = os.getloadavg()[0], os.cpu_count() or 1
        daemons = sum(1 for p in psutil.process_iter(["name"]) if (p.info.get("name") or "").startswith("p2pd"))
    except Exception:  # noqa: BLE001 - a note, never a second failure
        return ""
    busy = " (busier than its CPUs: start-up is slow, give it a larger --bootstrap-timeout)" if load > cores else ""
    return f" [machine: 1-min load {load:.1f} on {cores} CPU(s){busy}; {daemons} p2pd daemon(s) running]"


def clock_skew_problem(offset_s: float | None, bounds: RecordBounds) -> str | None:
    """What to tell the user when our clock is off by ``offset_s`` seconds (``PeerNode.clock_offset_s``), or None.

    Other peers refuse our records once our timestamps are more than ``bounds.max_clock_skew_s`` ahead of their
    clocks, and count us as gone when they look older than the record TTL; half the allowance is the warning line.
    """
    if offset_s is None or abs(offset_s) <= bounds.max_clock_skew_s / 2:
        return None
    return (
        f"your clock is {abs(offset_s):.1f} s {'ahead of' if offset_s > 0 else 'behind'} the other peers': "
        f"they refuse records more than {bounds.max_clock_skew_s:g} s ahead and drop peers that look stale. "
        "Enable time synchronisation (NTP), e.g. `sudo timedatectl set-ntp true` on Linux."
    )


async def _add_validator(_dht, node, validator) -> None:
    """Runs in the DHT process: chain ``validator`` with the node's others (a ``RecordGuard`` merges into ours), and
    drop the records this node already holds (stored or cached) that it refuses: hivemind checks a record only when
    it is stored or fetched, so a non-member's record taken before the run's policy was known would otherwise be read
    from local storage until it expires (chaos scenario uninvited-peer: a joiner's view counted the non-member)."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.dht.validation import DHTRecord

    node.protocol.record_validator.extend([validator])
    serializer = node.protocol.serializer
    for storage in (node.protocol.storage, node.protocol.cache):
        for key, (value, expiration) in list(storage.items()):
            key_bytes = DHTID.to_bytes(key)
            if not isinstance(value, DictionaryDHTValue):
                if not validator.validate(DHTRecord(key_bytes, node.protocol.IS_REGULAR_VALUE, value, expiration)):
                    del storage[key]
                continue
            for subkey, (item, item_expiration) in list(value.items()):
                if not validator.validate(DHTRecord(key_bytes, serializer.dumps(subkey), item, item_expiration)):
                    del value[subkey]


async def _probe_clock(_dht, node, max_peers: int, timeout_s: float) -> list[float]:
    """Runs in the DHT process: (our time at the middle of each ping) - (the neighbour's DHT time in its answer)."""
    import asyncio

    from hivemind.proto import dht_pb2
    from hivemind.utils import get_dht_time

    neighbours = node.protocol.routing_table.get_nearest_neighbors(node.node_id, k=max_peers, exclude=node.node_id)

    async def ping(peer_id) -> float | None:
        started = get_dht_time()
        response = await node.protocol.get_stub(peer_id).rpc_ping(dht_pb2.PingRequest(), timeout=timeout_s)
        ended = get_dht_time()
        return (started + ended) / 2 - response.dht_time if response.dht_time else None

    tasks = [asyncio.create_task(ping(peer_id)) for _, peer_id in neighbours]
    if not tasks:
        return []
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    return [t.result() for t in done if t.exception() is None and t.result() is not None]
