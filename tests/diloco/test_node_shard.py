"""FSDP2 inside a multi-rank node (``diloco/node_shard.py``, ``--node-sharding fsdp``): 2 CPU ranks over gloo.

Rank 0 drives the node protocol as in ``test_node_ranks`` (a made-up schedule and outer step), with its model held
only as a host copy and the ranks training 1/2 shards each. Checked: each rank holds half of every parameter; the
phase's θ reaches the shards and θ_local comes back whole into rank 0's host model; the node trains as one process on
the union of both ranks' batches (allclose in fp32, as DDP); an aborted phase gathers nothing and the next phase
starts from rank 0's θ again; evaluation on the shards with both ranks equals a plain evaluation of the host model;
bf16 runs through FSDP2's mixed-precision policy (bf16 weights as a layer computes, fp32 shards). Plus the pure
parts: shard units, the parameters gathered at once, the preflight's sharded estimate.
"""

import contextlib
import dataclasses
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hivetrain.diloco.inner import InnerOptimizer
from hivetrain.diloco.node_ranks import NodeInner, NodeRanks, follow
from hivetrain.diloco.node_shard import gathered_parameters, param_dtype, shard_units
from hivetrain.diloco.phase import MAX_PHASE_STEPS, PhaseInterrupted
from hivetrain.localswarm import forkserver
from hivetrain.model import _meta_model, build_config, count_parameters, evaluate
from hivetrain.preflight import estimate_memory
from tests.diloco.test_node_ranks import CONFIG, T, _free_port, flat, outer_step, stream, tiny_model

PHASES = [(0, 3), (10, 2)]
ABORTED = (20, 2)  # rank 0 abandons this phase after 2 steps: nothing is gathered
AFTER = (30, 1)  # a phase after the aborted one: starts from rank 0's θ, not from the shards' aborted steps


def _meta_tiny():
    return _meta_model(build_config("tiny", max_seq_len=T + 1))


def _windows() -> torch.Tensor:
    return torch.cat([next(stream(7)) for _ in range(5)])  # 10 windows: 1 batch of 16 -> rank 1 repeats it


@contextlib.contextmanager
def _sharded_node(rank: int, world_size: int, port: int, config):
    """This rank of a gloo node with the tiny model sharded: (ranks, rank 0's host model or None, sharded model); the
    process groups are torn down on leaving."""
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)  # a protocol bug fails the test instead of hanging it
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timeout
    )
    try:
        control = dist.new_group(backend="gloo", timeout=timeout)
        ranks = NodeRanks(rank, world_size, control, torch.device("cpu"), sharding="fsdp")
        host = tiny_model(seed=0) if rank == 0 else None
        yield ranks, host, ranks.shard(_meta_tiny(), host, config)
    finally:
        dist.destroy_process_group()


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    with _sharded_node(rank, world_size, port, CONFIG) as (ranks, host, sharded):
        out: dict = {"local_rows": [p.to_local().shape[0] for p in sharded.parameters()]}
        out["global_rows"] = [p.shape[0] for p in sharded.parameters()]
        inner = ranks.inner_optimizer(sharded, CONFIG)
        batches = stream(seed=rank)
        if rank == 0:
            node_inner = NodeInner(inner, ranks, host, sharded)
            out["steps"] = []
            for k, (first_step, num_steps) in enumerate(PHASES):
                if k:
                    outer_step(host)

                def should_end(steps: int, samples: int, num_steps=num_steps) -> bool:
                    return steps >= num_steps

                result = node_inner.run(batches, first_step, MAX_PHASE_STEPS, None, should_end)
                out["steps"].append((first_step, result.num_steps, result.num_samples))
            out["after_phases"] = flat(host)

            def stop_at(i: int, loss: float) -> None:
                if i + 1 == ABORTED[1]:
                    raise PhaseInterrupted()

            try:
                node_inner.run(batches, ABORTED[0], MAX_PHASE_STEPS, stop_at, lambda steps, samples: False)
            except PhaseInterrupted:
                out["aborted"] = True
            out["after_abort"] = flat(host)  # nothing gathered: still θ_local of the last phase
            out["eval_sharded"] = [node_inner.evaluate_model(host, _windows())]  # between phases, as the trainer
            out["eval_plain"] = [evaluate(host, _windows())]
            node_inner.run(batches, AFTER[0], AFTER[1], None, None)
            out["params"] = flat(host)
            out["eval_sharded"].append(node_inner.evaluate_model(host, _windows()))
            out["eval_plain"].append(evaluate(host, _windows()))
            ranks.stop()
        else:
            stats = follow(ranks, inner, batches, sharded)
            out.update(phases=stats.phases, aborted=stats.aborted, evaluations=stats.evaluations)
        torch.save(out, f"{out_dir}/rank{rank}.pt")


def single_process_reference() -> torch.Tensor:
    """One process, one model, each microbatch the union of the two ranks' microbatches; the aborted phase's steps
    move the AdamW state but not the θ the next phase starts from."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_model(seed=0)
        inner = InnerOptimizer(model, CONFIG)
        union = (torch.cat(pair) for pair in zip(stream(0), stream(1), strict=True))
        for k, (first_step, num_steps) in enumerate(PHASES):
            if k:
                outer_step(model)
            inner.run(union, first_step, num_steps)
        kept = {n: p.detach().clone() for n, p in model.named_parameters()}
        inner.run(union, ABORTED[0], ABORTED[1])
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(kept[n])
        inner.run(union, AFTER[0], AFTER[1])
        return flat(model)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_two_gloo_ranks_train_a_sharded_model_as_one_peer(tmp_path):
    forkserver.context()
    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True, start_method="forkserver")
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)

    # each rank holds its dim-0 chunk of every parameter (torch.chunk: the first rank the larger half)
    for rows, local0, local1 in zip(r0["global_rows"], r0["local_rows"], r1["local_rows"], strict=True):
        assert (local0, local1) == (-(-rows // 2), rows - -(-rows // 2))
    assert [(f, s) for f, s, _ in r0["steps"]] == PHASES and r1["phases"] == [*PHASES, AFTER]
    assert r0["aborted"] and r1["aborted"] == 1
    assert torch.equal(r0["after_abort"], r0["after_phases"])
    # θ_local gathered whole into rank 0's host model equals one process training on the union of the batches
    torch.testing.assert_close(r0["params"], single_process_reference(), rtol=1e-4, atol=1e-5)
    # both ranks evaluated their share; the loss is the host model's
    assert r1["evaluations"] == 2
    assert r0["eval_sharded"] == pytest.approx(r0["eval_plain"], rel=1e-5)
    assert r0["eval_plain"][0] != r0["eval_plain"][1]  # the second evaluation saw the last phase's θ


def test_shard_units_are_the_decoder_layers_and_the_gathered_count_covers_root_and_two_layers():
    meta = _meta_tiny()
    units = shard_units(meta)
    assert units and all(type(u).__name__ in meta._no_split_modules for u in units)
    assert len(units) == meta.config.num_hidden_layers
    layer = sum(p.numel() for p in units[0].parameters())
    root = count_parameters(meta) - layer * len(units)
    assert gathered_parameters(meta) == root + 2 * layer
    with pytest.raises(ValueError, match="no repeated layers"):
        shard_units(torch.nn.Linear(4, 4))


def test_fsdp_refuses_fp16_and_names_the_way_out():
    assert param_dtype(torch.bfloat16) is torch.bfloat16 and param_dtype(None) is None
    with pytest.raises(ValueError, match="--node-sharding ddp"):
        param_dtype(torch.float16)


def test_the_sharded_estimate_divides_the_states_and_adds_the_gathered_layers():
    config = build_config("small", max_seq_len=256)
    n = count_parameters(_meta_model(config))
    kwargs = dict(microbatch=4, seq_len=256, device_type="cuda", half_precision=True)
    whole = estimate_memory(n, config, **kwargs)
    gathered = 10_000_000
    sharded = estimate_memory(n, config, shards=4, gathered_parameters=gathered, **kwargs)
    shard = -(-n // 4)
    assert sharded.optimizer_bytes == 8 * shard
    assert sharded.parameters_bytes == 4 * shard + 2 * gathered  # the gathered layers in bf16
    assert sharded.gradients_bytes == 4 * shard + 4 * gathered  # their fp32 gradients before the reduce-scatter
    assert sharded.autocast_weights_bytes == 0 and whole.autocast_weights_bytes == 2 * n
    assert sharded.activations_bytes == whole.activations_bytes  # every rank still runs a whole microbatch
    assert sharded.host_bytes == whole.host_bytes + 4 * n  # rank 0's host copy of the model
    assert sharded.device_bytes < whole.device_bytes
    assert "1/4 shard" in sharded.breakdown()
    with pytest.raises(ValueError, match="shards"):
        estimate_memory(n, config, shards=0, **kwargs)


BF16 = dataclasses.replace(CONFIG, precision="bf16", grad_accum_steps=1)


def _bf16_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    with _sharded_node(rank, world_size, port, BF16) as (ranks, host, sharded):
        seen: set = set()
        # the layer's weights as it computes: bf16 only if FSDP2 gathered them so (autocast would cast fp32 weights)
        sharded.model.layers[0].mlp.register_forward_hook(lambda m, args, out: seen.add(m.gate_proj.weight.dtype))
        inner = ranks.inner_optimizer(sharded, BF16)
        out: dict = {}
        if rank == 0:
            start = flat(host)
            losses: list[float] = []
            NodeInner(inner, ranks, host, sharded).run(stream(0), 0, 30, lambda i, loss: losses.append(loss), None)
            out.update(losses=losses, start=start, params=flat(host))
            ranks.stop()
        else:
            follow(ranks, inner, stream(1), sharded)
        out["compute"] = sorted(str(d) for d in seen)
        out["optimizer"] = (inner.shards, inner.gathered_parameters > 0, inner._autocast)
        out["param_dtypes"] = sorted({str(p.dtype) for p in sharded.parameters()})
        torch.save(out, f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow
def test_a_sharded_node_computes_in_bf16_through_fsdp_and_keeps_fp32_shards(tmp_path):
    forkserver.context()
    mp.start_processes(
        _bf16_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True, start_method="forkserver"
    )
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    for r in (r0, r1):
        assert r["compute"] == ["torch.bfloat16"]  # FSDP2 gathered the layer's parameters in bf16
        assert r["param_dtypes"] == ["torch.float32"]  # the shards, their gradients and AdamW stay fp32
        assert r["optimizer"] == (2, True, False)  # sized for its shard, and no autocast beside FSDP's own casts
    losses = r0["losses"]
    assert len(losses) == 30 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    assert torch.isfinite(r0["params"]).all() and not torch.equal(r0["params"], r0["start"])
