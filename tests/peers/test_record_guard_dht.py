"""RecordGuard on real DHT nodes (127.0.0.1): a hostile record is neither stored nor read by honest nodes, and its
owner's later sane record is."""

import time

import pytest

from hivetrain.peers.records import PeerRecord, fetch_records, peers_key, publish_record
from tests.peers.guardless import guardless_node


def _record(peer_id: str, epoch: int) -> PeerRecord:
    return PeerRecord(
        peer_id=peer_id,
        role="trainer",
        version="0.1.0",
        run_id="r",
        model_fingerprint="f",
        epoch=epoch,
        throughput=1.0,
        updated_at=time.time(),
    )


@pytest.mark.slow
def test_a_hostile_record_is_dropped_by_every_honest_node(make_node, tmp_path):
    a = make_node()
    b = make_node(a.visible_maddrs())
    for node in (a, b):
        node.guard_run("r")
        assert publish_record(node.dht, node.owner_marker, _record(node.peer_id, 5), 30)

    # the attacker stores the issue-12 freeze record
    attacker, mallory = guardless_node(tmp_path / "mallory.key", a.visible_maddrs())
    hostile = _record(mallory.peer_id, 10**9).model_dump(mode="json")
    try:
        # stored on its own node only; a and b refuse it (the attacker's store reports its local copy)
        attacker.store(peers_key("r"), hostile, time.time() + 1e9, subkey=mallory.owner_marker)
        assert attacker.get(peers_key("r"), latest=False).value[mallory.owner_marker].value["epoch"] == 10**9
        for node in (a, b):  # while it is up: honest readers drop what it returns
            assert {r.peer_id: r.epoch for r in fetch_records(node.dht, "r")} == {a.peer_id: 5, b.peer_id: 5}
    finally:
        attacker.shutdown()

    for node in (a, b):  # after it left: nothing of it is left anywhere
        assert mallory.peer_id not in {r.peer_id for r in fetch_records(node.dht, "r")}
    owner = make_node(a.visible_maddrs(), name="mallory")  # the same identity, now honest: not shadowed
    assert owner.peer_id == mallory.peer_id
    owner.guard_run("r")
    assert publish_record(owner.dht, owner.owner_marker, _record(owner.peer_id, 5), 30)
    assert {r.peer_id: r.epoch for r in fetch_records(a.dht, "r")} == {
        p: 5 for p in (a.peer_id, b.peer_id, owner.peer_id)
    }
