"""``local-swarm --pipeline``: every flag reaches the pipeline's processes (``pipeline_plan``) or is refused with a
message naming it; ``join-swarm --role/--stage`` are refused for a data-parallel run."""

from __future__ import annotations

import argparse

import pytest

from hivetrain.cli.join_swarm import build_parser as join_parser
from hivetrain.cli.local_swarm import PIPELINE_ONLY_FLAGS, PIPELINE_REFUSED_FLAGS, build_parser, main, pipeline_plan
from hivetrain.cli.swarm_roles import check_role_arguments, local_swarm_config
from hivetrain.config import RunConfig

BASE = ["--out", "OUT", "--pipeline", "3"]


def plan(*extra: str):
    return pipeline_plan(build_parser().parse_args([*BASE, *extra]))


# every local-swarm flag (by argparse dest): what pipeline_plan does with it
HONOURED = {
    "out": ((), lambda p: True),  # the caller's output directory (run_pipeline)
    "pipeline": (("--pipeline", "4"), lambda p: p.run.swarm.num_stages == 4),
    "model": (("--model", "small"), lambda p: p.run.model == "small"),
    "inner_steps": (("--inner-steps", "7"), lambda p: p.run.diloco.inner_steps == 7),
    "data": (("--data", "a.txt", "b/"), lambda p: p.run.data.paths == ("a.txt", "b/")),
    "threads_per_peer": (("--threads-per-peer", "3"), lambda p: p.threads_per_process == 3),
    "timeout": (("--timeout", "99"), lambda p: p.timeout_s == 99.0),
    "peer_args": (("--peer-args", "--device cpu -v"), lambda p: p.extra_args == ("--device", "cpu", "-v")),
    "dashboard_port": (("--dashboard-port", "0"), lambda p: p.coordinator_args == ("--http-port", "0")),
    "verbose": (("-v",), lambda p: p.verbose),
    "servers_per_stage": (("--servers-per-stage", "3"), lambda p: p.servers_per_stage == 3),
    "trainers": (("--trainers", "4"), lambda p: p.trainers == 4),
    "steps": (("--steps", "12"), lambda p: p.run.swarm.trainer_steps == 12),
}
REFUSED = {"peers": ("--peers", "2"), "outer_steps": ("--outer-steps", "2"), "duty_cycles": ("--duty-cycles", "1")}


def test_every_local_swarm_flag_is_classified():
    dests = {a.dest for a in build_parser()._actions if not isinstance(a, argparse._HelpAction)}
    assert dests == set(HONOURED) | set(REFUSED) | {"config"}
    assert set(REFUSED) == set(PIPELINE_REFUSED_FLAGS)


@pytest.mark.parametrize("dest", sorted(HONOURED))
def test_pipeline_flag_is_honoured(dest):
    argv, check = HONOURED[dest]
    assert check(plan(*argv))


@pytest.mark.parametrize("dest", sorted(REFUSED))
def test_pipeline_flag_is_refused_naming_it(dest):
    flag, value = REFUSED[dest]
    with pytest.raises(ValueError, match=f"not with a pipeline: {flag}"):
        plan(flag, value)


def test_config_is_the_base_and_its_swarm_table_is_kept(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('run_id = "mine"\n[data]\nbatch_size = 4\n[swarm]\nnum_stages = 2\nmicrobatch_size = 2\n')
    honoured = pipeline_plan(build_parser().parse_args(["--out", "OUT", "--config", str(path)]))
    assert honoured.run.run_id == "mine" and honoured.run.swarm.num_stages == 2
    assert honoured.run.swarm.microbatch_size == 2 and honoured.run.swarm.trainer_steps == 30
    overridden = pipeline_plan(build_parser().parse_args(["--out", "O", "--config", str(path), "--pipeline", "3"]))
    assert overridden.run.swarm.num_stages == 3 and overridden.run.run_id == "mine"


def test_data_parallel_config_gets_a_swarm_table_from_pipeline(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('run_id = "dp"\n')
    honoured = pipeline_plan(build_parser().parse_args(["--out", "OUT", "--config", str(path), "--pipeline", "2"]))
    assert honoured.run.pipelined and honoured.run.swarm.num_stages == 2 and honoured.run.run_id == "dp"


@pytest.mark.parametrize("flag", sorted(PIPELINE_ONLY_FLAGS.values()))
def test_pipeline_only_flags_are_refused_for_a_data_parallel_swarm(flag, tmp_path, capsys):
    assert main(["--out", str(tmp_path), flag, "2"]) == 2
    assert f"{flag}: only for a pipeline" in capsys.readouterr().err


def test_join_swarm_role_flags_are_refused_for_a_data_parallel_run():
    args = join_parser().parse_args(["/ip4/1.2.3.4/tcp/1", "--role", "server"])
    with pytest.raises(ValueError, match="--role/--stage are for pipelined runs"):
        check_role_arguments(args, RunConfig())
    check_role_arguments(args, RunConfig.from_dict({"swarm": {"num_stages": 2}}))  # accepted


@pytest.mark.parametrize("flag", [["--model-path", "m/"], ["--duty-cycle", "0.5"], ["--pause-file", "/tmp/p"]])
def test_join_swarm_refuses_diloco_only_flags_for_a_pipelined_run(flag):
    args = join_parser().parse_args(["/ip4/1.2.3.4/tcp/1", *flag])
    check_role_arguments(args, RunConfig())  # a data-parallel run takes them
    with pytest.raises(ValueError, match=f"{flag[0]}: not supported in a pipelined run"):
        check_role_arguments(args, RunConfig.from_dict({"swarm": {"num_stages": 2}}))


def test_join_swarm_device_and_threads_are_this_machines_choice():
    run = RunConfig.from_dict({"swarm": {"num_stages": 2, "device": "cpu", "num_threads": 2}})
    assert local_swarm_config(run, None, 0) == run.swarm
    chosen = local_swarm_config(run, "auto", 8)
    assert (chosen.device, chosen.num_threads, chosen.num_stages) == ("auto", 8, 2)
