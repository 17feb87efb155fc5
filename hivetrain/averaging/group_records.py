"""The signed records of matchmaking: a peer's ``ReadyEntry`` and a leader's ``GroupDeclaration``.

Both are pydantic models (validated on read; nothing is unpickled) and carry RSA signatures over domain-separated
msgpack bytes bound to the averager's prefix, so they can travel through the DHT or directly between data ports and
still be checked offline: an entry by its own peer, a declaration by its leader and every embedded entry by its
member. ``matchmaking`` decides with them; ``dataplane`` carries them.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable, Iterable
from typing import Literal

import msgpack
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from pydantic import BaseModel, ConfigDict, Field

from hivetrain.peers.identity import peer_id_of_owner

_DOMAIN = b"hivetrain.averaging.ready.v1"
_DECL_DOMAIN = b"hivetrain.averaging.group.v1"
MAX_MEMBERS = 4096
DECLARATION_FANOUT = 8  # a member pushes a declaration it receives to at most this many others (``relay_targets``)


class ReadyEntry(BaseModel):
    """A peer ready to average in one round key. Units: seconds of DHT (unix) time."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    peer_id: str = Field(min_length=1, max_length=128)
    round_key: str = Field(min_length=1, max_length=128)
    session: bytes = Field(min_length=16, max_length=16)
    host: str = Field(min_length=1, max_length=255)
    port: int = Field(ge=1, le=65535)
    kx_public: bytes = Field(min_length=32, max_length=32, description="X25519 public key for this session")
    announced_at: float = Field(ge=0.0)
    deadline: float = Field(ge=0.0, description="the peer stops waiting for a group at this time")
    window_closes_at: float = Field(
        default=0.0, ge=0.0, description="its group's matchmaking window closes at this time; 0 = at ``deadline``"
    )
    public_key: bytes = Field(min_length=16, max_length=2048, description="RSA public key (hivemind ssh format)")
    upload_mbps: float | None = Field(
        default=None, ge=0.0, le=1e6, description="the peer's upload rate, Mbit/s (declared or measured); None unknown"
    )
    signature: bytes = Field(default=b"", max_length=1024)

    @property
    def closes_at(self) -> float:
        """When the window this entry opens (or joins) closes: ``window_closes_at``, or ``deadline`` if unset.

        A peer may wait for a group past its window (``deadline``, the call's end) while an expected peer it needs is
        missing (``matchmaking.decide``); others must not take its entry for stale meanwhile."""
        return self.window_closes_at or self.deadline


def signed_bytes(prefix: str, entry: ReadyEntry) -> bytes:
    """The bytes an entry's ``signature`` covers: every field but the signature, bound to ``prefix``."""
    fields = entry.model_dump(exclude={"signature"})
    return _DOMAIN + msgpack.packb([prefix, *(fields[k] for k in sorted(fields))], use_bin_type=True)


def sign_entry(prefix: str, entry: ReadyEntry, private_key: RSAPrivateKey) -> ReadyEntry:
    """``entry`` with ``signature`` set by ``private_key`` (whose public key must be ``entry.public_key``)."""
    return entry.model_copy(update={"signature": private_key.sign(signed_bytes(prefix, entry))})


def verify_entry(prefix: str, entry: ReadyEntry) -> bool:
    """Whether ``entry`` is signed by the key of ``entry.peer_id`` (never raises)."""
    try:
        marker = RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", entry.public_key)
        if peer_id_of_owner(marker) != entry.peer_id:
            return False
        return RSAPublicKey.from_bytes(entry.public_key).verify(signed_bytes(prefix, entry), entry.signature)
    except Exception:  # noqa: BLE001 - any parse failure means "not verified"
        return False


class GroupDeclaration(BaseModel):
    """The leader's word on who averages together. ``members`` are sorted by peer id; units: DHT seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    leader: str = Field(min_length=1, max_length=128)
    round_key: str = Field(min_length=1, max_length=128)
    round_id: str = Field(min_length=1, max_length=64)
    members: tuple[ReadyEntry, ...] = Field(min_length=1, max_length=MAX_MEMBERS)
    declared_at: float = Field(ge=0.0)
    reason: Literal["full", "window"]
    signature: bytes = Field(default=b"", max_length=1024, description="the leader's RSA signature")

    def member_ids(self) -> tuple[str, ...]:
        return tuple(m.peer_id for m in self.members)

    def includes(self, entry: ReadyEntry) -> bool:
        return any(m.peer_id == entry.peer_id and m.session == entry.session for m in self.members)


def _declaration_bytes(prefix: str, decl: GroupDeclaration) -> bytes:
    fields = decl.model_dump(exclude={"signature"})
    return _DECL_DOMAIN + msgpack.packb([prefix, *(fields[k] for k in sorted(fields))], use_bin_type=True)


def sign_declaration(prefix: str, decl: GroupDeclaration, private_key: RSAPrivateKey) -> GroupDeclaration:
    """``decl`` signed by its leader (so it can travel outside the DHT, e.g. pushed over the data plane)."""
    return decl.model_copy(update={"signature": private_key.sign(_declaration_bytes(prefix, decl))})


def verify_declaration(
    prefix: str, decl: GroupDeclaration, verify_member: Callable[[str, ReadyEntry], bool] = verify_entry
) -> bool:
    """Whether ``decl`` is well formed and signed by its leader, and every member entry by its member (checked with
    ``verify_member(prefix, entry)``, e.g. a cached ``verify_entry``)."""
    ids = decl.member_ids()
    leader = [m for m in decl.members if m.peer_id == decl.leader]
    if list(ids) != sorted(set(ids)) or len(leader) != 1 or ids[0] != decl.leader:
        return False
    if decl.round_id != make_round_id(prefix, decl.round_key, decl.members):
        return False
    if not all(m.round_key == decl.round_key and verify_member(prefix, m) for m in decl.members):
        return False
    try:
        key = RSAPublicKey.from_bytes(leader[0].public_key)
        return bool(key.verify(_declaration_bytes(prefix, decl), decl.signature))
    except Exception:  # noqa: BLE001 - any parse failure means "not verified"
        return False


def named_peers(record: ReadyEntry | GroupDeclaration) -> list[str]:
    """Every peer id ``record`` names: an entry's peer; a declaration's leader and members."""
    if isinstance(record, ReadyEntry):
        return [record.peer_id]
    return [record.leader, *(m.peer_id for m in record.members)]


def make_round_id(prefix: str, round_key: str, members: Iterable[ReadyEntry]) -> str:
    """Deterministic id of a group: sha256 over the prefix, round key and the members' (peer id, session)."""
    h = hashlib.sha256(f"{prefix}|{round_key}".encode())
    for m in sorted(members, key=lambda e: e.peer_id):
        h.update(m.peer_id.encode() + b"|" + m.session)
    return h.hexdigest()[:32]


def relay_targets(decl: GroupDeclaration, peer_id: str, fanout: int = DECLARATION_FANOUT) -> tuple[ReadyEntry, ...]:
    """The members ``peer_id`` pushes ``decl`` to: its children in the ``fanout``-ary tree over ``decl``'s sorted
    members, rooted at the leader (member i pushes to members i·fanout + 1 .. i·fanout + fanout); () when
    ``peer_id`` is not a member or a leaf. Raises ValueError if ``fanout`` < 1.

    Every member but the leader has exactly one parent, so a declaration of n members reaches all of them in
    ceil(log_fanout(n)) hops while no member uploads it more than ``fanout`` times: pushing it to every member from
    the leader cost the leader (n - 1) x its size, O(n^2) bytes (~900 MB at 1,000 members of ~0.9 KB each). A member
    whose parent is gone (or lies and withholds it) reads the declaration from the DHT, as after any lost push."""
    if fanout < 1:
        raise ValueError(f"fanout must be >= 1, got {fanout}")
    ids = decl.member_ids()  # sorted (``verify_declaration``)
    i = bisect.bisect_left(ids, peer_id)
    if i == len(ids) or ids[i] != peer_id:
        return ()
    return decl.members[i * fanout + 1 : i * fanout + fanout + 1]
