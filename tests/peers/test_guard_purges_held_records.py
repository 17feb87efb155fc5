"""A record a node took before it knew the run's admission policy must not outlive the guard (chaos scenario
uninvited-peer: a joiner's DHT node held the uninvited peer's record, stored into it in the seconds between its
start and ``guard_run``, and its swarm view counted the non-member until the record expired)."""

import time

import pytest

from hivetrain.peers.membership import AdmissionPolicy, make_token
from hivetrain.peers.records import fetch_records, peers_key, publish_record
from tests.peers.guardless import guardless_node
from tests.records import peer_record


@pytest.mark.slow
def test_guard_run_drops_the_non_member_records_the_node_already_holds(make_node, tmp_path):
    coordinator = make_node(name="coordinator")
    joiner = make_node(coordinator.visible_maddrs(), name="joiner")  # no guard yet: it has not read the policy
    policy = AdmissionPolicy("r", "token", issuer=coordinator.peer_id)
    coordinator.guard_run("r", admission=policy)  # as the coordinator does at start
    now = time.time()
    token = make_token(coordinator.identity.private_key, "r", joiner.peer_id, now - 1, now + 3600)
    assert publish_record(
        joiner.dht, joiner.owner_marker, peer_record(joiner.peer_id, join_token=token, updated_at=now), 60
    )

    outsider, identity = guardless_node(tmp_path / "outsider.key", joiner.visible_maddrs())
    try:
        record = peer_record(identity.peer_id, updated_at=time.time())
        outsider.store(peers_key("r"), record.model_dump(mode="json"), time.time() + 60, subkey=identity.owner_marker)
        assert identity.peer_id in {r.peer_id for r in fetch_records(joiner.dht, "r")}  # held while unguarded
        outsider.shutdown()  # gone: only what the joiner holds itself could still show it

        joiner.guard_run("r", admission=policy)
        assert {r.peer_id for r in fetch_records(joiner.dht, "r")} == {joiner.peer_id}
    finally:
        outsider.shutdown()
