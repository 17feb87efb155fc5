"""The issuer's revocation list (issue 28): ``hivetrain coordinator revoke`` writes it atomically, the coordinator
publishes it in its record at every refresh, a damaged file never reinstates anyone."""

import json

import pytest

from hivetrain.cli.coordinator import main as coordinator_main
from hivetrain.coordinator.revocations import (
    RevocationFile,
    RevocationsError,
    load_revocations,
    revoke,
)
from hivetrain.peers.membership import MAX_REVOKED

PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
OTHER = "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"


def test_revoke_adds_to_the_list_and_keeps_the_later_time(tmp_path):
    path = tmp_path / "sub" / "revoked.json"
    assert load_revocations(path) == {}
    assert revoke(path, PEER, 100.0) == {PEER: 100.0}
    assert revoke(path, OTHER, 50.0) == {PEER: 100.0, OTHER: 50.0}
    assert revoke(path, PEER, 90.0)[PEER] == 100.0
    assert load_revocations(path) == {PEER: 100.0, OTHER: 50.0}
    assert [p.name for p in path.parent.iterdir()] == ["revoked.json"], "no temporary file left behind"


@pytest.mark.parametrize(
    "body, message",
    [
        ("{not json", "cannot read the revocation list"),
        ('{"revoked": 3}', "is no revocation list"),
        ('{"revoked": [{"peer_id": "nope", "revoked_at": 1.0}]}', "entry 0"),
        (json.dumps({"revoked": [{"peer_id": PEER, "revoked_at": "soon"}]}), "is not a unix time"),
        (json.dumps({"revoked": [{"peer_id": PEER, "revoked_at": 1.0}] * (MAX_REVOKED + 1)}), "allowlist"),
    ],
)
def test_a_damaged_list_is_refused_naming_the_file(tmp_path, body, message):
    path = tmp_path / "revoked.json"
    path.write_text(body)
    with pytest.raises(RevocationsError, match=message) as caught:
        load_revocations(path)
    assert str(path) in str(caught.value) or "entry" in str(caught.value)
    with pytest.raises(RevocationsError):
        revoke(path, OTHER, 1.0)
    assert path.read_text() == body, "a refused revoke loses nothing"


def test_the_published_list_follows_the_file_and_a_damaged_file_keeps_the_last_good_one(tmp_path):
    path = tmp_path / "revoked.json"
    published = RevocationFile(path)
    assert published.current() == ()
    revoke(path, PEER, 100.0)
    assert published.current() == ((PEER, 100.0),)
    path.write_text('{"revoked": [')  # an operator's typo: the revoked peer must stay revoked
    assert published.current() == ((PEER, 100.0),)
    revoke_path = tmp_path / "fresh.json"
    revoke(revoke_path, OTHER, 5.0)
    revoke_path.replace(path)
    assert published.current() == ((OTHER, 5.0),)


@pytest.mark.slow
def test_the_coordinator_publishes_its_list_in_its_record(make_node, tmp_path):
    from hivetrain.config import RunConfig
    from hivetrain.coordinator.coordinator import Coordinator, CoordinatorOptions
    from hivetrain.peers.records import fetch_records

    coord = make_node()
    reader = make_node(coord.visible_maddrs())
    path = tmp_path / "revoked.json"
    options = CoordinatorOptions(run_clock_path=tmp_path / "clock.json", revocations_path=path)
    coordinator = Coordinator(coord, RunConfig(run_id="rev"), "fp", options)
    coordinator.publish()
    assert [r.revoked for r in fetch_records(reader.dht, "rev")] == [()]
    revoke(path, PEER, 123.0)
    coordinator.publish()  # the next refresh
    assert [r.revoked for r in fetch_records(reader.dht, "rev")] == [((PEER, 123.0),)]


def test_the_revoke_command_writes_the_default_list_and_refuses_a_bad_peer_id(tmp_path, capsys):
    identity = tmp_path / "coordinator.key"
    assert coordinator_main(["revoke", PEER, "--identity-path", str(identity)]) == 0
    assert load_revocations(tmp_path / "coordinator.key.revoked.json").keys() == {PEER}
    assert "publishes the list at its next refresh" in capsys.readouterr().err
    assert coordinator_main(["revoke", "not-a-peer", "--identity-path", str(identity)]) == 2
    err = capsys.readouterr().err
    assert "peer ID" in err and "Traceback" not in err
