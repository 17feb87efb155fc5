"""Persistent peer identity: one RSA key that is both the libp2p identity and the DHT record signer.

hivemind's p2pd reads its libp2p private key from ``identity_path`` (a protobuf-wrapped DER RSA key), and the peer ID
is derived from the public key. hivetrain signs its DHT records (peer records, the run config) with the same key,
so anyone who knows a peer's ID (e.g. from the coordinator's multiaddr ``.../p2p/12D3...``) can check that a record was
signed by that peer.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey


@dataclass(frozen=True)
class Identity:
    """A peer's key pair.

    Attributes:
        path: the identity file p2pd reads (mode 0400).
        private_key: the RSA key (signs DHT records).
        peer_id: base58 libp2p peer ID derived from the public key.
    """

    path: Path
    private_key: RSAPrivateKey
    peer_id: str

    @property
    def owner_marker(self) -> bytes:
        """The ``[owner:ssh-rsa ...]`` DHT subkey that makes a record signed by this identity (hivemind's format)."""
        return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", self.private_key.get_public_key().to_bytes())


def load_or_create_identity(path: str | Path | None) -> Identity:
    """Load the identity at ``path``, creating it (and its directory) first if missing.

    ``None`` creates a throwaway identity in a temporary directory (a new peer ID every run).

    Raises:
        ValueError: the file exists but is not a libp2p RSA private key.
    """
    if path is None:
        path = Path(tempfile.mkdtemp(prefix="hivetrain-id-")) / "identity.key"
    path = Path(path).expanduser()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    data = path.read_bytes()
    try:
        proto = crypto_pb2.PrivateKey.FromString(data)
        if proto.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError(f"key type {proto.key_type} is not RSA")
        private_key = RSAPrivateKey.__new__(RSAPrivateKey)
        private_key.__setstate__({"_private_key": proto.data})  # DER, as hivemind pickles it
        peer_id = PeerID.from_identity(data).to_base58()
    except Exception as exc:  # noqa: BLE001 - any parse failure means the same thing to the user
        raise ValueError(f"{path} is not a valid identity file ({exc}); delete it to create a new identity") from None
    if os.name == "posix" and path.stat().st_mode & 0o077:
        path.chmod(0o400)
    return Identity(path=path, private_key=private_key, peer_id=peer_id)


def peer_id_of_owner(owner_marker: bytes) -> str:
    """The base58 libp2p peer ID of the RSA key in an ``[owner:ssh-rsa ...]`` marker.

    Raises:
        ValueError: the marker does not hold an RSA public key.
    """
    keys = RSASignatureValidator._PUBLIC_KEY_RE.findall(owner_marker)
    if len(keys) != 1:
        raise ValueError("not an owner marker")
    public_key = RSAPublicKey.from_bytes(keys[0])._public_key
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def peer_id_of_public_key(key: bytes) -> str:
    """The base58 libp2p peer ID of an RSA public key in OpenSSH form (``RSAPublicKey.to_bytes()``).

    Raises:
        ValueError: ``key`` is not an RSA public key.
    """
    return peer_id_of_owner(RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", key))
