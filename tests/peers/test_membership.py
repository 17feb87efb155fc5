"""Admission (issue 12 item 6): join tokens, the membership decision (pure, time injected), the refusal messages, the
roster, the run config section, and the DHT record guard dropping a non-member's record."""

import base64
import dataclasses
import time

import msgpack
import pytest
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey

from hivetrain.config import RunConfig
from hivetrain.peers.identity import peer_id_of_public_key
from hivetrain.peers.membership import (
    TOKEN_PREFIX,
    AdmissionPolicy,
    MemberRoster,
    TokenError,
    decide_membership,
    make_token,
    parse_token,
    refusal_message,
    revocation_list,
)
from hivetrain.peers.records import peers_key
from hivetrain.peers.validators import RecordBounds, RecordGuard, check_record
from tests.peers.test_validators import NOW, _check, _node_validator, _peer, _signed, _signer
from tests.records import peer_record

DAY_S = 86400.0


@dataclasses.dataclass(frozen=True)
class Key:
    key: RSAPrivateKey
    peer_id: str


def _key() -> Key:
    key = RSAPrivateKey()
    return Key(key, peer_id_of_public_key(key.get_public_key().to_bytes()))


@pytest.fixture(scope="module")
def coordinator() -> Key:
    return _key()


@pytest.fixture(scope="module")
def volunteer() -> Key:
    return _key()


def _token(issuer: Key, peer_id: str, run_id: str = "r", issued_at: float = NOW, days: float = 30) -> str:
    return make_token(issuer.key, run_id, peer_id, issued_at, issued_at + days * DAY_S)


def test_a_token_round_trips_and_names_its_issuer(coordinator, volunteer):
    token = _token(coordinator, volunteer.peer_id)
    assert token.startswith(TOKEN_PREFIX) and len(token) < 2048
    parsed = parse_token(token)
    assert (parsed.run_id, parsed.peer_id, parsed.issuer) == ("r", volunteer.peer_id, coordinator.peer_id)
    assert parsed.expires_at - parsed.issued_at == 30 * DAY_S


def test_damaged_or_forged_tokens_are_refused(coordinator, volunteer):
    token = _token(coordinator, volunteer.peer_id)
    for bad in ("", "hvt1.", "hvt1.!!!", "nope", token[:-20], TOKEN_PREFIX + "A" * 3000):
        with pytest.raises(TokenError) as info:
            parse_token(bad)
        assert info.value.cause == "malformed"
    # a payload changed after signing (another peer ID) does not verify
    outer = msgpack.unpackb(base64.urlsafe_b64decode(token[5:] + "=" * (-len(token[5:]) % 4)))
    fields = msgpack.unpackb(outer["p"])
    fields["peer"] = coordinator.peer_id
    outer["p"] = msgpack.packb(fields, use_bin_type=True)
    forged = TOKEN_PREFIX + base64.urlsafe_b64encode(msgpack.packb(outer, use_bin_type=True)).decode()
    with pytest.raises(TokenError) as info:
        parse_token(forged)
    assert info.value.cause == "bad_signature"
    with pytest.raises(ValueError, match="peer ID"):
        make_token(coordinator.key, "r", "not-a-peer-id", NOW, NOW + 1)
    with pytest.raises(ValueError, match="expires_at"):
        make_token(coordinator.key, "r", volunteer.peer_id, NOW, NOW)


def test_the_membership_decision_names_each_cause(coordinator, volunteer):
    stranger = _key()
    policy = AdmissionPolicy("r", "token", allowlist=frozenset({stranger.peer_id}), issuer=coordinator.peer_id)
    token = _token(coordinator, volunteer.peer_id)

    def cause(peer_id, token_text, now=NOW + DAY_S, p=policy):
        return decide_membership(peer_id, token_text, p, now).cause

    assert cause(volunteer.peer_id, token) == "token"
    assert decide_membership(volunteer.peer_id, token, policy, NOW).expires_at == NOW + 30 * DAY_S
    assert cause(coordinator.peer_id, "") == "issuer"
    assert cause(stranger.peer_id, "") == "allowlist"
    assert cause(volunteer.peer_id, "") == "no_token"
    assert cause(volunteer.peer_id, token, now=NOW + 31 * DAY_S) == "expired"
    assert cause(volunteer.peer_id, token, now=NOW - DAY_S) == "not_yet_valid"
    assert cause(volunteer.peer_id, _token(coordinator, volunteer.peer_id, run_id="other")) == "wrong_run"
    assert cause(_key().peer_id, token) == "wrong_peer"
    assert cause(volunteer.peer_id, _token(stranger, volunteer.peer_id)) == "wrong_issuer"  # self-signed
    assert cause(volunteer.peer_id, "hvt1.garbage") == "malformed"
    allowlist = AdmissionPolicy("r", "allowlist", allowlist=frozenset({stranger.peer_id}), issuer=coordinator.peer_id)
    assert cause(volunteer.peer_id, token, p=allowlist) == "not_listed"  # tokens do not count in allowlist mode
    assert cause(volunteer.peer_id, "", p=AdmissionPolicy("r")) == "open"


def test_refusals_say_what_is_wrong_and_what_to_do(coordinator, volunteer):
    policy = AdmissionPolicy("r", "token", issuer=coordinator.peer_id)
    me = volunteer.peer_id
    no_token = refusal_message(decide_membership(me, "", policy, NOW), "r", me)
    assert f"run 'r' admits only invited peers; your peer ID is {me}" in no_token
    assert f"hivetrain coordinator invite {me} --run-id r" in no_token and "--join-token" in no_token
    assert "--identity-path" in no_token
    expired = decide_membership(me, _token(coordinator, me, days=1), policy, NOW + 2 * DAY_S)
    text = refusal_message(expired, "r", me, identity_hint="--identity-path id.key")
    assert "expired at" in text and time.strftime("%Y-%m-%d", time.gmtime(NOW + DAY_S)) in text
    assert "new one" in text
    other = _key()
    wrong_peer = refusal_message(decide_membership(me, _token(coordinator, other.peer_id), policy, NOW), "r", me)
    assert f"issued to {other.peer_id}, not to {me}" in wrong_peer
    listed = AdmissionPolicy("r", "allowlist", allowlist=frozenset({other.peer_id}))
    text = refusal_message(decide_membership(me, "", listed, NOW), "r", me)
    assert "allowlist" in text and me in text


def test_a_policy_refuses_bad_peer_ids_and_token_mode_without_issuer():
    with pytest.raises(ValueError, match="not a valid base58 peer ID"):
        AdmissionPolicy("r", "allowlist", allowlist=frozenset({"0OIl"}))
    with pytest.raises(ValueError, match="needs the token issuer"):
        AdmissionPolicy("r", "token")


def test_the_run_config_section_is_validated():
    assert RunConfig().admission.mode == "open"
    with pytest.raises(ValueError, match=r"admission.allowlist\[1\]: 'bad' is not a valid base58 peer ID"):
        RunConfig.from_dict({"admission": {"mode": "allowlist", "allowlist": [_key().peer_id, "bad"]}})
    with pytest.raises(ValueError, match="admission.mode = 'allowlist' with an empty admission.allowlist"):
        RunConfig.from_dict({"admission": {"mode": "allowlist"}})
    with pytest.raises(ValueError, match="admission.colour: unknown key"):
        RunConfig.from_dict({"admission": {"colour": "red"}})


def test_the_roster_learns_members_from_records_and_forgets_expired_tokens(coordinator, volunteer):
    now = [NOW]
    policy = AdmissionPolicy("r", "token", issuer=coordinator.peer_id)
    roster = MemberRoster(policy, clock=lambda: now[0])
    stranger = _key()
    records = [
        peer_record(volunteer.peer_id, join_token=_token(coordinator, volunteer.peer_id, days=1)),
        peer_record(stranger.peer_id, join_token=_token(stranger, stranger.peer_id)),  # self-signed: refused
    ]
    assert not roster.admits(volunteer.peer_id)  # nothing learned yet
    roster.follow(lambda: records)
    now[0] += 1  # the pull is rate-limited from the last one
    assert roster.admits(volunteer.peer_id) and roster.admits(coordinator.peer_id)
    assert not roster.admits(stranger.peer_id)
    now[0] = NOW + 2 * DAY_S
    assert roster.check(volunteer.peer_id).cause == "expired"
    assert MemberRoster(AdmissionPolicy("r")).admits(stranger.peer_id)  # open runs admit anyone


# ---- the DHT record guard --------------------------------------------------------------------------------------------
def test_the_record_guard_checks_membership_at_the_records_own_time(coordinator):
    member, outsider = _signer(), _signer()
    policy = AdmissionPolicy("r", "token", issuer=coordinator.peer_id)
    token = make_token(coordinator.key, "r", member.peer_id, NOW - DAY_S, NOW + DAY_S)

    def verdict(signer, expiration=NOW + 30, now=NOW, **fields):
        value = MSGPackSerializer.dumps(_peer(signer, **fields))
        return check_record("peer", "r", signer.marker, value, expiration, now, RecordBounds(), policy)

    assert verdict(member, join_token=token).ok
    assert _check("peer", _peer(outsider), outsider.marker).ok  # without a policy: open
    refused = verdict(outsider)
    assert (refused.ok, refused.rule) == (False, "member") and "presents no join token" in refused.reason
    stolen = verdict(outsider, join_token=token)  # another peer's token is useless
    assert not stolen.ok and "issued to" in stolen.reason
    # judged at updated_at, not now: a record accepted once stays accepted while it lives (whole dictionaries are
    # dropped by readers when one record fails)
    assert verdict(member, join_token=token, now=NOW + DAY_S + 20).ok
    late = verdict(member, join_token=token, updated_at=NOW + DAY_S + 1, expiration=NOW + DAY_S + 31, now=NOW + DAY_S)
    assert not late.ok and "expired" in late.reason
    outliving = verdict(
        member, join_token=token, updated_at=NOW + DAY_S - 10, expiration=NOW + DAY_S + 120, now=NOW + DAY_S
    )  # skew allowance is 60 s
    assert not outliving.ok and "after its token" in outliving.reason


def test_an_honest_node_drops_a_non_members_record(coordinator):
    member, outsider, host = _signer(), _signer(), _signer()
    now = time.time()
    policy = AdmissionPolicy("r", "token", issuer=coordinator.peer_id)
    honest = _node_validator(host, RecordGuard(run_ids=("r",), clock=lambda: now))
    token = make_token(coordinator.key, "r", member.peer_id, now - 10, now + DAY_S)
    good = _signed(member, peers_key("r"), _peer(member, updated_at=now, join_token=token), now + 30)
    bad = _signed(outsider, peers_key("r"), _peer(outsider, updated_at=now), now + 30)
    assert honest.validate(good) and honest.validate(bad)  # no policy yet: an open run
    honest.extend([RecordGuard(admission=(policy,))])  # what PeerNode.guard_run does once the run's policy is known
    assert honest.validate(good) and not honest.validate(bad)


def test_a_revocation_voids_the_tokens_issued_before_it_and_not_later_ones():
    issuer = _key()
    peer = _key()
    policy = AdmissionPolicy("r", "token", issuer=issuer.peer_id)
    old = make_token(issuer.key, "r", peer.peer_id, 1000.0, 9000.0)
    new = make_token(issuer.key, "r", peer.peer_id, 2001.0, 9000.0)
    revoked = revocation_list([(peer.peer_id, 2000.0), ("not a peer id", 5.0), (issuer.peer_id, float("nan"))])
    assert revoked == {peer.peer_id: 2000.0}
    refusal = decide_membership(peer.peer_id, old, policy, 3000.0, revoked)
    assert not refusal.ok and refusal.cause == "revoked" and "revoked by the run's operator" in refusal.reason
    assert "ask the run's operator for a new token" in refusal_message(refusal, "r", peer.peer_id)
    assert decide_membership(peer.peer_id, new, policy, 3000.0, revoked).ok
    assert decide_membership(peer.peer_id, old, policy, 3000.0).ok  # without the list


def test_the_roster_follows_the_issuers_newest_revocation_list_only():
    issuer, peer, impostor = _key(), _key(), _key()
    policy = AdmissionPolicy("r", "token", issuer=issuer.peer_id)
    clock = [1500.0]
    roster = MemberRoster(policy, clock=lambda: clock[0])
    token = make_token(issuer.key, "r", peer.peer_id, 1000.0, 9000.0)
    member = peer_record(peer.peer_id, join_token=token, updated_at=1500.0)
    revoking = peer_record(issuer.peer_id, role="coordinator", updated_at=1600.0, revoked=((peer.peer_id, 1500.0),))
    roster.observe([member, peer_record(impostor.peer_id, updated_at=1600.0, revoked=((peer.peer_id, 1500.0),))])
    assert roster.admits(peer.peer_id), "only the issuer's record carries the list"
    roster.observe([member, revoking])
    assert roster.check(peer.peer_id).cause == "revoked"
    roster.observe([member, peer_record(issuer.peer_id, role="coordinator", updated_at=1550.0)])
    assert roster.check(peer.peer_id).cause == "revoked", "an older copy of the issuer's record undoes nothing"
    roster.observe([member, peer_record(issuer.peer_id, role="coordinator", updated_at=1700.0)])
    assert roster.admits(peer.peer_id), "the issuer took it back"
