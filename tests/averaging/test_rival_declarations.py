"""Two declarations of one round key: a member in the other one is not waited for.

Chaos ``pause-twice`` (2026-12-01, beside 2 CPU hogs): two peers committed a declaration of two in 0.1 s while the
third, which had not read it yet, declared all three. It dialed the two for connect timeout + join grace (11 s), each
answering RETRY, then fell 4 epochs behind. Now a RETRY says when the member will never join the dialer's
declaration (``handshake.where_answer``), and the round fails at once as "not_in_group", naming those that went on.
"""

from __future__ import annotations

import time

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from hivetrain.averaging import AveragingConfig
from hivetrain.averaging.allreduce import ButterflyRound
from hivetrain.averaging.base import RoundFailed
from hivetrain.averaging.handshake import Elsewhere, RoundKeys, ask_where, dial, where_answer
from hivetrain.averaging.reduce import BufferPool, Member
from hivetrain.averaging.wire import LinkClosed
from hivetrain.faults import NO_FAULTS
from hivetrain.peers.bans import BanList

from .conftest import run_threads

JOIN_WAIT_S = 20.0  # what a dialer would spend on a member that never joins, without the answer
OURS, THEIRS = ("e7", "d1" * 16), ("e7", "d2" * 16)


def _public(secret: X25519PrivateKey) -> bytes:
    return secret.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def test_the_answer_names_a_committed_round_key_first_then_another_declaration_of_it() -> None:
    assert where_answer(None, [THEIRS], {"e7": THEIRS[1]}) == {}  # the dialer named no declaration (moshpit, gossip)
    assert where_answer(OURS, [], {}) == {}  # not learned of it yet: dial again
    assert where_answer(OURS, [OURS], {}) == {}  # in its declaration (another stage's round of it): it will come
    assert where_answer(OURS, [("e8", "x" * 32), ("", "")], {}) == {}  # another round key is no rival
    assert where_answer(OURS, [THEIRS], {}) == {"elsewhere": THEIRS[1][:12]}
    assert where_answer(OURS, [], {"e7": THEIRS[1]}) == {"done": THEIRS[1][:12]}
    assert where_answer(OURS, [], {"e7": OURS[1]}) == {"done": OURS[1][:12]}  # it committed ours without us
    assert where_answer(OURS, [], {"e6": THEIRS[1]}) == {}


def _keys(round_id: str, me: str, peer: str, peer_secret, group=("", "")) -> tuple[RoundKeys, X25519PrivateKey]:
    secret = X25519PrivateKey.generate()
    return RoundKeys(round_id, me, secret, {peer: _public(peer_secret)}, lambda link: link.close(), group=group), secret


def _dial_outcome(port: int, group: tuple[str, str]) -> tuple[type, float]:
    """Dial ``B`` at ``port`` for a round it does not hold, naming ``group``: (what was raised, seconds taken)."""
    keys, _ = _keys("unknown-round", "A", "B", X25519PrivateKey.generate(), group)
    started = time.monotonic()
    with pytest.raises(LinkClosed) as caught:
        dial("127.0.0.1", port, keys, "B", connect_timeout_s=1.0, part_timeout_s=1.0, buffer_num_bytes=0,
             join_wait_s=1.0)  # fmt: skip
    return type(caught.value), time.monotonic() - started


def test_a_dialer_stops_at_once_for_a_member_in_another_declaration_or_done_with_the_round_key(servers) -> None:
    server = servers()
    # B is in a round of another declaration of e7 (its row round, say)
    theirs, _ = _keys("their-row", "B", "C", X25519PrivateKey.generate(), THEIRS)
    server.register(theirs)
    assert _dial_outcome(server.port, OURS)[0] is Elsewhere  # raised on its first RETRY: no dialing again
    assert ask_where("127.0.0.1", server.port, "B", OURS, 2.0).went_on is False
    kind, took = _dial_outcome(server.port, THEIRS)  # its own declaration's next round: dial again until it comes
    assert kind is LinkClosed and took >= 1.5  # it kept dialing for connect timeout + join wait (2 s)
    assert ask_where("127.0.0.1", server.port, "B", THEIRS, 2.0) is None
    kind, _ = _dial_outcome(server.port, ("", ""))  # a round that names no declaration is never told
    assert kind is LinkClosed
    # B's group committed e7: whoever dials it for e7 hears so, whatever declaration it names
    server.unregister("their-row")
    server.note_committed(*THEIRS)
    for group in (OURS, THEIRS):
        assert _dial_outcome(server.port, group)[0] is Elsewhere
        assert ask_where("127.0.0.1", server.port, "B", group, 2.0).went_on is True
    # B averages at e7 again (its caller retried the epoch): a new declaration may list it
    server.note_committed("e7", "", committed=False)
    assert _dial_outcome(server.port, OURS)[0] is LinkClosed
    assert ask_where("127.0.0.1", server.port, "B", OURS, 2.0) is None


@pytest.mark.parametrize("our_id", ["peer0", "peer9"], ids=["we-dial-them", "they-are-to-dial-us"])
def test_a_round_whose_other_members_committed_the_round_key_elsewhere_fails_at_once_naming_them(
    servers, our_id: str
) -> None:
    """Both sides of a pair: the smaller id dials (its RETRY answers), the larger waits and asks (``ask_where``)."""
    config = AveragingConfig(part_timeout_s=1.0, connect_timeout_s=1.0, commit_timeout_s=1.0)
    others = ["peer3", "peer5"]
    srv = {p: servers() for p in [our_id, *others]}
    for p in others:  # they committed e7 in a declaration of two: they are at e8 now
        srv[p].note_committed(*THEIRS)
    secrets = {p: X25519PrivateKey.generate() for p in srv}
    members = [Member(p, "127.0.0.1", srv[p].port, _public(secrets[p])) for p in srv]
    ours = ButterflyRound(round_id="ours", members=members, me=our_id, secret=secrets[our_id], server=srv[our_id],
                          config=config, faults=NO_FAULTS, epoch=7, bans=BanList(), pool=BufferPool(),
                          join_grace_s=JOIN_WAIT_S, group=OURS)  # fmt: skip
    started = time.monotonic()
    with pytest.raises(RoundFailed) as caught:
        ours.run(torch.ones(64), 1.0, time.monotonic() + 3 * JOIN_WAIT_S)
    took = time.monotonic() - started
    assert caught.value.reason == "not_in_group" and caught.value.closed_without_us == frozenset(others)
    assert took < JOIN_WAIT_S / 2, f"waited {took:.1f}s for members that went on"


def test_an_averager_that_committed_an_epoch_says_so_until_it_averages_at_that_epoch_again(make_averagers) -> None:
    """The engine's side: a committed butterfly round marks its round key done on our data port, and a new call at
    that epoch (a caller may average twice at one) clears it."""
    avgs = make_averagers(2, AveragingConfig(target_group_size=2, connect_timeout_s=5.0, part_timeout_s=5.0))
    expected = frozenset(a.node.peer_id for a in avgs)
    calls = [lambda a=a: a.average([torch.ones(8)], 1.0, 3, 30.0, expected_peers=expected) for a in avgs]
    for a in avgs:  # nothing committed yet: no answer
        assert ask_where("127.0.0.1", a.port, a.node.peer_id, OURS, 5.0) is None
    results = run_threads(calls, 60.0)
    assert all(len(r.group) == 2 for r in results), results
    for a in avgs:
        said = ask_where("127.0.0.1", a.port, a.node.peer_id, ("e3", "another-declaration"), 5.0)
        assert said is not None and said.went_on and results[0].round_id[:12] in str(said)
        assert ask_where("127.0.0.1", a.port, a.node.peer_id, ("e4", "another-declaration"), 5.0) is None
    results = run_threads(calls, 60.0)  # the same epoch again: a new group of the two, not "done"
    assert all(len(r.group) == 2 for r in results), results
