"""RecordGuard: each rule accepts a good record and refuses the bad ones (pure, time injected), the guard chained after
hivemind's signature validator as a DHT node chains it, and the issue-12 freeze replayed on a real storage."""

import dataclasses
import time

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.storage import DHTLocalStorage
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey

from hivetrain.averaging.group_records import GroupDeclaration, ReadyEntry, make_round_id
from hivetrain.peers.identity import peer_id_of_owner
from hivetrain.peers.records import RUN_CONFIG_KEY, RunConfigRecord, peers_key
from hivetrain.peers.validators import RecordBounds, RecordGuard, check_record, key_id
from hivetrain.swarm.announce import StageRecord
from tests.records import peer_record, ready_entry

NOW = 1_800_000_000.0
BOUNDS = RecordBounds()


@dataclasses.dataclass(frozen=True)
class Signer:
    key: RSAPrivateKey
    marker: bytes
    peer_id: str


def _signer() -> Signer:
    key = RSAPrivateKey()
    marker = RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", key.get_public_key().to_bytes())
    return Signer(key, marker, peer_id_of_owner(marker))


def _peer(signer: Signer, **fields) -> dict:
    """A good record's JSON with ``fields`` set raw (so a test can break the schema)."""
    return {**peer_record(signer.peer_id, epoch=5, updated_at=NOW).model_dump(mode="json"), **fields}


def _check(kind, value: dict, subkey: bytes, expiration: float = NOW + 30, run_id: str = "r", now: float = NOW):
    return check_record(kind, run_id, subkey, MSGPackSerializer.dumps(value), expiration, now, BOUNDS)


def _entry(signer: Signer, **fields) -> ReadyEntry:
    return ready_entry(signer.key, signer.peer_id, **{"announced_at": NOW, **fields})


def test_a_good_record_of_each_kind_is_accepted(alice):
    assert _check("peer", _peer(alice), alice.marker).ok
    stage = StageRecord(
        peer_id=alice.peer_id, run_id="r", model_fingerprint="f", stage=0, num_stages=2, throughput=1.0, updated_at=NOW
    )
    assert _check("stage", stage.model_dump(mode="json"), alice.marker).ok
    config = RunConfigRecord(
        run_config={"run_id": "r"}, version="0.1.0", coordinator_id=alice.peer_id, published_at=NOW
    )
    assert _check("run_config", config.model_dump(mode="json"), alice.marker, expiration=NOW + 3600).ok
    entry = _entry(alice)
    assert _check("ready", entry.model_dump(), alice.marker + b"|ready", expiration=NOW + 60).ok
    decl = GroupDeclaration(
        leader=alice.peer_id,
        round_key="7",
        round_id=make_round_id("p", "7", [entry]),
        members=(entry,),
        declared_at=NOW,
        reason="window",
    )
    assert _check("group", decl.model_dump(), alice.marker + b"|group", expiration=NOW + 60).ok


@pytest.mark.parametrize(
    "fields, expiration, rule",
    [
        (dict(epoch=10**9), NOW + 30, "epoch"),
        (dict(phase_epoch=10**6 + 1), NOW + 30, "epoch"),
        (dict(done_epoch=10**7), NOW + 30, "epoch"),
        ({}, NOW + 10**9, "expiration"),  # the issue-12 freeze: kept forever
        ({}, NOW + BOUNDS.max_record_ttl_s + BOUNDS.max_clock_skew_s + 1, "expiration"),
        (dict(updated_at=NOW + BOUNDS.max_clock_skew_s + 1), NOW + 30, "time"),  # from the future
        (dict(updated_at=NOW - 10**6), NOW + 30, "time"),  # claims to be older than any record lives
        (dict(run_id="other"), NOW + 30, "run"),
        (dict(public_name="x" * 65), NOW + 30, "schema"),
        (dict(maddrs=("/ip4/1.2.3.4/tcp/1" + "0" * 20_000,)), NOW + 30, "size"),
    ],
)
def test_a_bad_peer_record_is_refused_by_its_rule(alice, fields, expiration, rule):
    verdict = _check("peer", _peer(alice, **fields), alice.marker, expiration=expiration)
    assert (verdict.ok, verdict.rule) == (False, rule), verdict.reason


def test_the_bounds_sit_at_the_edges(alice):
    skew, ttl = BOUNDS.max_clock_skew_s, BOUNDS.max_record_ttl_s
    assert _check("peer", _peer(alice, epoch=BOUNDS.max_epoch), alice.marker).ok
    assert _check("peer", _peer(alice, updated_at=NOW + skew), alice.marker, expiration=NOW + skew + 30).ok
    assert _check("peer", _peer(alice), alice.marker, expiration=NOW + ttl + skew).ok


def test_one_record_per_peer_per_key(alice, mallory):
    """The subkey is the signer's bare marker and the record speaks for the signer only."""
    assert _check("peer", _peer(alice), mallory.marker).rule == "signer"  # mallory signs alice's record
    assert _check("peer", _peer(alice), alice.marker + b"|2").rule == "subkey"  # a second record of alice
    assert _check("peer", _peer(alice), b"alice").rule == "subkey"  # not signed at all
    assert _check("peer", _peer(alice), None).rule == "subkey"  # a regular value, no subkey
    assert _check("ready", _entry(alice).model_dump(), alice.marker).rule == "subkey"


def test_a_malformed_value_is_refused(alice):
    bad = [b"\xc1", MSGPackSerializer.dumps([1, 2]), MSGPackSerializer.dumps({**_peer(alice), "extra": 1})]
    for value in bad:
        verdict = check_record("peer", "r", alice.marker, value, NOW + 30, NOW, BOUNDS)
        assert verdict.rule == "schema", verdict.reason


def test_matchmaking_records_are_bounded_too(alice, mallory):
    marker = alice.marker + b"|ready"
    assert _check("ready", _entry(alice).model_dump(), marker, expiration=NOW + 10**9).rule == "expiration"
    assert _check("ready", _entry(alice, deadline=NOW + 10**6).model_dump(), marker, expiration=NOW + 60).rule == "time"
    assert _check("ready", _entry(mallory).model_dump(), marker, expiration=NOW + 60).rule == "signer"
    entry = _entry(alice)
    decl = GroupDeclaration(
        leader=alice.peer_id,
        round_key="8",  # the member's entry is for round key 7
        round_id=make_round_id("p", "8", [entry]),
        members=(entry,),
        declared_at=NOW,
        reason="full",
    )
    assert _check("group", decl.model_dump(), alice.marker + b"|group", expiration=NOW + 60).rule == "schema"


def test_bounds_are_checked():
    with pytest.raises(ValueError, match="max_epoch"):
        RecordBounds(max_epoch=0)


# ---- the guard as a DHT node chains it ---------------------------------------------------------------------------


def _node_validator(signer: Signer, guard: RecordGuard) -> CompositeValidator:
    """The validators of a node running under ``signer`` (as ``start_node`` registers them)."""
    return CompositeValidator([RSASignatureValidator(signer.key), guard])


def _signed(signer: Signer, key: str, value, expiration: float, subkey: bytes | None = None) -> DHTRecord:
    subkey = signer.marker if subkey is None else subkey
    record = DHTRecord(key_id(key), MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), expiration)
    return dataclasses.replace(record, value=_node_validator(signer, RecordGuard()).sign_value(record))


def test_the_guard_runs_after_the_signature_check(alice, mallory):
    now = time.time()
    honest = _node_validator(mallory, RecordGuard(run_ids=("r",), clock=lambda: now))
    good = _signed(alice, peers_key("r"), _peer(alice, updated_at=now), now + 30)
    assert honest.validate(good)
    assert not honest.validate(_signed(alice, peers_key("r"), _peer(alice, updated_at=now, epoch=10**9), now + 30))
    forged = dataclasses.replace(good, value=good.value.replace(b"\x05", b"\x06", 1))  # epoch 5 -> 6 after signing
    assert not honest.validate(forged)
    # a run the guard was not told about, and other hivemind users' keys, pass unchanged
    assert honest.validate(_signed(alice, peers_key("other-run"), _peer(alice, epoch=10**9), now + 10**9))
    assert honest.validate(_signed(alice, "someone.else", {"anything": 1}, now + 10**9, subkey=b"sub"))
    # the run config key is always known; matchmaking records are known under any key by their subkey
    config = RunConfigRecord(run_config={}, version="0.1.0", coordinator_id=alice.peer_id, published_at=now)
    assert not honest.validate(_signed(alice, RUN_CONFIG_KEY, config.model_dump(mode="json"), now + 10**9))
    entry = _entry(alice, announced_at=now, deadline=now + 5).model_dump()
    assert honest.validate(_signed(alice, "p.7.mm", entry, now + 60, subkey=alice.marker + b"|ready"))
    assert not honest.validate(_signed(alice, "p.7.mm", entry, now + 10**9, subkey=alice.marker + b"|ready"))


def test_guards_merge_their_runs():
    now = time.time()
    guard = RecordGuard(run_ids=("a",), clock=lambda: now)
    composite = CompositeValidator([RSASignatureValidator(RSAPrivateKey()), guard])
    composite.extend([RecordGuard(run_ids=("b",))])  # what PeerNode.guard_run does in the DHT process
    assert len(composite._validators) == 2 and guard.kind_of(
        DHTRecord(key_id(peers_key("b")), MSGPackSerializer.dumps(None), b"", now)
    ) == ("peer", "b")


def _store(validator: CompositeValidator, storage: DHTLocalStorage, record: DHTRecord) -> bool:
    """What a DHT node does with a store request (``DHTProtocol.rpc_store``)."""
    if not validator.validate(record):
        return False
    subkey = MSGPackSerializer.loads(record.subkey)
    return storage.store_subkey(key_id(peers_key("r")), subkey, record.value, record.expiration_time)


def test_the_owner_can_refresh_after_a_far_future_attempt(alice, mallory):
    """Issue 12: one record with expiration now + 1e9 s was kept forever and shadowed the owner's own refresh."""
    now = time.time()
    hostile = _signed(mallory, peers_key("r"), _peer(mallory, updated_at=now, epoch=10**9), now + 10**9)
    later = now + 1
    refresh = _signed(mallory, peers_key("r"), _peer(mallory, updated_at=later), later + 30)

    unguarded, storage = CompositeValidator([RSASignatureValidator(alice.key)]), DHTLocalStorage()
    assert _store(unguarded, storage, hostile) and not _store(unguarded, storage, refresh)  # the bug, as filed

    guarded = _node_validator(alice, RecordGuard(run_ids=("r",), clock=lambda: now))
    storage = DHTLocalStorage()
    assert not _store(guarded, storage, hostile)
    assert _store(guarded, storage, refresh)
    stored = storage.get(key_id(peers_key("r"))).value
    assert [item.expiration_time for _, item in stored.items()] == [later + 30]
