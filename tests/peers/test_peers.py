"""Peers: persistent identity, bounded bootstrap failure, signed records that cannot be forged."""

import time

import pytest
import torch

from hivetrain.diloco.drift import SKETCH_SIZE, encode_sketch, sketch_to_text
from hivetrain.peers.identity import load_or_create_identity, peer_id_of_owner
from hivetrain.peers.node import BootstrapFailed, NodeConfig, ip_of, start_node, trusted_ids
from hivetrain.peers.records import (
    PeerRecord,
    RunConfigRecord,
    check_compatible,
    fetch_records,
    fetch_run_config,
    publish_record,
    publish_run_config,
)


def test_identity_persists_and_signs_as_its_peer_id(tmp_path):
    a = load_or_create_identity(tmp_path / "id.key")
    b = load_or_create_identity(tmp_path / "id.key")
    assert a.peer_id == b.peer_id
    assert peer_id_of_owner(a.owner_marker) == a.peer_id
    (tmp_path / "bad.key").write_bytes(b"not a key")
    with pytest.raises(ValueError, match="not a valid identity"):
        load_or_create_identity(tmp_path / "bad.key")


@pytest.mark.slow
def test_node_keeps_its_peer_id_across_restarts(make_node, tmp_path):
    first = make_node(name="same")
    peer_id = first.peer_id
    first.shutdown()
    assert make_node(name="same").peer_id == peer_id


@pytest.mark.slow
def test_unreachable_bootstrap_fails_fast_with_addresses_named():
    bogus = "/ip4/127.0.0.1/tcp/9/p2p/QmZaPV7t8Ru4TUBX6qryUsdLzF6JuQCx8oH3c9xuuuBkGm"
    started = time.monotonic()
    with pytest.raises(BootstrapFailed) as info:
        start_node(NodeConfig(initial_peers=(bogus,), host_maddrs=("/ip4/127.0.0.1/tcp/0",), startup_timeout_s=20))
    assert time.monotonic() - started < 25
    assert bogus in str(info.value) and "Check that" in str(info.value)


@pytest.mark.parametrize("addr, match", [("garbage", "not a valid multiaddr"), ("/ip4/1.2.3.4/tcp/5", "peer ID")])
def test_malformed_initial_peer_is_a_value_error(addr, match):
    with pytest.raises(ValueError, match=match):
        NodeConfig(initial_peers=(addr,))


def _record(node, **kw):
    fields = dict(
        peer_id=node.peer_id,
        role="trainer",
        version="0.1.0",
        run_id="r",
        model_fingerprint="f",
        epoch=1,
        throughput=2.0,
        updated_at=time.time(),
    )
    fields.update(kw)
    return PeerRecord(**fields)


@pytest.mark.slow
def test_records_are_signed_and_forgeries_dropped(make_node):
    a = make_node()
    b = make_node(a.visible_maddrs())
    sketch = sketch_to_text(encode_sketch(torch.randn(SKETCH_SIZE)))  # binary data travels as base64 text
    assert publish_record(a.dht, a.owner_marker, _record(a, param_sketch=sketch), 30)
    assert publish_record(b.dht, b.owner_marker, _record(b), 30)
    records = {r.peer_id: r for r in fetch_records(a.dht, "r")}
    assert set(records) == {a.peer_id, b.peer_id} and records[a.peer_id].param_sketch == sketch
    # b claims to be a, signing with its own key (replacing its own entry): readers drop the forgery
    publish_record(b.dht, b.owner_marker, _record(b, peer_id=a.peer_id, model_fingerprint="evil"), 30)
    records = fetch_records(a.dht, "r")
    assert [(r.peer_id, r.model_fingerprint) for r in records] == [(a.peer_id, "f")]


@pytest.mark.slow
def test_run_config_accepted_only_from_trusted_signer(make_node):
    coord = make_node()
    other = make_node(coord.visible_maddrs())
    now = time.time()
    publish_run_config(
        coord.dht,
        coord.owner_marker,
        RunConfigRecord(run_config={"run_id": "x"}, version="0.1.0", coordinator_id=coord.peer_id, published_at=now),
        60,
    )
    publish_run_config(
        other.dht,
        other.owner_marker,
        RunConfigRecord(
            run_config={"run_id": "evil"}, version="0.1.0", coordinator_id=other.peer_id, published_at=now + 1
        ),
        60,
    )
    trusted = trusted_ids(tuple(coord.visible_maddrs()))
    assert trusted == {coord.peer_id}
    assert fetch_run_config(other.dht, trusted).run_config == {"run_id": "x"}


def test_compatibility_checks_name_the_difference():
    rec = PeerRecord(
        peer_id="p",
        role="trainer",
        version="0.1.3",
        run_id="r",
        model_fingerprint="abc",
        epoch=0,
        throughput=0,
        updated_at=0,
    )
    assert check_compatible(rec, "r", "abc")[0]
    ok, reason = check_compatible(rec, "r", "xyz")
    assert not ok and "different model" in reason
    ok, reason = check_compatible(rec.model_copy(update={"version": "0.2.0"}), "r", "abc")
    assert not ok and "incompatible" in reason


@pytest.mark.parametrize(
    "maddr, host",
    [
        ("/ip4/203.0.113.5/tcp/31337/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "203.0.113.5"),
        ("/ip4/0.0.0.0/tcp/0", "0.0.0.0"),
        ("/ip6/::1/tcp/5", "::1"),
        ("/dns4/example.org/tcp/1", None),
        ("not a multiaddr", None),
    ],
)
def test_ip_of_reads_the_address_of_a_multiaddr(maddr, host):
    assert ip_of(maddr) == host
