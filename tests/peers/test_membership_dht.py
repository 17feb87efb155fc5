"""Admission on real peers (127.0.0.1): in an invite-only run, honest DHT nodes drop a non-member's record while a
member's (with its coordinator-signed token) is read everywhere; ``join-swarm`` refuses to join without a valid
token, at once, saying why and what to do."""

import os
import time

import pytest

from hivetrain.localswarm.forkserver import run as run_cli
from hivetrain.peers.identity import load_or_create_identity
from hivetrain.peers.membership import AdmissionPolicy, make_token
from hivetrain.peers.records import fetch_records, peers_key, publish_record
from tests.peers.guardless import guardless_node
from tests.records import peer_record


@pytest.mark.slow
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
    cmd = ["hivetrain.cli.join_swarm", "--config", str(tmp_path / "run.toml"),
           "--identity-path", str(tmp_path / "volunteer.key"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
           "--device", "cpu", *extra]  # fmt: skip
    started = time.monotonic()
    done = run_cli(cmd, timeout_s, env=env)  # forked from the pre-imported fork server
    return done.returncode, done.stderr, time.monotonic() - started


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_revoked_token_is_refused_at_every_honest_node_within_one_record_refresh(make_node):
    """Issue 28: a leaked token must stop working before it expires. The issuer's record carries its revocation list;
    each honest peer's view drops the revoked peer at the first read that carries it (one record refresh), and its
    roster refuses it everywhere it is asked (matchmaking, data plane, state). A token issued later admits it again."""
    from hivetrain.diloco.swarm_view import SwarmView
    from hivetrain.peers.loop import LoopThread
    from hivetrain.peers.membership import MemberRoster

    coordinator = make_node(name="coordinator")
    honest = [make_node(coordinator.visible_maddrs(), name=f"honest{i}") for i in range(2)]
    leaker = make_node(coordinator.visible_maddrs(), name="leaker")
    policy = AdmissionPolicy("r", "token", issuer=coordinator.peer_id)
    key, now = coordinator.identity.private_key, time.time()
    tokens = {n.peer_id: make_token(key, "r", n.peer_id, now - 10, now + 3600) for n in (*honest, leaker)}
    for node in (coordinator, *honest, leaker):
        node.guard_run("r", admission=policy)

    def publish(node, **fields):
        token = tokens.get(node.peer_id, "")
        record = peer_record(node.peer_id, updated_at=time.time(), join_token=token, **fields)
        assert publish_record(node.dht, node.owner_marker, record, 30)

    publish(coordinator, role="coordinator")
    for node in (*honest, leaker):
        publish(node)
    loop = LoopThread()
    try:
        views = []
        for node in honest:
            roster = MemberRoster(policy)
            view = SwarmView(node, loop, "r", "f", lambda: None, record_ttl_s=30, record_interval_s=1, members=roster)
            roster.follow(lambda view=view: view.records)
            views.append((view, roster))
        for view, roster in views:
            assert leaker.peer_id in {r.peer_id for r in view.refresh()} and roster.admits(leaker.peer_id)

        revoked_at = time.time()
        publish(coordinator, role="coordinator", revoked=((leaker.peer_id, revoked_at),))
        for view, roster in views:  # one read
            assert leaker.peer_id not in {r.peer_id for r in view.refresh()}
            refusal = roster.check(leaker.peer_id)
            assert not refusal.ok and refusal.cause == "revoked", refusal
            assert all(roster.admits(n.peer_id) for n in (coordinator, *honest))  # nobody else

        tokens[leaker.peer_id] = make_token(key, "r", leaker.peer_id, revoked_at + 1, revoked_at + 3600)
        publish(leaker)  # invited again after the revocation
        for view, roster in views:
            assert leaker.peer_id in {r.peer_id for r in view.refresh()} and roster.admits(leaker.peer_id)
    finally:
        loop.stop(timeout_s=2)
