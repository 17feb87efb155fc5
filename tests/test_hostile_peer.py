"""The chaos harness's peer (``hivetrain.testing.hostile_peer``): what it changes in ``join-swarm``, in-process."""

from types import SimpleNamespace

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from hivetrain.cli import join_swarm
from hivetrain.config import load_run_config
from hivetrain.peers.identity import peer_id_of_public_key
from hivetrain.peers.membership import NotAdmitted
from hivetrain.testing import hostile_peer


def _peer_id() -> str:
    return peer_id_of_public_key(RSAPrivateKey().get_public_key().to_bytes())


def test_an_uninvited_peer_joins_an_invite_only_run_without_a_roster_where_join_swarm_refuses(caplog):
    config = load_run_config(None, {"run_id": "r", "admission.mode": "token", "admission.issuer": _peer_id()})
    args = SimpleNamespace(join_token="", identity_path="")
    node = SimpleNamespace(peer_id=_peer_id())
    with pytest.raises(NotAdmitted):
        join_swarm.join_admission(args, node, config, "")
    token, roster = hostile_peer._ignoring_refusal(join_swarm.join_admission)(args, node, config, "")
    assert (token, roster) == ("", None)  # no roster: it groups with, connects to and serves anyone
    assert "ignoring our admission" in caplog.text


def test_in_an_open_run_the_uninvited_mode_changes_nothing():
    config = load_run_config(None, {"run_id": "r"})
    args = SimpleNamespace(join_token="t", identity_path="")
    node = SimpleNamespace(peer_id=_peer_id())
    assert hostile_peer._ignoring_refusal(join_swarm.join_admission)(args, node, config, "") == ("t", None)


def test_a_natd_peer_listens_where_it_is_told_and_announces_the_undialable_host():
    args = join_swarm.build_parser().parse_args(["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--config", "x.toml"])
    assert join_swarm.data_plane_hosts(args) == ("127.0.0.1", None)
    assert hostile_peer._announcing(join_swarm.data_plane_hosts, "192.0.2.1")(args) == ("127.0.0.1", "192.0.2.1")


def test_a_bad_harness_flag_is_one_error_line_with_exit_2(capsys):
    assert hostile_peer.main(["--byzantine", "no_such_mode", "--config", "x.toml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown byzantine mode 'no_such_mode'") and err.count("\n") == 1
