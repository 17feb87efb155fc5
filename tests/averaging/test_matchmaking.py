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

from hivetrain.averaging.matchmaker import WITHDRAW_AFTER_S, Matchmaker
from hivetrain.averaging.matchmaking import (
    GroupDeclaration,
    ReadyEntry,
    decide,
    make_round_id,
    rival_groups,
    sign_declaration,
    sign_entry,
    verify_declaration,
    verify_entry,
)
from hivetrain.peers.identity import peer_id_of_owner

from .conftest import run_threads

PREFIX = "run.avg"
GRACE = 1.0
TTL = 30.0  # a declaration older than this is over (the round timeout)


def entry(peer: str, session: int = 1, at: float = 100.0, wait_s: float = 5.0, key: str = "e0") -> ReadyEntry:
    return ReadyEntry(peer_id=peer, round_key=key, session=bytes([session]) * 16, host="127.0.0.1", port=4000,
                      kx_public=bytes(32), announced_at=at, deadline=at + wait_s, public_key=b"k" * 16)  # fmt: skip


def declaration(members: list[ReadyEntry], at: float, reason: str = "window") -> GroupDeclaration:
    members = sorted(members, key=lambda m: m.peer_id)
    key = members[0].round_key
    return GroupDeclaration(leader=members[0].peer_id, round_key=key, declared_at=at, reason=reason,
                            round_id=make_round_id(PREFIX, key, members), members=tuple(members))  # fmt: skip


def run(me, entries=(), decls=(), now=101.0, target=8, min_size=1, banned=frozenset(), expected=frozenset(),
        patience_s=0.0, tolerant_rows=0):  # fmt: skip
    return decide(me, entries, decls, now, target_group_size=target, min_group_size=min_size,
                  declare_grace_s=GRACE, declaration_ttl_s=TTL, banned=banned, expected=expected,
                  patience_s=patience_s, tolerant_rows=tolerant_rows)  # fmt: skip


def ids(decision) -> list[str]:
    return [m.peer_id for m in decision.members]


def test_a_lone_peer_waits_for_the_window_then_declares_itself() -> None:
    me = entry("A")
    assert run(me, now=102.0).action == "wait"
    d = run(me, now=105.0)
    assert d.action == "declare" and [m.peer_id for m in d.members] == ["A"] and d.closed_by == "window"


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
    assert d.closed_by == "full"
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
    assert d.declaration is closed  # the epoch's round, whose result C follows (``decide_sync``'s closed_without_us)
    alone = declaration([a], 105.0)  # A's caller may refuse to commit alone and retry with us
    assert run(entry("C", at=106.0), [a], [alone], now=106.0).action == "wait"


def test_a_peer_in_a_group_of_one_is_still_expected_and_its_window_fails_nobody() -> None:
    """Chaos joiner-restart-2peer (xdist suite, 2026-11-29): two peers at one epoch declared groups of one in turn for
    200 s. Each saw the other's live solo declaration, counted it as accounted for, and closed its own group of one
    "complete"; each solo step was then refused (the other is a live trainer of the epoch). A group of one accounts
    for nobody, and its window, declared after we announced, is no reason to fail "not_in_group"."""
    a_old = entry("A", session=1, at=99.0)
    b = entry("B", session=2, at=100.0)
    solo = declaration([a_old], 100.5)
    d = run(b, [a_old, b], [solo], now=101.0, expected=frozenset({"A"}))
    assert d.action == "wait", d  # not "declare" alone ("complete"), not "not_in_group"
    a_new = entry("A", session=3, at=101.5)  # A's solo step was refused: it announces again
    d = run(b, [a_old, a_new, b], [solo], now=102.0, expected=frozenset({"A"}))
    assert d.action == "declare" and ids(d) == ["A", "B"] or d.action == "wait" and d.leader.peer_id == "A", d
    assert run(a_new, [a_new, b], [solo], now=102.0, expected=frozenset({"B"})).action == "declare"
    pair = declaration([a_old, b], 100.5)  # a real group without us still accounts for its members
    c = entry("C", at=100.0)
    assert run(c, [c], [pair], now=101.0, expected=frozenset({"A", "B"})).action != "wait"


def test_when_the_epoch_needs_several_groups_a_closed_window_is_no_reason_to_fail() -> None:
    """Groups of at most 2 and 4 peers expected: {A, B} closed by its window; C and D form the next group instead of
    being "late" (or "not_in_group"); with only the group's worth expected, C is late as before."""
    a, b = entry("A"), entry("B")
    closed = declaration([a, b], 105.0)
    c, d_ = entry("C", at=106.0), entry("D", at=106.5)
    many = frozenset("ABCD")
    assert run(c, [a, b, c], [closed], now=106.0, target=2, expected=many).action == "wait"
    d = run(c, [a, b, c, d_], [closed], now=106.6, target=2, expected=many)
    assert d.action == "declare" and ids(d) == ["C", "D"]
    after = entry("E", at=104.0)  # announced before the declaration its leader made without it
    assert run(after, [a, b, after], [closed], now=106.0, target=2, expected=frozenset("ABE") | many).action == "wait"
    assert run(c, [a, b, c], [closed], now=106.0, target=2, expected=frozenset("ABC") - {"A"}).action == "late"


# ---- a declared group whose round is over blocks nobody (no livelock after a failed round) -----------------------


def test_a_failed_groups_declaration_stops_blocking_once_its_members_announce_again() -> None:
    """pause-mid-round's livelock: {A, B} was declared without C, its round failed, and C was told "late" by that
    declaration at every later attempt while A and B retried at the same epoch."""
    a1, b1 = entry("A", 1), entry("B", 1)
    failed = declaration([a1, b1], 105.0)
    c = entry("C", 1, at=106.0)
    assert run(c, [a1, b1, c], [failed], now=106.0).action == "late"  # while its round may still commit
    a2, b2, c2 = entry("A", 2, at=118.0), entry("B", 2, at=118.2), entry("C", 2, at=118.5)
    entries = [a1, b1, a2, b2, c2]  # the old entries are still in the DHT
    d = run(c2, entries, [failed], now=119.0)
    assert d.action == "wait", d.reason  # A and B retried: that round failed, the epoch is open again
    assert run(b2, entries, [failed], now=119.0).action == "wait"
    d = run(a2, entries, [failed], now=123.0)  # A's window (118 + 5) closed: one group of all three
    assert d.action == "declare" and ids(d) == ["A", "B", "C"], d.reason
    only_a = [a1, b1, a2, c2]  # one member announcing again is proof enough (B's new entry went only to A)
    assert run(c2, only_a, [failed], now=119.0).action == "wait"


def test_three_failed_pairs_block_nobody() -> None:
    """Each peer was left out of one failed pair group: every declaration is over (its members announced again)."""
    first = {p: entry(p, 1) for p in "ABC"}
    pairs = [declaration([first["A"], first["B"]], 105.0), declaration([first["B"], first["C"]], 105.1),
             declaration([first["A"], first["C"]], 105.2)]  # fmt: skip
    retry = {p: entry(p, 2, at=120.0) for p in "ABC"}
    for p in "ABC":
        assert run(retry[p], retry.values(), pairs, now=121.0).action == "wait", p
    d = run(retry["A"], retry.values(), pairs, now=125.0)
    assert d.action == "declare" and ids(d) == ["A", "B", "C"]


def test_a_newer_session_inside_another_declaration_ends_the_older_group() -> None:
    """Followers matched by a direct push never store their entry in the DHT: a later declaration listing a member's
    newer session proves the earlier group over too. The later group itself may have committed: it blocks."""
    a1, b1 = entry("A", 1), entry("B", 1)
    a2, b2 = entry("A", 2, at=118.0), entry("B", 2, at=118.0)
    first, second = declaration([a1, b1], 105.0), declaration([a2, b2], 118.1)
    c = entry("C", 1, at=119.0)
    d = run(c, [a1, b1, c], [first, second], now=119.0)
    assert d.action == "late" and "118.10" in d.reason, d.reason


def test_a_declaration_older_than_the_round_timeout_blocks_nobody() -> None:
    """A group whose members never show up again (they committed and moved on, or died) is over after the round
    timeout, as its DHT record is: a peer arriving later is not told "late" by a memory of it."""
    a, b = entry("A"), entry("B")
    old = declaration([a, b], 105.0)
    assert run(entry("C", at=134.0), [a, b], [old], now=134.5).action == "late"  # 29.5 s old: may still run
    d = run(entry("C", at=135.5), [a, b], [old], now=135.5)
    assert d.action == "wait", d.reason


def test_a_live_declaration_still_makes_a_latecomer_late() -> None:
    """Entries that do not prove the round over change nothing: a member's entry older than the one declared, and
    the latecomer's own earlier attempts."""
    a0, a1, b1 = entry("A", 0, at=90.0), entry("A", 1), entry("B", 1)
    live = declaration([a1, b1], 105.0)
    c1, c2 = entry("C", 1, at=106.0), entry("C", 2, at=110.0)
    d = run(c2, [a0, a1, b1, c1, c2], [live], now=110.0)
    assert d.action == "late" and "closed at 105.00" in d.reason
    c3 = entry("C", 3, at=104.0)  # announced before it, left out: not_in_group
    assert run(c3, [a0, a1, b1, c3], [live], now=105.2).action == "not_in_group"


def test_a_declaration_listing_us_whose_round_is_over_fails_at_once() -> None:
    """Our session was declared, but another member already announced again: waiting for that round would only
    time out. Our entry stays consumed (a session groups once); the caller retries with a new one."""
    a, b1, b2 = entry("A"), entry("B", 1), entry("B", 2, at=112.0)
    over = declaration([a, b1], 105.0)
    d = run(a, [a, b1, b2], [over], now=112.5)
    assert d.action == "no_group" and "B announced again" in d.reason
    assert run(a, [a, b1], [over], now=112.5).action == "joined"


# ---- a round that goes on without members that fail stays the epoch's while it may commit (drop_failed) ----------


def test_the_group_closes_as_soon_as_every_expected_peer_is_ready() -> None:
    a, b, c = entry("A"), entry("B", at=100.5), entry("C", at=100.7)
    expected = frozenset("ABC")
    assert run(a, [a, b], now=100.6, expected=expected).action == "wait"  # C is still training
    d = run(a, [a, b, c], now=100.8, expected=expected)
    assert d.action == "declare" and ids(d) == ["A", "B", "C"] and d.closed_by == "complete", d.reason
    d = run(c, [a, b, c], now=100.8, expected=expected)  # a follower sees it too and waits for A's declaration
    assert d.action == "wait" and d.closed_by == "complete" and d.leader == a
    assert run(a, [a, b, c], now=100.8).action == "wait"  # nothing expected: today's window


def test_expected_peers_that_are_banned_or_ourselves_do_not_hold_the_group_and_others_still_join() -> None:
    a, b, x = entry("A"), entry("B"), entry("X")  # X is ready but nobody expected it: it is grouped anyway
    d = run(a, [a, b, x], now=101.0, expected=frozenset({"B", "M"}), banned=frozenset({"M"}))
    assert d.action == "declare" and ids(d) == ["A", "B", "X"] and d.closed_by == "complete"
    d = run(a, [a], now=101.0, expected=frozenset({"A"}))  # we expect nobody else
    assert d.action == "declare" and ids(d) == ["A"] and d.closed_by == "complete"


def test_an_expected_peer_that_never_comes_delays_the_group_to_the_window_and_a_grace_only() -> None:
    # the grace: an entry announced in time may take that long to show on a loaded DHT
    a, b = entry("A"), entry("B")
    expected = frozenset("ABC")
    d = run(a, [a, b], now=104.9 + GRACE, expected=expected)
    assert d.action == "wait" and "1 expected peer(s) not ready" in d.reason
    d = run(a, [a, b], now=105.0 + GRACE, expected=expected)
    assert d.action == "declare" and ids(d) == ["A", "B"] and d.closed_by == "window"


def test_a_slow_expected_peer_gets_the_callers_patience_past_the_window_and_no_more() -> None:
    # C is expected and still in an inner step of 4 s (its record): the group waits 4 s past the window, not the grace
    a, b = (entry(p, wait_s=20.0).model_copy(update={"window_closes_at": 105.0}) for p in "AB")
    c = entry("C", at=108.5, wait_s=20.0)
    expected = frozenset("ABC")
    d = run(a, [a, b], now=105.0 + GRACE, expected=expected, patience_s=4.0)
    assert d.action == "wait" and "window closes in 3.00s" in d.reason
    d = run(a, [a, b, c], now=108.6, expected=expected, patience_s=4.0)  # C came in time: the group is complete
    assert d.action == "declare" and ids(d) == ["A", "B", "C"] and d.closed_by == "complete"
    d = run(a, [a, b], now=109.0, expected=expected, patience_s=4.0)  # it never came: closed without it
    assert d.action == "declare" and ids(d) == ["A", "B"] and d.closed_by == "window"
    # nobody missing: patience costs nothing (the group closes complete at once)
    d = run(a, [a, b], now=101.0, expected=frozenset("AB"), patience_s=4.0)
    assert d.action == "declare" and d.closed_by == "complete"


def test_a_complete_group_below_min_group_size_waits_for_the_window() -> None:
    a = entry("A")
    assert run(a, [a], now=101.0, min_size=2, expected=frozenset("A")).action == "wait"
    assert run(a, [a], now=105.0, min_size=2, expected=frozenset("A")).action == "too_small"


def test_the_last_group_of_an_epoch_closes_complete_once_the_others_formed() -> None:
    # 5 expected, groups of 3: A, B, C formed a full group; D and E are everyone left, so they need not wait out the
    # window (and a window-closed group would make any later arrival "late")
    a, b, c, d_, e = (entry(p) for p in "ABCDE")
    full = declaration([a, b, c], 100.1, reason="full")
    d = run(d_, [a, b, c, d_, e], [full], now=100.2, target=3, expected=frozenset("ABCDE"))
    assert d.action == "declare" and ids(d) == ["D", "E"] and d.closed_by == "complete", d.reason
    # a group whose round is over accounts for nobody: its members will announce again
    old = declaration([a, b, c], 100.1 - TTL - 1, reason="full")  # older than the round timeout: over
    over = run(d_, [a, b, c, d_, e], [old], now=100.2, target=3, expected=frozenset("ABCDE"))
    assert over.action == "wait" and "3 expected peer(s) not ready" in over.reason


def test_a_full_group_closes_before_a_complete_one() -> None:
    entries = [entry(p) for p in "ABC"]
    d = run(entries[0], entries, now=100.1, target=2, expected=frozenset("ABC"))
    assert d.action == "declare" and ids(d) == ["A", "B"] and d.closed_by == "full"


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


def signing_keys(n: int) -> list[tuple[str, RSAPrivateKey]]:
    """``n`` fresh RSA keys with their peer ids, sorted by peer id."""
    out = []
    for _ in range(n):
        key = RSAPrivateKey()
        marker = RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", key.get_public_key().to_bytes())
        out.append((peer_id_of_owner(marker), key))
    return sorted(out, key=lambda pk: pk[0])


@pytest.fixture(scope="module")
def keys() -> list[tuple[str, RSAPrivateKey]]:
    return signing_keys(3)


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


def _matchmakers(keys, dht: FakeDHT, frozen_clock: bool = False) -> tuple[list[Matchmaker], list[str]]:
    """Two matchmakers whose pushes go straight to each other's ``offer``/``offer_entry`` (on threads). With
    ``frozen_clock`` their DHT time stands still: no window can close, so a group they form closed "full" or
    "complete" (had either waited for its window, ``match`` would return "no_group" at its call deadline)."""
    start = time.time()
    clock = {"dht_clock": lambda: start} if frozen_clock else {}
    by_id: dict[str, Matchmaker] = {}
    pushes: list[str] = []

    def push(kind: str, raw: dict, targets) -> None:
        for t in targets:
            pushes.append(kind)
            receiver = by_id[t.peer_id]
            handler = receiver.offer_entry if kind == "ready" else receiver.offer
            threading.Thread(target=handler, args=(raw,), daemon=True).start()

    for pid, key in keys[:2]:
        by_id[pid] = Matchmaker(
            FakeNode(pid, key, dht), PREFIX, poll_interval_s=0.05, declare_grace_s=GRACE, push=push, **clock
        )
    return list(by_id.values()), pushes


def _match_both(mms: list[Matchmaker], round_key: str, timeout_s: float, target: int = 2, expected=frozenset()) -> list:
    def one(mm: Matchmaker):
        me = mm.make_entry(round_key, os.urandom(16), "127.0.0.1", 4000, bytes(32), 5.0)
        return mm.match(me, target_group_size=target, min_group_size=2, ttl_s=30.0,
                        deadline_monotonic=time.monotonic() + timeout_s, expected=expected)  # fmt: skip

    return run_threads([lambda m=m: one(m) for m in mms], timeout_s + 5.0)


def test_peers_that_averaged_before_match_through_their_data_ports_while_the_dht_stalls(keys) -> None:
    dht = FakeDHT()
    mms, pushes = _matchmakers(keys, dht, frozen_clock=True)
    first = _match_both(mms, "e0", 5.0)  # through the DHT: they learn of each other
    assert [d.action for d, _ in first] == ["joined", "joined"], first
    dht.stalled = True
    del pushes[:]
    second = _match_both(mms, "e1", 5.0)  # DHT time frozen: only "full" can close it, no DHT answer is needed
    assert [d.action for d, _ in second] == ["joined", "joined"], second
    assert second[0][0].declaration == second[1][0].declaration and "(full)" in second[0][1]
    assert dht.hung and not any(f.done() for f in dht.hung)  # the DHT really was asked and never answered
    assert pushes == ["ready", "group"]  # the follower's entry went to its previous leader, the declaration back
    leader = mms[0].node.owner_marker
    stored = sorted(subkey for key, subkey in dht.stored if ".e1." in key)
    assert stored == [leader + b"|group", leader + b"|ready"]  # the follower, matched in time, used no DHT at all


def test_peers_that_expect_each_other_match_without_waiting_out_the_window(keys) -> None:
    """A 5 s window, a target of 8: the group closes when both expected peers are in ("complete"), and its signed
    declaration says "window" (the epoch's group: a latecomer is late, as for a window that ran out)."""
    dht = FakeDHT()
    mms, _ = _matchmakers(keys, dht, frozen_clock=True)  # no window can close: only "complete" can
    both = _match_both(mms, "e0", 5.0, target=8, expected=frozenset(pid for pid, _ in keys[:2]))
    assert [d.action for d, _ in both] == ["joined", "joined"], both
    assert both[0][0].declaration == both[1][0].declaration
    assert both[0][0].closed_by == "complete" and both[0][0].declaration.reason == "window"


def test_pushed_entries_are_kept_only_when_signed_by_their_peer(keys) -> None:
    (pid, key), (other_pid, _) = keys[0], keys[1]
    mm = Matchmaker(FakeNode(other_pid, keys[1][1], FakeDHT()), PREFIX, poll_interval_s=0.05, declare_grace_s=GRACE)
    good = signed(pid, key)
    assert not mm.offer_entry(good.model_copy(update={"port": 4001}).model_dump())  # tampered
    assert not mm.offer_entry({"peer_id": pid})  # malformed
    assert mm.offer_entry(good.model_dump())
    entries, _ = mm._merge("e0", [])
    assert entries == [good]


def _signed_entry(pid: str, key: RSAPrivateKey, session: int, at: float, wait_s: float = 5.0) -> ReadyEntry:
    raw = entry(pid, session, at=at, wait_s=wait_s).model_copy(update={"public_key": key.get_public_key().to_bytes()})
    return sign_entry(PREFIX, raw, key)


def _put(dht: FakeDHT, key: RSAPrivateKey, kind: bytes, record) -> None:
    marker = RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", key.get_public_key().to_bytes())
    dht.data.setdefault(f"{PREFIX}.e0.mm", {})[marker + b"|" + kind] = ValueWithExpiration(
        record.model_dump(), time.time() + 60
    )


def test_a_remembered_failed_group_blocks_no_attempt_once_the_dht_shows_its_members_again(keys) -> None:
    """The matchmaker remembers every declaration it saw, and its first decision of an attempt has no entries yet:
    a verdict of "late" must wait for a DHT read made after we announced, which shows A and B announced again.
    Before that read, pause-mid-round's peers were told "late" by the same old declaration at every attempt."""
    (c_id, c_key), (a_id, a_key), (b_id, b_key) = keys  # we (C) have the smallest id: we lead the next group
    now = time.time()
    a1, b1 = _signed_entry(a_id, a_key, 1, now - 20), _signed_entry(b_id, b_key, 1, now - 20)
    failed = sign_declaration(PREFIX, declaration([a1, b1], now - 15), a_key)
    dht = FakeDHT()
    mm = Matchmaker(FakeNode(c_id, c_key, dht), PREFIX, poll_interval_s=0.05, declare_grace_s=GRACE)
    assert mm.offer(failed.model_dump())  # remembered from an earlier attempt (the DHT copy may have expired)
    _put(dht, a_key, b"ready", _signed_entry(a_id, a_key, 2, now - 0.5))
    _put(dht, b_key, b"ready", _signed_entry(b_id, b_key, 2, now - 0.4))
    me = mm.make_entry("e0", os.urandom(16), "127.0.0.1", 4000, bytes(32), 0.3)
    decision, reason = mm.match(me, target_group_size=8, min_group_size=1, ttl_s=TTL,
                                deadline_monotonic=time.monotonic() + 5.0)  # fmt: skip
    assert decision.action == "joined", reason
    assert decision.declaration.member_ids() == (c_id, a_id, b_id)


def test_a_peer_told_late_withdraws_its_entry(keys) -> None:
    """The same old group with no sign of a retry: C is late, and replaces its stored entry by one whose deadline
    has passed (stored to expire later, so DHT nodes keep it), so that nobody declares C's dead session."""
    (c_id, c_key), (a_id, a_key), (b_id, b_key) = keys
    now = time.time()
    a1, b1 = _signed_entry(a_id, a_key, 1, now - 2), _signed_entry(b_id, b_key, 1, now - 2)
    dht = FakeDHT()
    _put(dht, a_key, b"group", sign_declaration(PREFIX, declaration([a1, b1], now - 1), a_key))
    mm = Matchmaker(FakeNode(c_id, c_key, dht), PREFIX, poll_interval_s=0.05, declare_grace_s=GRACE)
    me = mm.make_entry("e0", os.urandom(16), "127.0.0.1", 4000, bytes(32), 5.0)
    decision, _ = mm.match(me, target_group_size=8, min_group_size=1, ttl_s=TTL,
                           deadline_monotonic=time.monotonic() + 5.0)  # fmt: skip
    assert decision.action == "late"
    stored = dht.data[f"{PREFIX}.e0.mm"][mm.node.owner_marker + b"|ready"]
    withdrawn = ReadyEntry.model_validate(stored.value)
    assert verify_entry(PREFIX, withdrawn) and withdrawn.session == me.session and withdrawn.deadline == 0.0
    # replaces it (expires later), and not our next entry (announced over WITHDRAW_AFTER_S later: a resync, a backoff)
    assert me.announced_at + TTL < stored.expiration_time <= me.announced_at + TTL + WITHDRAW_AFTER_S
    assert ids(run(entry("A", 3, at=now), [withdrawn], now=now + 5.0)) == ["A"]  # nobody's candidate any more


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


def test_only_a_declaration_of_our_current_session_joins_us() -> None:
    """``decide`` looks for declarations listing us only when our (peer id, session) is among the declared entries:
    a full group that listed our older session neither joins nor fails our new one, which leads the next group."""
    a1, b, c = entry("A", 1), entry("B"), entry("C")
    old = declaration([a1, b], 100.5, reason="full")
    a2 = entry("A", 2, at=101.0)
    d = run(a2, [a2, b, c], [old], now=105.5)
    assert d.action == "declare" and ids(d) == ["A", "C"]
    joined = run(a1, [a1, b, c], [old], now=101.0)
    assert joined.action == "joined" and joined.declaration == old


def test_half_of_the_expected_peers_or_fewer_keep_waiting_when_one_group_is_to_hold_them_all() -> None:
    """One declaration per epoch (butterfly's two-stage round, moshpit): 4 of 9 expected peers must not close a window
    of their own (they would commit a minority's state and block the other 4 at this round key); 5 may, and so may
    the 4 once the others are back. With groups smaller than the epoch (target 3), the rule does not apply."""
    early = [entry(p, wait_s=30.0) for p in "ABCD"]  # each waits up to its call's deadline; the window closes at 130
    expected = frozenset("ABCDEFGHI")
    d = run(early[0], early, now=131.0, target=4096, expected=expected)
    assert d.action == "wait" and "4 of 9 at the window's close" in d.reason
    d = run(early[0], [*early, entry("E", wait_s=30.0)], now=131.0, target=4096, expected=expected)
    assert d.action == "declare" and ids(d) == list("ABCDE") and d.closed_by == "window"
    late = [*early, *(entry(p, at=110.0, wait_s=30.0) for p in "EFGH")]  # the others, back from their failed attempt
    d = run(early[0], late, now=131.0, target=4096, expected=expected)
    assert d.action == "declare" and ids(d) == list("ABCDEFGH")
    d = run(early[0], early, now=131.0, target=3, expected=expected)
    assert d.action == "declare" and ids(d) == list("ABC") and d.closed_by == "full"


def test_rival_groups_are_the_other_live_declarations_of_the_round_key() -> None:
    """What a member's ``accept`` ranks its round against (``EpochGroups``): not ours, not one of another key, not a
    lone peer's, and not one whose round is over (a member announced again, or older than the round timeout)."""
    a, b, c, d, e, f = (entry(p) for p in "ABCDEF")
    ours, rival = declaration([a, b], 101.0, "full"), declaration([c, d], 101.0, "full")
    lone = declaration([e], 101.0)
    other_key = declaration([entry("G", key="e1"), entry("H", key="e1")], 101.0)
    failed = declaration([f, entry("I")], 101.0, "full")
    again = entry("F", session=2, at=103.0)  # F's call with that group ended: its round is over
    rivals = rival_groups(ours, [again], [ours, rival, lone, other_key, failed], 104.0, TTL)
    assert rivals == (frozenset("CD"),)
    assert rival_groups(ours, [], [ours, rival], 101.0 + TTL + 1.0, TTL) == ()  # expired


def test_an_expected_peer_that_moves_on_during_matchmaking_is_no_longer_waited_for(keys) -> None:
    """``expected`` as a function is asked at every decision: a peer alone at the window's close waits for an
    expected peer until its deadline (issue 22), but not once the caller's view shows that peer gone past the epoch
    (a woken laptop's first view was from before its sleep: chaos pause-twice)."""
    (c_id, c_key), (x_id, _), _ = keys
    mm = Matchmaker(FakeNode(c_id, c_key, FakeDHT()), PREFIX, poll_interval_s=0.05, declare_grace_s=GRACE)
    results = {}
    for label, moves_on_after_s in (("fixed", None), ("moves on", 0.5)):
        started = time.monotonic()

        def expected(started=started, after=moves_on_after_s) -> frozenset[str]:
            gone = after is not None and time.monotonic() - started > after
            return frozenset() if gone else frozenset({x_id})

        me = mm.make_entry(f"e{len(results)}", os.urandom(16), "127.0.0.1", 4000, bytes(32), 4.0, window_s=0.2)
        decision, _ = mm.match(me, target_group_size=8, min_group_size=1, ttl_s=TTL,
                               deadline_monotonic=started + 4.0, expected=expected)  # fmt: skip
        results[label] = (decision.action, time.monotonic() - started)
    assert results["fixed"][0] == "no_group" and results["fixed"][1] >= 4.0  # waited for it until the deadline
    assert results["moves on"][0] == "joined" and results["moves on"][1] < 3.0  # a group of one: the caller decides


class CountingDHT(FakeDHT):
    """A FakeDHT that counts gets."""

    def __init__(self) -> None:
        super().__init__()
        self.gets = 0

    def get(self, key, latest, return_future):
        self.gets += 1
        return super().get(key, latest, return_future)


def test_reads_of_a_large_round_key_are_spaced_by_the_read_budget(keys) -> None:
    """A peer waiting in matchmaking reads its round key no faster than its read budget allows: after a read of B
    bytes, B / budget seconds pass before the next (a 1,000-peer key is ~2.6 MB; polled every 0.1 s it would fill a
    home downlink), and its grace for a leader's declaration grows by that gap. Without a budget the same wait polls
    at the fast interval. (Malformed values count in a read's size like any other: the DHT sends them too.)"""
    (c_id, c_key), (x_id, _), _ = keys
    gets = {}
    for budget in (None, 40_000.0):
        dht = CountingDHT()
        pad = {os.urandom(8) + b"|ready": ValueWithExpiration({"pad": b"x" * 1000}, 0.0) for _ in range(20)}
        budgeted = {} if budget is None else {"read_bytes_per_s": budget}
        mm = Matchmaker(FakeNode(c_id, c_key, dht), PREFIX, poll_interval_s=0.05, declare_grace_s=GRACE, **budgeted)
        me = mm.make_entry("e0", os.urandom(16), "127.0.0.1", 4000, bytes(32), 5.0)
        dht.data[f"{PREFIX}.e0.mm"] = dict(pad)
        decision, _ = mm.match(me, target_group_size=8, min_group_size=1, ttl_s=TTL,
                               deadline_monotonic=time.monotonic() + 1.5, expected=frozenset({x_id}))  # fmt: skip
        assert decision.action == "no_group"  # alone, the expected peer never came: it waited the whole call
        gets[budget] = dht.gets
        if budget is not None:
            size = mm._read_bytes
            assert 20_000 < size < 30_000  # 20 values of ~1 KB and our entry, as msgpack
            assert mm.read_gap_s() == pytest.approx(size / budget)  # ~0.6 s
            assert mm.grace_s() == pytest.approx(GRACE + size / budget - 0.05)
    assert gets[40_000.0] <= 4  # 1.5 s at one read per ~0.6 s: the first, then at most 3
    assert gets[None] >= 8  # polled every 20 ms during the first second (a prospective leader), then every 50 ms
