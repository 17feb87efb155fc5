"""End-to-end pipeline on loopback: tiny model, 3 stages, servers and trainer over hivemind P2P."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from hivetrain.faults import Fault, FaultInjector
from hivetrain.swarm.routing import choose_server
from tests.swarm.conftest import TEST_SWARM, crash, prefer, reference_gradients, stage_gradients

pytestmark = pytest.mark.slow

BATCH = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))  # 4 microbatches of 1 window


def _assert_gradients_match(pipeline, servers, batch, loss):
    ref_loss, ref_grads = reference_gradients(pipeline, batch)
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    grads, counts = stage_gradients(servers)
    num_microbatches = batch.shape[0] // pipeline.swarm.microbatch_size
    assert counts == dict.fromkeys(range(pipeline.swarm.num_stages), num_microbatches), "a microbatch was lost"
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-5, rtol=0, msg=name)


def test_pipeline_step_equals_uncut_model_and_spreads_over_servers(make_pipeline):
    """Two servers per stage: whichever servers the wiring picks, the step's gradients are the uncut model's, each
    microbatch's backward runs where its forward ran, and every pick was a serving server of its stage. How evenly
    the picks spread is a property of ``choose_server`` alone, pinned with fixed inputs and seeds in
    ``test_decisions.py`` (here the weights move with measured throughput and announce timing, so counts would not)."""
    pipeline = make_pipeline()
    servers = [pipeline.add_server(stage) for stage in (0, 0, 1, 1, 2, 2)]
    stage_of = {s.node.peer_id: stage for s, stage in zip(servers, (0, 0, 1, 1, 2, 2), strict=True)}
    picks: list[tuple[int, str, frozenset[str]]] = []  # (stage, chosen, serving servers of that stage offered)

    def recorded(records, stage, now, bans, rng, inflight=None, exclude=()):
        chosen, reason = choose_server(records, stage, now, bans, rng, inflight, exclude)
        offered = frozenset(r.peer_id for r in records if r.stage == stage and r.status == "serving")
        picks.append((stage, chosen.peer_id if chosen else "", offered))
        return chosen, reason

    trainer = pipeline.add_trainer(router=recorded, seed=5)
    batch = torch.cat([BATCH, BATCH.roll(1, dims=1)])  # 8 microbatches
    result = trainer.step(batch)

    assert result.num_microbatches == 8 and result.reroutes == 0
    _assert_gradients_match(pipeline, servers, batch, result.loss)
    assert sum(s.runtime.num_backward for s in servers) == 3 * 8
    for server in servers:  # the backward pass retraced each microbatch's forward path, server by server
        assert server.runtime.num_backward == server.runtime.num_forward, stage_of[server.node.peer_id]
    assert len(picks) >= 3 * 8
    assert all(chosen in offered and stage_of[chosen] == stage for stage, chosen, offered in picks), picks


def test_killed_servers_mid_forward_and_mid_backward_lose_no_microbatch(make_pipeline):
    pipeline = make_pipeline()
    first = pipeline.add_server(0)
    dies_in_forward = FaultInjector()
    stage1_victim = pipeline.add_server(1, faults=dies_in_forward)
    survivor1 = pipeline.add_server(1)
    dies_in_backward = FaultInjector()
    stage2_victim = pipeline.add_server(2, faults=dies_in_backward)
    survivor2 = pipeline.add_server(2)
    trainer = pipeline.add_trainer(router=prefer(stage1_victim.node.peer_id, stage2_victim.node.peer_id))

    dies_in_forward.arm(Fault("swarm.server.mid_forward", "call", callback=lambda _: crash(stage1_victim)))

    def crash_once_first_backward_acked(_):
        # The stage-2 victim accumulates one microbatch, then dies in the backward pass of the second. It dies only
        # once the trainer holds the first one's reply: killed while that reply is still in its daemon, the trainer
        # never learns it was accepted and simply reroutes that backward (no replay is owed: a different scenario).
        deadline = time.monotonic() + 10
        while not trainer.ledger.entries.get(stage2_victim.node.peer_id) and time.monotonic() < deadline:
            time.sleep(0.01)
        crash(stage2_victim)

    dies_in_backward.arm(Fault("swarm.server.mid_backward", "call", skip=1, callback=crash_once_first_backward_acked))
    result = trainer.step(BATCH)

    assert dies_in_forward.fired_count("swarm.server.mid_forward") == 1
    assert dies_in_backward.fired_count("swarm.server.mid_backward") == 1
    assert result.reroutes >= 2
    # both reset streams declared their servers dead at once, and the gradient the dead stage-2 server had
    # accumulated was queued for replay then, not after its record expired
    assert trainer.stats.deaths == 2 and trainer.stats.false_deaths == 0
    assert trainer.settle(timeout_s=20)
    assert trainer.stats.replays == 1
    _assert_gradients_match(pipeline, [first, survivor1, survivor2], BATCH, result.loss)


def test_nan_activations_ban_the_server_and_reroute(make_pipeline):
    pipeline = make_pipeline()
    poisoned_faults = FaultInjector()
    servers = [pipeline.add_server(0), pipeline.add_server(1, faults=poisoned_faults), pipeline.add_server(1)]
    servers.append(pipeline.add_server(2))
    poisoned = servers[1]
    trainer = pipeline.add_trainer(router=prefer(poisoned.node.peer_id))

    poisoned_faults.arm(
        Fault("swarm.server.mid_forward", "call", times=0, callback=lambda ctx: ctx["output"].fill_(float("nan")))
    )
    result = trainer.step(BATCH)

    poisoned_outputs = poisoned_faults.fired_count("swarm.server.mid_forward")
    assert 1 <= poisoned_outputs <= pipeline.swarm.max_inflight_microbatches  # only the calls already in flight
    assert trainer.stats.bans[poisoned.node.peer_id] == poisoned_outputs, "every NaN output was caught"
    assert all("NaN" in reason for reason in trainer.stats.ban_reasons)
    assert poisoned.runtime.num_backward == 0
    _assert_gradients_match(pipeline, [servers[0], servers[2], servers[3]], BATCH, result.loss)

    trainer.step(BATCH)  # the ban outlasts the step: the preferred but poisoned server gets nothing more
    assert poisoned_faults.fired_count("swarm.server.mid_forward") == poisoned_outputs


def test_fp16_activations_stay_close_to_the_exact_loss_at_half_the_bytes(make_pipeline):
    pipeline = make_pipeline(swarm=dataclasses.replace(TEST_SWARM, compression="fp16"))
    for stage in range(3):
        pipeline.add_server(stage)
    trainer = pipeline.add_trainer()
    result = trainer.step(BATCH)
    ref_loss, _ = reference_gradients(pipeline, BATCH)
    assert result.loss == pytest.approx(ref_loss, abs=5e-3)
    tokens, hidden, vocab = 16, 128, 256
    ids, h16, logits16 = tokens * 8, tokens * hidden * 2, tokens * vocab * 2
    forward = ids + h16 + h16
    backward = (h16 + logits16) + (h16 + h16) + (ids + h16)
    assert result.reroutes == 0
    assert trainer.client.bytes_sent == BATCH.shape[0] * (forward + backward)
