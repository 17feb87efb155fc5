"""A group declaration travels down a relay tree of bounded fan-out (``group_records.relay_targets``): the leader no
longer uploads it once per member, every member still gets it, and a member whose parent is gone gets it from the
DHT and passes it on."""

from __future__ import annotations

import functools
import os
import threading
from collections import Counter

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from hivetrain.averaging import record_book
from hivetrain.averaging.group_records import DECLARATION_FANOUT, relay_targets
from hivetrain.averaging.matchmaker import Matchmaker

from .test_matchmaking import GRACE, PREFIX, TTL, FakeDHT, FakeNode, declaration, entry, signing_keys


def test_every_member_has_one_parent_and_nobody_pushes_to_more_than_the_fanout() -> None:
    members = [entry(f"P{i:04d}") for i in range(1000)]
    decl = declaration(members, 100.0)
    reached: Counter[str] = Counter()
    for m in decl.members:
        targets = relay_targets(decl, m.peer_id)
        assert len(targets) <= DECLARATION_FANOUT
        reached.update(t.peer_id for t in targets)
    assert set(reached) == set(decl.member_ids()) - {decl.leader}  # the leader has it; everyone else is reached ...
    assert set(reached.values()) == {1}  # ... exactly once
    depth, level = 0, [decl.leader]  # hops from the leader to the last member: 1 + 8 + 64 + 512 < 1,000 <= 4,681
    while level:
        level = [t.peer_id for p in level for t in relay_targets(decl, p)]
        depth += bool(level)
    assert depth == 4
    assert relay_targets(decl, "P9999") == () and relay_targets(decl, "P0001", fanout=1)[0].peer_id == "P0002"
    with pytest.raises(ValueError, match="fanout"):
        relay_targets(decl, "P0001", fanout=0)


@pytest.fixture(scope="module")
def seven_keys() -> list[tuple[str, RSAPrivateKey]]:
    return signing_keys(7)


def _members(seven_keys, dht: FakeDHT, dead: frozenset[int] = frozenset()):
    """Seven matchmakers (sorted ids) whose declaration pushes reach the others' ``offer`` on threads, except those
    addressed to the members numbered in ``dead``. Returns them, their signed entries at "e3", the pushes made as
    (sender index, receiver index), and ``settle()``, which returns once every push delivered so far (and every push
    it caused) has been handled."""
    by_id: dict[str, int] = {pid: i for i, (pid, _) in enumerate(seven_keys)}
    mms: list[Matchmaker] = []
    pushes: list[tuple[int, int]] = []
    deliveries: list[threading.Thread] = []
    lock = threading.Lock()

    def push_from(sender: int):
        def push(kind: str, raw: dict, targets) -> None:
            assert kind == "group"
            for t in targets:
                deliver = threading.Thread(target=mms[by_id[t.peer_id]].offer, args=(raw,), daemon=True)
                with lock:
                    pushes.append((sender, by_id[t.peer_id]))
                    if by_id[t.peer_id] not in dead:
                        deliveries.append(deliver)
                        deliver.start()

        return push

    def settle() -> None:
        while True:
            with lock:
                running = [t for t in deliveries if t.is_alive()]
            if not running:
                return
            for t in running:
                t.join(10.0)
                assert not t.is_alive(), "a pushed declaration was not handled within 10 s"

    for i, (pid, key) in enumerate(seven_keys):
        node = FakeNode(pid, key, dht)
        mms.append(Matchmaker(node, PREFIX, poll_interval_s=0.05, declare_grace_s=GRACE, push=push_from(i)))
    entries = tuple(mm.make_entry("e3", os.urandom(16), "127.0.0.1", 4000 + i, bytes(32), 5.0)
                    for i, mm in enumerate(mms))  # fmt: skip
    return mms, entries, pushes, settle


def _holders(mms: list[Matchmaker]) -> set[int]:
    """Indices of the matchmakers that know a declaration of "e3"."""
    return {i for i, mm in enumerate(mms) if mm._merge("e3", [])[1]}


def test_a_declaration_reaches_every_member_down_the_tree_and_each_push_happens_once(seven_keys, monkeypatch) -> None:
    """Fan-out 2 over 7 members: the leader pushes to members 1 and 2 only, they to 3-4 and 5-6."""
    monkeypatch.setattr(record_book, "relay_targets", functools.partial(relay_targets, fanout=2))
    mms, entries, pushes, settle = _members(seven_keys, FakeDHT())
    decl = mms[0].declare(entries[0], entries, "full", TTL)
    settle()
    assert _holders(mms) == set(range(7))
    assert all(mm._merge("e3", [])[1] == [decl] for mm in mms)
    assert sorted(pushes) == [(0, 1), (0, 2), (1, 3), (1, 4), (2, 5), (2, 6)]
    mms[3].offer(decl.model_dump())  # the same declaration again (a retry of its parent, or the DHT): not pushed again
    settle()
    assert len(pushes) == 6


def test_the_child_of_a_dead_member_reads_the_declaration_from_the_dht_and_passes_it_on(
    seven_keys, monkeypatch
) -> None:
    """Fan-out 1: a chain 0 -> 1 -> ... -> 6. Member 1 is gone, so nobody past it hears the push; member 2's next
    DHT poll finds the declaration, and it goes on down the chain from there."""
    monkeypatch.setattr(record_book, "relay_targets", functools.partial(relay_targets, fanout=1))
    mms, entries, pushes, settle = _members(seven_keys, FakeDHT(), dead=frozenset({1}))
    mms[0].declare(entries[0], entries, "full", TTL)
    settle()
    assert _holders(mms) == {0} and pushes == [(0, 1)]
    _, found = mms[2].read("e3")  # member 2's next DHT poll
    assert len(found) == 1 and found[0].includes(entries[2])
    settle()
    assert _holders(mms) == {0, 2, 3, 4, 5, 6}
    assert sorted(pushes) == [(0, 1), (2, 3), (3, 4), (4, 5), (5, 6)]


def test_a_declaration_that_does_not_list_us_is_not_passed_on(seven_keys) -> None:
    mms, entries, pushes, settle = _members(seven_keys, FakeDHT())
    outsider = mms[6]
    decl = mms[0].declare(entries[0], entries[:6], "full", TTL)  # a group of the first six
    settle()
    assert _holders(mms) == set(range(6))
    assert outsider.offer(decl.model_dump())  # valid and signed: kept (it tells us a group formed without us) ...
    settle()
    assert all(sender != 6 for sender, _ in pushes)  # ... but pushed nowhere
    assert sorted(pushes) == [(0, i) for i in range(1, 6)]  # fan-out 8: the leader reaches five members directly
