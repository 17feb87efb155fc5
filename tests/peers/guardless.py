"""A plain hivemind node with the signature validator only: how an attacker (or an outsider of an invite-only run)
runs one, with none of hivetrain's record guard."""

import hivemind
from hivemind.dht.crypto import RSASignatureValidator

from hivetrain.peers.identity import load_or_create_identity


def guardless_node(key_path, initial_peers):
    """Start it on 127.0.0.1 with the identity at ``key_path`` (created if missing). Returns (dht, identity); the
    caller shuts the DHT down."""
    identity = load_or_create_identity(key_path)
    dht = hivemind.DHT(
        initial_peers=initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        identity_path=str(identity.path),
        record_validators=[RSASignatureValidator(identity.private_key)],
        startup_timeout=30,
        start=True,
    )
    return dht, identity
