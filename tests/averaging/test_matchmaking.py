"""Matchmaking decisions (pure, no DHT, no sleeps) and the signatures that let entries and declarations be checked
offline."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import ValueWithExpiration
from hivemind.utils.crypto import RSAPrivateKey

from hivetrain.averaging.matchmaking import (
    GroupDeclaration,
    Matchmaker,
    ReadyEntry,
    decide,
    make_round_id,
    sign_declaration,
    sign_entry,
    verify_declaration,
    verify_entry,
)
from hivetrain.peers.identity import peer_id_of_owner

from .conftest import run_threads

PREFIX = "run.avg"
GRACE = 1.0


def entry(peer: str, session: int = 1, at: float = 100.0, wait_s: float = 5.0, key: str = "e0") -> ReadyEntry:
    return ReadyEntry(peer_id=peer, round_key=key, session=bytes([session]) * 16, host="127.0.0.1", port=4000,
                      kx_public=bytes(32), announced_at=at, deadline=at + wait_s, public_key=b"k" * 16)  # fmt: skip


def declaration(members: list[ReadyEntry], at: float, reason: str = "window") -> GroupDeclaration:
    members = sorted(members, key=lambda m: m.peer_id)
    key = members[0].round_key
    return GroupDeclaration(leader=members[0].peer_id, round_key=key, declared_at=at, reason=reason,
                            round_id=make_round_id(PREFIX, key, members), members=tuple(members))  # fmt: skip


def run(me, entries=(), decls=(), now=101.0, target=8, min_size=1, banned=frozenset()):
    return decide(me, entries, decls, now, target_group_size=target, min_group_size=min_size,
                  declare_grace_s=GRACE, banned=banned)  # fmt: skip


def test_a_lone_peer_waits_for_the_window_then_declares_itself() -> None:
    me = entry("A")
    assert run(me, now=102.0).action == "wait"
    d = run(me, now=105.0)
    assert d.action == "declare" and [m.peer_id for m in d.members] == ["A"]


def test_the_smallest_id_leads_and_the_window_is_the_first_peers_deadline() -> None:
    a, b, c = entry("A", at=101.0), entry("B", at=100.0), entry("C", at=102.0)
    assert run(a, [a, b, c], now=104.9).action == "wait"
    d = run(a, [a, b, c], now=105.0)  # B's deadline (100 + 5) closes the window
    assert d.action == "declare" and [m.peer_id for m in d.members] == ["A", "B", "C"]
    assert run(b, [a, b, c], now=105.0).action == "wait"  # B follows A


def test_a_full_group_is_declared_at_once() -> None:
    entries = [entry(p) for p in "ABCDE"]
    d = run(entries[0], entries, now=100.1, target=4)
    assert d.action == "declare" and [m.peer_id for m in d.members] == ["A", "B", "C", "D"]
    assert "full" in d.reason
    assert run(entries[4], entries, now=100.1, target=4).action == "wait"  # E forms the next group


def test_followers_join_the_declaration_that_lists_their_session_smallest_leader_first() -> None:
    a, b, c = entry("A"), entry("B"), entry("C")
    by_b, by_a = declaration([b, c], 105.0), declaration([a, b, c], 105.1)
    d = run(c, [a, b, c], [by_b, by_a], now=105.2)
    assert d.action == "joined" and d.declaration == by_a


def test_a_retry_ignores_the_failed_rounds_declaration_and_its_dead_member() -> None:
    old_a, old_b, dead = entry("A", 1), entry("B", 1), entry("D", 1)
    failed = declaration([old_a, old_b, dead], 105.0)
    a, b = entry("A", 2, at=107.0), entry("B", 2, at=107.0)
    entries = [a, b, dead]  # D's old entry is still in the DHT
    assert run(a, entries, [failed], now=108.0).action == "wait"
    d = run(a, entries, [failed], now=112.0)
    assert d.action == "declare" and [m.peer_id for m in d.members] == ["A", "B"]


def test_a_peer_arriving_after_a_group_closed_its_window_is_late_but_not_after_a_lone_peer() -> None:
    a, b = entry("A"), entry("B")
    closed = declaration([a, b], 105.0)
    d = run(entry("C", at=106.0), [a, b], [closed], now=106.0)
    assert d.action == "late"
    alone = declaration([a], 105.0)  # A's caller may refuse to commit alone and retry with us
    assert run(entry("C", at=106.0), [a], [alone], now=106.0).action == "wait"


def test_a_peer_its_leader_did_not_see_fails_fast_and_a_silent_leader_after_the_grace() -> None:
    a, b, c = entry("A"), entry("B"), entry("C", at=104.9)
    without_c = declaration([a, b], 105.0)
    assert run(c, [a, b, c], [without_c], now=105.1).action == "not_in_group"
    c = entry("C")
    assert run(c, [a, c], [], now=105.5).action == "wait"
    assert run(c, [a, c], [], now=106.0).action == "no_group"  # the leader said nothing
    assert run(c, [a, c], [], now=106.1).action == "declare"  # its entry went stale: the next peer leads


def test_banned_stale_and_other_round_entries_are_not_candidates() -> None:
    me = entry("B")
    banned, stale, other = entry("A"), entry("0", at=90.0), entry("1", key="e1")
    d = run(me, [banned, stale, other, me], now=105.0, banned=frozenset({"A"}))
    assert d.action == "declare" and [m.peer_id for m in d.members] == ["B"]


def test_below_min_group_size_the_leader_declares_nothing() -> None:
    a, b = entry("A"), entry("B")
    assert run(a, [a, b], now=105.0, min_size=3).action == "too_small"


@pytest.fixture(scope="module")
def keys() -> list[tuple[str, RSAPrivateKey]]:
    out = []
    for _ in range(3):
        key = RSAPrivateKey()
        marker = RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", key.get_public_key().to_bytes())
        out.append((peer_id_of_owner(marker), key))
    return sorted(out, key=lambda pk: pk[0])


def signed(peer_id: str, key: RSAPrivateKey, port: int = 4000) -> ReadyEntry:
    raw = entry(peer_id).model_copy(update={"public_key": key.get_public_key().to_bytes(), "port": port})
    return sign_entry(PREFIX, raw, key)


def test_entries_verify_only_untampered_and_under_their_own_key(keys) -> None:
    (pid, key), (other_pid, other_key) = keys[0], keys[1]
    good = signed(pid, key)
    assert verify_entry(PREFIX, good)
    assert not verify_entry("other.avg", good)  # bound to the prefix
    assert not verify_entry(PREFIX, good.model_copy(update={"port": 4001}))
    assert not verify_entry(PREFIX, good.model_copy(update={"peer_id": other_pid}))  # speaks for someone else
    impostor = sign_entry(PREFIX, good.model_copy(update={"public_key": other_key.get_public_key().to_bytes()}), key)
    assert not verify_entry(PREFIX, impostor)


def test_declarations_verify_only_as_signed_by_the_smallest_member(keys) -> None:
    members = [signed(pid, key) for pid, key in keys]
    leader_key = keys[0][1]
    decl = sign_declaration(PREFIX, declaration(members, 105.0), leader_key)
    assert verify_declaration(PREFIX, decl)
    assert not verify_declaration(PREFIX, declaration(members, 105.0))  # unsigned
    assert not verify_declaration(PREFIX, sign_declaration(PREFIX, declaration(members, 105.0), keys[1][1]))
    moved = [members[0], members[1], members[2].model_copy(update={"port": 9999})]  # leader rewrites an endpoint
    assert not verify_declaration(PREFIX, sign_declaration(PREFIX, declaration(moved, 105.0), leader_key))
    not_smallest = declaration(members[1:], 105.0).model_copy(update={"leader": keys[2][0]})
    assert not verify_declaration(PREFIX, sign_declaration(PREFIX, not_smallest, keys[2][1]))


def test_a_waiting_decision_names_the_expected_leader() -> None:
    a, b = entry("A"), entry("B")
    assert run(b, [a, b], now=101.0).leader == a
    assert run(a, [a, b], now=101.0).leader == a
    assert run(b, [a, b], now=105.5).leader == a  # window closed, waiting for A's declaration


# ---- Matchmaker against an in-memory DHT that can stall -------------------------------------------------------------


class FakeDHT:
    """Stores and gets like hivemind.DHT with return_future=True; ``stalled`` makes every later call hang forever."""

    def __init__(self) -> None:
        self.data: dict = {}
        self.stalled = False
        self.hung: list[Future] = []
        self.stored: list[tuple[str, bytes]] = []  # (key, subkey) of every store call

    def _future(self, value) -> Future:
        f: Future = Future()
        if self.stalled:
            self.hung.append(f)
        else:
            f.set_result(value)
        return f

    def store(self, key, value, expiration_time, subkey, return_future):
        self.stored.append((key, subkey))
        if not self.stalled:
            self.data.setdefault(key, {})[subkey] = ValueWithExpiration(value, expiration_time)
        return self._future(True)

    def get(self, key, latest, return_future):
        found = self.data.get(key)
        return self._future(None if found is None else ValueWithExpiration(dict(found), 0.0))


class FakeNode:
    def __init__(self, peer_id: str, key: RSAPrivateKey, dht: FakeDHT):
        self.peer_id, self.dht = peer_id, dht
        self.identity = SimpleNamespace(private_key=key)
        self.owner_marker = RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", key.get_public_key().to_bytes())


def _matchmakers(keys, dht: FakeDHT) -> tuple[list[Matchmaker], list[str]]:
    """Two matchmakers whose pushes go straight to each other's ``offer``/``offer_entry`` (on threads)."""
    by_id: dict[str, Matchmaker] = {}
    pushes: list[str] = []

    def push(kind: str, raw: dict, targets) -> None:
        for t in targets:
            pushes.append(kind)
            receiver = by_id[t.peer_id]
            handler = receiver.offer_entry if kind == "ready" else receiver.offer
            threading.Thread(target=handler, args=(raw,), daemon=True).start()

    for pid, key in keys[:2]:
        by_id[pid] = Matchmaker(FakeNode(pid, key, dht), PREFIX, poll_interval_s=0.05, declare_grace_s=GRACE, push=push)
    return list(by_id.values()), pushes


def _match_both(mms: list[Matchmaker], round_key: str, timeout_s: float) -> list:
    def one(mm: Matchmaker):
        me = mm.make_entry(round_key, os.urandom(16), "127.0.0.1", 4000, bytes(32), 5.0)
        return mm.match(me, target_group_size=2, min_group_size=2, ttl_s=30.0,
                        deadline_monotonic=time.monotonic() + timeout_s)  # fmt: skip

    return run_threads([lambda m=m: one(m) for m in mms], timeout_s + 5.0)


def test_peers_that_averaged_before_match_through_their_data_ports_while_the_dht_stalls(keys) -> None:
    dht = FakeDHT()
    mms, pushes = _matchmakers(keys, dht)
    first = _match_both(mms, "e0", 5.0)  # through the DHT: they learn of each other
    assert [d.action for d, _ in first] == ["joined", "joined"], first
    dht.stalled = True
    del pushes[:]
    started = time.monotonic()
    second = _match_both(mms, "e1", 5.0)
    assert [d.action for d, _ in second] == ["joined", "joined"], second
    assert second[0][0].declaration == second[1][0].declaration and "(full)" in second[0][1]
    assert time.monotonic() - started < 2.0  # no DHT answer was needed (the window would have been 5 s)
    assert dht.hung and not any(f.done() for f in dht.hung)  # the DHT really was asked and never answered
    assert pushes == ["ready", "group"]  # the follower's entry went to its previous leader, the declaration back
    leader = mms[0].node.owner_marker
    stored = sorted(subkey for key, subkey in dht.stored if ".e1." in key)
    assert stored == [leader + b"|group", leader + b"|ready"]  # the follower, matched in time, used no DHT at all


def test_pushed_entries_are_kept_only_when_signed_by_their_peer(keys) -> None:
    (pid, key), (other_pid, _) = keys[0], keys[1]
    mm = Matchmaker(FakeNode(other_pid, keys[1][1], FakeDHT()), PREFIX, poll_interval_s=0.05, declare_grace_s=GRACE)
    good = signed(pid, key)
    assert not mm.offer_entry(good.model_copy(update={"port": 4001}).model_dump())  # tampered
    assert not mm.offer_entry({"peer_id": pid})  # malformed
    assert mm.offer_entry(good.model_dump())
    entries, _ = mm._merge("e0", [])
    assert entries == [good]


class ManualDHT(FakeDHT):
    """Each get answers only when the test says so, with what the DHT held when the get was made (a slow DHT)."""

    def __init__(self) -> None:
        super().__init__()
        self.gets: list[tuple[Future, object]] = []
        self.asked = threading.Condition()

    def get(self, key, latest, return_future):
        found = self.data.get(key)
        f: Future = Future()
        with self.asked:
            self.gets.append((f, None if found is None else ValueWithExpiration(dict(found), 0.0)))
            self.asked.notify_all()
        return f

    def answer_next(self, index: int, timeout_s: float = 5.0) -> None:
        with self.asked:
            assert self.asked.wait_for(lambda: len(self.gets) > index, timeout_s), f"get #{index} never came"
            future, snapshot = self.gets[index]
        future.set_result(snapshot)


def test_a_window_closes_on_a_dht_view_read_after_it_closed(keys) -> None:
    """A slow DHT answers a read made before the window closed, without a peer that announced in time: the leader
    must read again before declaring, or it would leave that peer out (a group of one and a stray peer)."""
    (leader_id, leader_key), (other_id, other_key) = keys[0], keys[1]
    dht = ManualDHT()
    mm = Matchmaker(FakeNode(leader_id, leader_key, dht), PREFIX, poll_interval_s=0.05, declare_grace_s=GRACE)
    me = mm.make_entry("e0", os.urandom(16), "127.0.0.1", 4000, bytes(32), 0.3)
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(mm.match(me, target_group_size=8, min_group_size=1,
                                                                     ttl_s=30.0, deadline_monotonic=time.monotonic()
                                                                     + 10.0)), daemon=True)  # fmt: skip
    thread.start()
    with dht.asked:
        assert dht.asked.wait_for(lambda: dht.gets, 5.0)  # the first read left while only we had announced
    other = sign_entry(PREFIX, entry(other_id, at=me.announced_at, wait_s=5.0).model_copy(
        update={"public_key": other_key.get_public_key().to_bytes()}), other_key)  # fmt: skip
    marker = RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", other_key.get_public_key().to_bytes())
    dht.data[f"{PREFIX}.e0.mm"][marker + b"|ready"] = ValueWithExpiration(other.model_dump(), time.time() + 60)
    while time.time() < me.deadline + 0.05:  # the window closes while the first read is still out
        time.sleep(0.01)
    dht.answer_next(0)  # ... and it comes back without the other peer
    dht.answer_next(1)  # the read made after the window closed sees it
    thread.join(10.0)
    decision, reason = outcome[0]
    assert decision.action == "joined", reason
    assert decision.declaration.member_ids() == (leader_id, other_id), reason
