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


def _pin_throughput(server, microbatches_per_s: float) -> None:
    """Make a server announce a fixed capacity (its measured one depends on the machine's load)."""
    rt = server.runtime
    rt.fwd_s_ema = rt.bwd_s_ema = 0.5 / microbatches_per_s
    server._announce()


def test_rebalancing_moves_one_server_to_the_bottleneck_with_that_stages_parameters(make_pipeline):
    pipeline = make_pipeline(swarm=SWARM)
    stage0 = [pipeline.add_server(0), pipeline.add_server(0), pipeline.add_server(0)]
    stage1, stage2 = pipeline.add_server(1), pipeline.add_server(2)
    trainer = pipeline.add_trainer()
    trainer.step(BATCH)
    for server, throughput in [*((s, 10.0) for s in stage0), (stage1, 10.0), (stage2, 20.0)]:
        _pin_throughput(server, throughput)
    old_incarnations = {s.node.peer_id: s.runtime.incarnation for s in stage0}

    # stage throughputs [30, 10, 20]: every stage-0 server sees the same records and only the best mover moves
    moves = [server.maybe_rebalance() for server in stage0]

    # why each decided as it did (decide_move's reason, and the server's status: a syncing stage moves later)
    why = [(s.last_decision, s.status) for s in stage0]
    assert sorted(moves, key=str) == [1, None, None], (moves, why)
    mover = stage0[moves.index(1)]
    assert mover.stage == 1 and mover.rebalances == 1 and mover.status == "serving"
    assert "from 10.00 to 20.00" in mover.rebalance_reasons[0]
    assert mover.runtime.state.state_hash() == stage1.runtime.state.state_hash()
    assert mover.runtime.incarnation != old_incarnations[mover.node.peer_id]  # trainers replay its stage-0 phase
    assert set(mover.runtime.params) == set(stage1.runtime.params)
    moved_trainer = pipeline.add_trainer(router=prefer(mover.node.peer_id), seed=3)
    moved_trainer.step(BATCH)
    assert mover.runtime.num_backward == 4, "the mover serves its new stage"
