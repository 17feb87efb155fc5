"""Admission on real peers (127.0.0.1): in an invite-only run, honest DHT nodes drop a non-member's record while a
member's (with its coordinator-signed token) is read everywhere; ``join-swarm`` refuses to join without a valid
token, at once, saying why and what to do."""

import os
import subprocess
import sys
import time

from hivetrain.peers.identity import load_or_create_identity
from hivetrain.peers.membership import AdmissionPolicy, make_token
from hivetrain.peers.records import fetch_records, peers_key, publish_record
from tests.peers.guardless import guardless_node
from tests.records import peer_record


def test_a_non_members_record_is_dropped_by_every_honest_node(make_node, tmp_path):
    coordinator = make_node(name="coordinator")
    member = make_node(coordinator.visible_maddrs(), name="member")
    policy = AdmissionPolicy("r", "token", issuer=coordinator.peer_id)
    now = time.time()
    token = make_token(coordinator.identity.private_key, "r", member.peer_id, now - 1, now + 3600)
    for node in (coordinator, member):
        node.guard_run("r", admission=policy)
    own = peer_record(coordinator.peer_id, updated_at=now)
    assert publish_record(coordinator.dht, coordinator.owner_marker, own, 30)
    invited = peer_record(member.peer_id, join_token=token, updated_at=now)
    assert publish_record(member.dht, member.owner_marker, invited, 30)

    outsider, identity = guardless_node(tmp_path / "outsider.key", coordinator.visible_maddrs())
    try:
        for join_token in ("", token):  # no token, then the member's token (stolen: it names another peer ID)
            record = peer_record(identity.peer_id, updated_at=time.time(), join_token=join_token)
            value, expiration = record.model_dump(mode="json"), time.time() + 30
            outsider.store(peers_key("r"), value, expiration, subkey=identity.owner_marker)
            for node in (coordinator, member):
                assert {r.peer_id for r in fetch_records(node.dht, "r")} == {coordinator.peer_id, member.peer_id}
    finally:
        outsider.shutdown()


def _join(tmp_path, *extra, timeout_s=90):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "hivetrain.cli.join_swarm", "--config", str(tmp_path / "run.toml"),
           "--identity-path", str(tmp_path / "volunteer.key"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
           "--device", "cpu", *extra]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    return done.returncode, done.stderr, time.monotonic() - started


def test_join_swarm_refuses_a_peer_without_a_valid_token_and_says_what_to_do(tmp_path):
    issuer = load_or_create_identity(tmp_path / "coordinator.key")
    volunteer = load_or_create_identity(tmp_path / "volunteer.key")
    (tmp_path / "run.toml").write_text(f'run_id = "closed"\n[admission]\nmode = "token"\nissuer = "{issuer.peer_id}"\n')
    code, err, _ = _join(tmp_path)
    assert code == 3, err
    assert f"run 'closed' admits only invited peers; your peer ID is {volunteer.peer_id}" in err
    assert f"hivetrain coordinator invite {volunteer.peer_id} --run-id closed" in err

    now = time.time()
    expired = make_token(issuer.private_key, "closed", volunteer.peer_id, now - 7200, now - 3600)
    (tmp_path / "token.txt").write_text(expired + "\n")
    code, err, _ = _join(tmp_path, "--join-token", f"@{tmp_path / 'token.txt'}")
    assert code == 3 and "the join token expired at" in err and "new one" in err, err
