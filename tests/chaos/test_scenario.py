"""Scenario files: strict validation with clear errors, and every bundled scenario loads."""

import pytest

from hivetrain.chaos.scenario import bundled_scenarios, load_scenario, parse_scenario, resolve_scenario
from hivetrain.faults import HookPoint

BASE = {
    "name": "t",
    "description": "test scenario",
    "peers": 3,
    "max_duration_s": 100,
    "run": {"diloco": {"inner_steps": 5, "outer_steps": 4}},
}


def scenario_with(*faults, **top):
    return parse_scenario({**BASE, **top, "faults": list(faults)})


def test_valid_scenario_round_trips():
    s = scenario_with(
        {"kind": "kill", "peer": 1, "on_event": "inner_phase", "on_peer": 1, "on_epoch": 2, "delay_s": 0.5},
        {"kind": "join", "count": 2, "at_s": 10},
        {"kind": "kill", "peer": 4, "at_s": 20},  # the second joiner: indices 3 and 4
        {"kind": "hook", "peer": 0, "point": "averaging.mid_transfer", "action": "exit", "when": {"epoch": 2}},
    )
    assert s.num_indexed_peers == 5
    assert s.faults[3].spec() == "averaging.mid_transfer:exit@epoch=2"
    assert s.run_config().diloco.outer_steps == 4


def test_unknown_key_is_rejected_with_its_path():
    with pytest.raises(ValueError, match=r"faults\[0\]\.bogus: unknown key"):
        scenario_with({"kind": "kill", "peer": 1, "at_s": 5, "bogus": 1})
    with pytest.raises(ValueError, match=r"colour: unknown key"):
        scenario_with(colour="red")
    with pytest.raises(ValueError, match=r"diloco\.zzz: unknown key"):
        parse_scenario({**BASE, "run": {"diloco": {"outer_steps": 3, "zzz": 1}}})


def test_fault_past_the_end_is_rejected():
    with pytest.raises(ValueError, match=r"faults\[0\] \(kill\): fires or lasts until 150s, past the end"):
        scenario_with({"kind": "kill", "peer": 1, "at_s": 150})
    # a pause that starts in time but lasts past the end
    with pytest.raises(ValueError, match=r"faults\[0\] \(pause\).*past the end.*max_duration_s = 100"):
        scenario_with({"kind": "pause", "peer": 1, "at_s": 90, "duration_s": 15})


def test_peer_index_out_of_range_is_rejected():
    with pytest.raises(ValueError, match=r"faults\[0\] \(kill\)\.peer = 3: peer index out of range.*0\.\.2"):
        scenario_with({"kind": "kill", "peer": 3, "at_s": 5})
    with pytest.raises(ValueError, match=r"on_peer = 7: peer index out of range"):
        scenario_with({"kind": "kill", "peer": 0, "on_event": "outer_step", "on_peer": 7})
    with pytest.raises(ValueError, match=r"side = 9"):
        scenario_with({"kind": "partition", "side": [9], "at_s": 5, "heal_after_s": 5}, network="netns")


def test_trigger_rules():
    with pytest.raises(ValueError, match="exactly one trigger"):
        scenario_with({"kind": "kill", "peer": 1})
    with pytest.raises(ValueError, match="exactly one trigger"):
        scenario_with({"kind": "kill", "peer": 1, "at_s": 3, "on_event": "outer_step"})
    with pytest.raises(ValueError, match="armed at launch"):
        scenario_with({"kind": "byzantine", "peer": 1, "mode": "nan", "at_s": 3})
    with pytest.raises(ValueError, match="set on_event too"):
        scenario_with({"kind": "kill", "peer": 1, "at_s": 3, "on_epoch": 2})


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match=r"faults\[0\]\.mode"):
        scenario_with({"kind": "byzantine", "peer": 1, "mode": "evil"})
    with pytest.raises(ValueError, match=r"unknown hook point 'averaging\.nowhere'"):
        scenario_with({"kind": "hook", "peer": 0, "point": "averaging.nowhere", "action": "exit"})
    with pytest.raises(ValueError, match=r"does not match any of the expected tags"):
        scenario_with({"kind": "meteor", "at_s": 1})
    with pytest.raises(ValueError, match='needs network = "netns"'):
        scenario_with({"kind": "bandwidth", "peer": 0, "mbps": 10, "at_s": 1})
    with pytest.raises(ValueError, match="outer_steps must be >= 1"):
        parse_scenario({**BASE, "run": {"diloco": {"outer_steps": 0}}})
    with pytest.raises(ValueError, match=r"peers: Input should be greater than or equal to 1"):
        scenario_with(peers=0)


def test_a_hook_fault_names_a_hook_point_of_the_enum_or_is_refused_with_the_valid_ones():
    three_part = scenario_with({"kind": "hook", "peer": 1, "point": "swarm.server.mid_forward", "action": "raise"})
    assert three_part.faults[0].point is HookPoint.SWARM_SERVER_MID_FORWARD
    assert three_part.faults[0].spec() == "swarm.server.mid_forward:raise"
    with pytest.raises(
        ValueError, match=r"faults\[0\]\.point: unknown hook point 'averaging\.bogus'; valid .*averaging\.vote"
    ):
        scenario_with({"kind": "hook", "peer": 1, "point": "averaging.bogus", "action": "raise"})


def test_load_scenario_reports_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('name = "x"\ndescription = "d"\npeers = 2\nmax_duration_s = 10\nwat = 1\n')
    with pytest.raises(ValueError, match=r"bad\.toml: wat: unknown key"):
        load_scenario(path)
    path.write_text("name = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_scenario(path)
    with pytest.raises(FileNotFoundError, match="bundled"):
        resolve_scenario("no-such-scenario")


def test_bundled_scenarios_are_valid_and_cover_the_acceptance_list():
    bundled = bundled_scenarios()
    assert len(bundled) >= 10
    scenarios = {name: load_scenario(path) for name, path in bundled.items()}
    for name, s in scenarios.items():
        assert s.name == name, f"{name}.toml declares name {s.name!r}"
    kinds = {f.kind for s in scenarios.values() for f in s.faults}
    assert {"kill", "pause", "kill_coordinator", "join", "partition", "bandwidth", "churn", "byzantine"} <= kinds
    modes = {f.mode for s in scenarios.values() for f in s.faults if f.kind == "byzantine"}
    assert {"nan", "sign_flip", "epoch_liar", "nan_donor", "drip_donor"} <= modes
    assert {"forge_record", "flood"} <= kinds  # issue 12's attacks


def test_adversary_and_latency_need_loopback():
    with pytest.raises(ValueError, match='needs network = "loopback"'):
        scenario_with({"kind": "adversary", "peer": 0, "at_s": 1, "duration_s": 5}, network="netns")
    s = scenario_with({"kind": "adversary", "peer": 0, "at_s": 1, "duration_s": 5})
    assert s.faults[0].busy_s() == 5


def test_attack_faults_and_requirements_of_issue_12():
    s = scenario_with(
        {"kind": "forge_record", "on_event": "outer_step", "on_epoch": 2},
        {"kind": "flood", "peer": 0, "at_s": 5, "duration_s": 30},
        {"kind": "join", "at_s": 10},
        every_peer_commits=True,
        max_join_download_s=15,
    )
    forge, flood = s.faults[0], s.faults[1]
    assert (forge.epoch, forge.expires_in_s, forge.busy_s()) == (10**9, 1e9, 15.0)
    assert (flood.idle, flood.slowloris, flood.oversized, flood.busy_s()) == (1000, 100, 0, 30)
    assert s.every_peer_commits and s.max_join_download_s == 15
    with pytest.raises(ValueError, match="max_join_download_s bounds the joiners' state download: add a join fault"):
        scenario_with(max_join_download_s=15)
    with pytest.raises(ValueError, match=r"faults\[0\] \(flood\)\.peer = 3: peer index out of range"):
        scenario_with({"kind": "flood", "peer": 3, "at_s": 5, "duration_s": 30})
    with pytest.raises(ValueError, match=r"faults\[0\] \(flood\): fires or lasts until 120s"):
        scenario_with({"kind": "flood", "peer": 0, "at_s": 20, "duration_s": 100})
    for fault in ({"kind": "flood", "peer": 0, "at_s": 5, "duration_s": 30}, {"kind": "forge_record", "at_s": 5}):
        with pytest.raises(ValueError, match='needs network = "loopback"'):
            scenario_with(fault, network="netns")
    with pytest.raises(ValueError, match=r"faults\[0\]\.mode: Input should be .*epoch_liar.*got .epoch_lier."):
        scenario_with({"kind": "byzantine", "peer": 0, "mode": "epoch_lier"})
    liar = scenario_with({"kind": "byzantine", "peer": 0, "mode": "epoch_liar"})
    assert liar.faults[0].mode == "epoch_liar"


def test_invite_only_runs_and_the_uninvited_mode():
    token_run = {"diloco": {"inner_steps": 5, "outer_steps": 4}, "admission": {"mode": "token"}}
    s = parse_scenario({**BASE, "run": token_run, "faults": [{"kind": "byzantine", "peer": 0, "mode": "uninvited"}]})
    assert s.invite_only and s.faults[0].mode == "uninvited"
    assert not scenario_with().invite_only
    with pytest.raises(ValueError, match=r"faults\[0\] \(byzantine uninvited\): needs an invite-only run: set "):
        scenario_with({"kind": "byzantine", "peer": 0, "mode": "uninvited"})
    peer_id = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    issuer = {**token_run, "admission": {"mode": "token", "issuer": peer_id}}
    with pytest.raises(ValueError, match="run.admission.issuer: leave it empty; the harness signs every join token"):
        parse_scenario({**BASE, "run": issuer})
    listed = {
        **token_run,
        "admission": {"mode": "allowlist", "allowlist": ["QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"]},
    }
    with pytest.raises(ValueError, match='run.admission.mode = "allowlist" is not supported by the harness'):
        parse_scenario({**BASE, "run": listed})
    assert load_scenario(bundled_scenarios()["uninvited-peer"]).invite_only
