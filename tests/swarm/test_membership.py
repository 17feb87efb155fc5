"""Servers joining an under-served stage and moving between stages download the stage's current parameters."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hivetrain.model import build_model
from tests.swarm.conftest import TEST_SWARM, prefer

pytestmark = pytest.mark.slow

# stage 1 holds both blocks of the tiny model (the slowest stage by far); every microbatch is an inner step and
# every inner step commits a phase, so the stages' committed parameters move away from the seed's θ₀
SWARM = dataclasses.replace(TEST_SWARM, layers_per_stage=(0, 2, 0), microbatches_per_inner_step=1)
BATCH = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(2))


def test_new_server_joins_the_under_served_stage_downloads_its_parameters_and_serves(make_pipeline):
    pipeline = make_pipeline(swarm=SWARM)
    stage1 = pipeline.add_server(1)
    others = [pipeline.add_server(0), pipeline.add_server(0), pipeline.add_server(2)]
    trainer = pipeline.add_trainer()
    for _ in range(2):
        trainer.step(BATCH)
    assert stage1.runtime.state.epoch == 8

    newcomer = pipeline.add_server(stage=None)  # picks the stage with the least throughput

    assert newcomer.stage == 1 and newcomer.state_downloads == 1
    assert newcomer.runtime.state.epoch == 8
    assert newcomer.runtime.state.state_hash() == stage1.runtime.state.state_hash()
    theta0 = dict(build_model(pipeline.model_config, pipeline.run.seed).named_parameters())
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(newcomer.runtime.params[name].detach(), theta0[name]), "it must not start from θ₀"

    router_trainer = pipeline.add_trainer(router=prefer(newcomer.node.peer_id), seed=1)
    router_trainer.step(BATCH)
    assert newcomer.runtime.num_backward == 4, "the newcomer serves its stage"
    assert all(server.runtime.num_expired == 0 for server in [stage1, newcomer, *others])


def test_server_moves_to_another_stage_with_that_stages_parameters(make_pipeline):
    pipeline = make_pipeline(swarm=SWARM)
    mover = pipeline.add_server(0)
    servers = [pipeline.add_server(0), pipeline.add_server(1), pipeline.add_server(2)]
    trainer = pipeline.add_trainer()
    trainer.step(BATCH)
    old_incarnation = mover.runtime.incarnation

    mover.move_to(2)

    target = servers[2]
    assert mover.stage == 2 and mover.rebalances == 1 and mover.status == "serving"
    assert mover.runtime.state.state_hash() == target.runtime.state.state_hash()
    assert mover.runtime.incarnation != old_incarnation  # trainers replay what it held for stage 0
    assert set(mover.runtime.params) == {"model.norm.weight", "lm_head.weight"}
    moved_trainer = pipeline.add_trainer(router=prefer(mover.node.peer_id), seed=3)
    moved_trainer.step(BATCH)
    assert mover.runtime.num_backward == 4
