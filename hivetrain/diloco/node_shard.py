"""FSDP2 sharding inside a multi-rank node (``join-swarm --node-sharding fsdp``): a model that does not fit one GPU.

A node's ranks normally train data-parallel with DDP (``node_ranks``): every rank holds the whole model, its
gradients and its AdamW state, 16 bytes per parameter plus activations. With ``fsdp`` each rank holds 1/N of them:
PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``; Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully
Sharded Data Parallel", VLDB, Sec. 3) shards every parameter on dim 0 across the node's ranks as a ``DTensor``, and
all-gathers one shard unit (a decoder layer; the root module holds the embeddings, the final norm and the LM head)
just before it computes, freeing it after; gradients are reduce-scattered after every microbatch, so AdamW steps
the local shard only. Compute runs in the run's precision through FSDP2's ``MixedPrecisionPolicy`` (parameters
gathered in bf16, gradients reduced in fp32) instead of ``torch.autocast``, whose cache would keep a bf16 copy of
every layer alive until the backward pass; fp16 (which needs a gradient scaler agreed across shards) is refused.

What stays as with DDP: rank 0 is the swarm peer and keeps θ, the outer momentum and the pseudo-gradient in host
memory, now with a full host copy of the model (the trainer's model: θ is loaded into it and θ_local read from it,
4N bytes of host memory); the DiLoCo outer step never sees a shard. Between phases:

- phase start (``scatter_params``): rank 0's host parameters go to the ranks one tensor at a time
  (``distribute_tensor(..., src_data_rank=0)``: each rank keeps its own dim-0 chunk), so no rank ever holds the
  whole model on its GPU;
- phase end (``gather_params``): every rank all-gathers each parameter in turn (``DTensor.full_tensor``); rank 0
  copies it into the host model (θ_local), the others drop it;
- evaluation (``evaluate_sharded``): rank 0's windows are broadcast, every rank evaluates its share of the batches
  (the same number of forward passes on every rank, as FSDP's collectives need) and the loss sums are all-reduced.

Buffers (e.g. rotary frequencies) are not sharded: rank 0 broadcasts its host model's once (``broadcast_buffers``),
as the sharded model is built on the meta device on every rank and materialized empty on its device.

What happens if a rank dies mid-call: every function here is a collective; the others fail in it (gloo at once,
NCCL after the process group's timeout) and the node ends as ``node_ranks`` describes.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

SHARDINGS = ("auto", "ddp", "fsdp")


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules sharded as one unit each: the instances of the classes ``transformers`` names in
    ``model._no_split_modules`` (a decoder layer), else the entries of the model's largest ``ModuleList``.

    Raises:
        ValueError: neither exists (the model has no repeated layers to shard one at a time).
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    units = [m for m in model.modules() if type(m).__name__ in names]
    if not units:
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        units = list(max(lists, key=len)) if lists else []
    if not units:
        raise ValueError(
            f"{type(model).__name__} has no repeated layers to shard (no _no_split_modules, no ModuleList): "
            "use --node-sharding ddp"
        )
    return units


def gathered_parameters(model: torch.nn.Module) -> int:
    """Parameters a rank holds unsharded at once, at most: the root unit's own (embeddings, final norm, LM head:
    gathered for the whole forward and backward pass) and the two largest layers (FSDP2 gathers the next layer while
    one computes). Works on a meta model."""
    units = shard_units(model)
    in_units = {id(p) for unit in units for p in unit.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_units)
    sizes = sorted((sum(p.numel() for p in unit.parameters()) for unit in units), reverse=True)
    return root + sum(sizes[:2])


def param_dtype(autocast_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype FSDP2 gathers parameters in for a run whose inner steps autocast to ``autocast_dtype``.

    Raises:
        ValueError: fp16, which needs a gradient scaler whose skip decision every shard would have to agree on.
    """
    if autocast_dtype == torch.float16:
        raise ValueError(
            "--node-sharding fsdp trains in fp32 or bf16, not fp16 (this GPU has no native bf16, so "
            "diloco.precision 'auto' chose fp16): use --node-sharding ddp or diloco.precision = 'fp32'"
        )
    return autocast_dtype


def shard_model(model: torch.nn.Module, device: torch.device, dtype: torch.dtype | None) -> torch.nn.Module:
    """Shard ``model`` (built on the meta device, the same on every rank) over the default process group and
    materialize each rank's shards, empty, on ``device``. A collective: every rank of the node calls it.

    Args:
        model: the run's model on the meta device (``build_run_model(meta=True)``); it is modified in place.
        device: this rank's device (``cuda:LOCAL_RANK`` or cpu).
        dtype: ``param_dtype``'s result (None: compute in fp32).

    Returns:
        ``model``, now an FSDP2 module whose parameters are fp32 ``DTensor`` shards (uninitialized until
        ``scatter_params``) and whose buffers are uninitialized until ``broadcast_buffers``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype is not None else None)
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=device)
    return model


def reshard(sharded: torch.nn.Module) -> None:
    """Every FSDP unit of ``sharded`` back to its shards: the root keeps its parameters gathered after a forward pass
    without a backward (evaluation), and they must be ``DTensor`` shards again before ``scatter_params``."""
    from torch.distributed.fsdp import FSDPModule

    for module in sharded.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@torch.no_grad()
def scatter_params(sharded: torch.nn.Module, source: torch.nn.Module | None) -> None:
    """Rank 0's ``source`` parameters (the host model: θ) into every rank's shards, one tensor at a time.

    Args:
        sharded: this rank's FSDP2 module (``shard_model``).
        source: rank 0: the unsharded model with the same parameter names (any device); other ranks: None.
    """
    from torch.distributed.tensor import distribute_tensor

    reshard(sharded)
    named = dict(source.named_parameters()) if source is not None else {}
    for name, p in sharded.named_parameters():
        device = p.to_local().device
        if source is not None:
            full = named[name].detach().to(device, torch.float32)
        else:
            full = torch.empty(p.shape, dtype=torch.float32, device=device)
        local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=0)
        p.to_local().copy_(local.to_local())


@torch.no_grad()
def gather_params(sharded: torch.nn.Module, target: torch.nn.Module | None) -> None:
    """Every parameter all-gathered in turn; rank 0 copies it into ``target`` (the host model: θ_local).

    Args:
        sharded: this rank's FSDP2 module.
        target: rank 0: the unsharded model (same names); other ranks: None (they only take part in the gathers).
    """
    reshard(sharded)
    named = dict(target.named_parameters()) if target is not None else {}
    for name, p in sharded.named_parameters():
        full = p.full_tensor()
        if target is not None:
            named[name].copy_(full)


@torch.no_grad()
def broadcast_buffers(sharded: torch.nn.Module, source: torch.nn.Module | None) -> None:
    """Rank 0's ``source`` buffers (rotary frequencies...) into every rank's sharded model (default group)."""
    named = dict(source.named_buffers()) if source is not None else {}
    for name, buf in sharded.named_buffers():
        if source is not None:
            buf.copy_(named[name])
        dist.broadcast(buf, 0)


@torch.no_grad()
def evaluate_sharded(
    sharded: torch.nn.Module, windows_NT: torch.Tensor, control: object, batch_size: int = 16
) -> float:
    """Mean next-token cross-entropy (nats per token) of the sharded model on ``windows_NT``, every rank evaluating
    its share of the batches. A collective: every rank calls it with the same (N, T+1) int64 windows.

    Each rank runs ceil(batches / ranks) forward passes (a rank short of real batches repeats the first and does not
    count it: FSDP's all-gathers need every rank in every pass); the sums are all-reduced on ``control`` (gloo, CPU).
    """
    from hivetrain.model import lm_loss

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [windows_NT[s : s + batch_size] for s in range(0, windows_NT.shape[0], batch_size)]
    reshard(sharded)
    device = next(sharded.parameters()).to_local().device
    was_training = sharded.training
    sharded.eval()
    total = torch.zeros(2, dtype=torch.float64)
    try:
        for i in range(math.ceil(len(batches) / world)):
            k = rank + i * world
            batch = batches[k] if k < len(batches) else batches[0]
            loss = lm_loss(sharded, batch.to(device)).item()
            if k < len(batches):
                total += torch.tensor([loss * batch.shape[0], batch.shape[0]], dtype=torch.float64)
    finally:
        sharded.train(was_training)
        reshard(sharded)
    dist.all_reduce(total, group=control)
    return float(total[0] / max(total[1], 1.0))
