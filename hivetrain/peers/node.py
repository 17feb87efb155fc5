"""Start a peer's DHT node: persistent identity, listen/announce addresses, bootstrap with a bounded wait.

The DHT (hivemind, libp2p via the p2pd daemon shipped in hivemind's wheel) runs in a child process. Records signed by
the peer's identity are validated by every node (``RSASignatureValidator`` with the identity's key).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from hivetrain.peers.identity import Identity, load_or_create_identity

logger = logging.getLogger(__name__)


class BootstrapFailed(RuntimeError):
    """No initial peer could be reached; the message names the addresses tried and what to check."""


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
    """

    initial_peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    identity_path: str | None = None
    startup_timeout_s: float = 30.0
    client_mode: bool = False
    use_relay: bool = True
    extra_validators: tuple = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")
        for kind, addrs in (
            ("initial peer", self.initial_peers),
            ("listen address", self.host_maddrs),
            ("announce address", self.announce_maddrs),
        ):
            for addr in addrs:
                try:
                    Multiaddr(addr)
                except Exception as exc:  # noqa: BLE001 - multiaddr raises several types
                    raise ValueError(
                        f"{kind} {addr!r} is not a valid multiaddr ({exc}); expected e.g. "
                        "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW..."
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

    def shutdown(self) -> None:
        """Stop the DHT process and its p2pd daemon; idempotent."""
        if self.dht.is_alive():
            self.dht.shutdown()


def trusted_ids(initial_peers: tuple[str, ...]) -> set[str]:
    """Peer IDs named in bootstrap multiaddrs (the peers whose signed run config we accept)."""
    ids = set()
    for addr in initial_peers:
        ids.add(str(PeerID.from_base58(Multiaddr(addr).value_for_protocol("p2p"))))
    return ids


def start_node(config: NodeConfig) -> PeerNode:
    """Start the DHT, bootstrapping from ``config.initial_peers`` within ``config.startup_timeout_s``.

    Raises:
        BootstrapFailed: none of the initial peers could be reached in time (no DHT process is left behind).
        ValueError: the identity file is invalid.
    """
    identity = load_or_create_identity(config.identity_path)
    validators = [RSASignatureValidator(identity.private_key), *config.extra_validators]
    started = time.monotonic()
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
    try:
        dht.wait_until_ready(timeout=config.startup_timeout_s)
    except BaseException as exc:
        if dht.is_alive():
            dht.shutdown()
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise BootstrapFailed(_bootstrap_message(config, exc, time.monotonic() - started)) from None
    logger.info("DHT node %s up in %.1fs", identity.peer_id, time.monotonic() - started)
    return PeerNode(dht=dht, identity=identity, config=config)


def _bootstrap_message(config: NodeConfig, exc: BaseException, elapsed_s: float) -> str:
    if not config.initial_peers:
        return f"could not start the DHT node after {elapsed_s:.1f}s: {exc}"
    tried = "\n  ".join(config.initial_peers)
    cause = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    return (
        f"could not reach any initial peer within {elapsed_s:.1f}s (limit {config.startup_timeout_s:.0f}s).\n"
        f"Tried:\n  {tried}\n"
        f"Cause: {cause}\n"
        "Check that: the address is copied exactly from the coordinator's output (host, port and /p2p/ peer ID); "
        "the coordinator is running; its TCP port is open to you (firewall, NAT port forwarding); "
        "and that you can reach the host (e.g. `nc -vz HOST PORT`)."
    )
