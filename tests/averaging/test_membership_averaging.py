"""Averaging in an invite-only run (issue 12 item 6): the matchmaker ignores a non-member's ready entry and any
declaration that names one, and the data-plane server (real, on 127.0.0.1) refuses a round member's HELLO when the
peer is not a member of the run, while a member of the same round gets in."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hivemind.utils.crypto import RSAPrivateKey

from hivetrain.averaging.group_records import GroupDeclaration, ReadyEntry, make_round_id, sign_declaration, sign_entry
from hivetrain.averaging.handshake import RoundKeys, dial
from hivetrain.averaging.matchmaker import Matchmaker
from hivetrain.averaging.wire import LinkClosed
from hivetrain.peers.identity import peer_id_of_public_key
from tests.records import ready_entry

PREFIX = "r.f.avg"
TIMEOUTS = dict(connect_timeout_s=1.0, part_timeout_s=1.0, buffer_num_bytes=0)


def _peer():
    key = RSAPrivateKey()
    return SimpleNamespace(key=key, peer_id=peer_id_of_public_key(key.get_public_key().to_bytes()))


def _entry(peer) -> ReadyEntry:
    return sign_entry(PREFIX, ready_entry(peer.key, peer.peer_id, time.time(), round_key="e1"), peer.key)


def _declaration(*members) -> GroupDeclaration:
    """Signed by its leader, the member with the smallest peer ID (as ``verify_declaration`` requires)."""
    leader = min(members, key=lambda p: p.peer_id)
    entries = [_entry(p) for p in members]
    decl = GroupDeclaration(
        leader=leader.peer_id,
        round_key="e1",
        round_id=make_round_id(PREFIX, "e1", entries),
        members=tuple(sorted(entries, key=lambda e: e.peer_id)),
        declared_at=time.time(),
        reason="window",
    )
    return sign_declaration(PREFIX, decl, leader.key)


@pytest.fixture(scope="module")
def peers():
    return _peer(), _peer(), _peer()


def test_the_matchmaker_ignores_records_naming_a_non_member(peers):
    member, other_member, outsider = peers
    members = {member.peer_id, other_member.peer_id}
    matchmaker = Matchmaker(
        SimpleNamespace(), PREFIX, poll_interval_s=0.1, declare_grace_s=0.5, admits=lambda p: p in members
    )
    assert matchmaker.offer_entry(_entry(member).model_dump())
    assert not matchmaker.offer_entry(_entry(outsider).model_dump())
    assert matchmaker.offer(_declaration(member, other_member).model_dump())
    assert not matchmaker.offer(_declaration(member, outsider).model_dump())
    entries, decls = matchmaker._merge("e1", [])
    assert {e.peer_id for e in entries} == {member.peer_id}
    assert all(outsider.peer_id not in d.member_ids() for d in decls) and len(decls) == 1
    # the same records pass when the run is open
    open_run = Matchmaker(SimpleNamespace(), PREFIX, poll_interval_s=0.1, declare_grace_s=0.5)
    assert open_run.offer_entry(_entry(outsider).model_dump())


def _public(secret: X25519PrivateKey) -> bytes:
    return secret.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def test_the_data_plane_refuses_a_non_member_and_admits_a_member(servers):
    server = servers(admits=lambda peer_id: peer_id != "OUTSIDER")
    ours, member, outsider = (X25519PrivateKey.generate() for _ in range(3))
    attached = []
    peers = {"MEMBER": _public(member), "OUTSIDER": _public(outsider)}
    server.register(RoundKeys("round-m", "US", ours, peers, attached.append))
    with pytest.raises(LinkClosed):
        dial("127.0.0.1", server.port, RoundKeys("round-m", "OUTSIDER", outsider, {"US": _public(ours)}, None), "US",
             **TIMEOUTS, join_wait_s=0.3)  # fmt: skip
    assert server.refused["not a member"] >= 1 and not attached
    link = dial("127.0.0.1", server.port, RoundKeys("round-m", "MEMBER", member, {"US": _public(ours)}, None), "US",
                **TIMEOUTS)  # fmt: skip
    deadline = time.monotonic() + 3.0
    while not attached and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [link_.peer_id for link_ in attached] == ["MEMBER"]
    link.close()
    attached[0].close()
