"""The optional ``[swarm]`` table of a run's TOML: parsed, validated, left out when unset, and carried by the
coordinator's signed run config record to joiners, who validate it again."""

from __future__ import annotations

import pytest
import tomli_w

from hivetrain.config import RunConfig, load_run_config
from hivetrain.peers.records import RunConfigRecord
from hivetrain.swarm.config import NOT_PIPELINED, SwarmConfig

PIPELINED_TOML = """
run_id = "pipe"
model = "tiny"
[data]
batch_size = 8
[swarm]
num_stages = 3
microbatch_size = 2
compression = "none"
trainer_steps = 20
"""


def test_a_run_without_swarm_table_is_data_parallel_and_writes_no_swarm_table():
    config = RunConfig()
    assert not config.pipelined and config.swarm == NOT_PIPELINED
    assert "swarm" not in config.to_dict()
    assert RunConfig.from_dict(config.to_dict()) == config


def test_swarm_table_makes_a_pipelined_run_that_round_trips_through_toml(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(PIPELINED_TOML)
    config = load_run_config(path)
    assert config.pipelined
    assert config.swarm == SwarmConfig(num_stages=3, microbatch_size=2, compression="none", trainer_steps=20)
    again = tmp_path / "again.toml"
    again.write_text(tomli_w.dumps(config.to_dict()))
    assert load_run_config(again) == config


@pytest.mark.parametrize(
    "swarm, message",
    [
        ({"num_stages": 3, "stages": 2}, "swarm.stages: unknown key"),
        ({"num_stages": 0, "microbatch_size": 2}, "swarm.num_stages = 0 means not pipelined"),
        ({"num_stages": 3, "microbatch_size": 3}, "multiple of swarm.microbatch_size"),
        ({"num_stages": 3, "record_ttl_s": 1.0}, "swarm.record_ttl_s (1.0) must exceed"),
        ({"num_stages": 2, "layers_per_stage": [1, 1, 0]}, "swarm.layers_per_stage has 3 entries"),
    ],
)
def test_invalid_swarm_table_is_refused_naming_the_field(swarm, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        RunConfig.from_dict({"swarm": swarm})


def test_invite_only_pipelined_run_is_refused():
    admission = {"mode": "token"}
    with pytest.raises(ValueError, match="stage servers do not check membership"):
        RunConfig.from_dict({"swarm": {"num_stages": 2}, "admission": admission})


@pytest.mark.parametrize(
    "diloco", [{"precision": "bf16"}, {"grad_accum_steps": 4}, {"overlap": "eager"}], ids=lambda d: next(iter(d))
)
def test_a_pipelined_run_refuses_diloco_settings_its_stage_servers_would_ignore(diloco):
    key, value = next(iter(diloco.items()))
    with pytest.raises(ValueError, match=f"diloco.{key} = {value!r} with a \\[swarm\\] table"):
        RunConfig.from_dict({"swarm": {"num_stages": 2}, "diloco": diloco})
    assert not RunConfig.from_dict({"diloco": diloco}).pipelined  # a data-parallel run keeps them


def test_swarm_table_travels_in_the_coordinators_record_and_is_validated_by_the_joiner():
    config = load_run_config(None, {"swarm.num_stages": 4, "swarm.microbatch_size": 4})
    record = RunConfigRecord(run_config=config.to_dict(), version="0.1.0", coordinator_id="Qm", published_at=1.0)
    received = RunConfigRecord.model_validate(record.model_dump(mode="json"))  # what the DHT hands a joiner
    assert RunConfig.from_dict(received.run_config) == config  # join_swarm.resolve_config does this
    tampered = {**received.run_config, "swarm": {**received.run_config["swarm"], "num_stages": -1}}
    with pytest.raises(ValueError, match="swarm.num_stages"):
        RunConfig.from_dict(tampered)


def test_coordinator_refuses_a_checkpoint_dir_for_a_pipelined_run(tmp_path, capsys):
    from hivetrain.cli.coordinator import main

    path = tmp_path / "run.toml"
    path.write_text(PIPELINED_TOML)
    assert main(["--config", str(path), "--checkpoint-dir", str(tmp_path / "ckpt")]) == 2
    assert "a pipelined run ([swarm]) has no whole-model state" in capsys.readouterr().err
