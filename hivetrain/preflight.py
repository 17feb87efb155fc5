"""Memory preflight: will the run's model train on this device? Decided before anything is allocated.

``estimate_memory`` is a pure function of the model's size and shape and the batch; ``check_memory`` compares the
estimate with free memory and returns a decision and a reason; ``run_preflight`` reads the device's free memory
(``torch.cuda.mem_get_info`` on CUDA, the kernel's "available" memory on CPU) and raises ``InsufficientMemory``
naming the options. ``join-swarm`` calls it before it builds the model.

What is counted (N trainable parameters, fp32 unless said):

- on the training device: parameters 4N, gradients 4N, AdamW's two moments 8N; under bf16/fp16 autocast, the
  half-precision copies of the weights autocast caches 2N; and the activations autograd keeps for one microbatch;
- in host memory (θ and the outer state always stay fp32 on the CPU): θ 4N, the outer momentum 4N and the
  pseudo-gradient being averaged 4N; the averaging round's buffers 12N (the flat contribution and the result, kept
  between rounds, and the parts in flight); the outer step's new θ and momentum beside the old 8N; the older states
  the state server keeps for joiners and the coordinator, 8N each (``SERVED_EPOCHS`` - 1 of them: 16N); with
  ``diloco.overlap = "eager"`` the previous average and our previous pseudo-gradient, 8N; and the peer process itself,
  512 MiB (Python, torch, transformers, the DHT client). Measured on CPU (dev/LOG.md, 2026-12-02 session 34): a
  57M-parameter llama's peers plateaued at 4,507 MiB of RSS; this list estimates 4,492 MiB (with only its first three
  parts it estimated 1.97 GiB).

On a CPU peer both lists share the same memory. Activations are what autograd keeps for the backward pass, counted
per layer in the manner of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
Sec. 4.1) but from what PyTorch actually saves in a ``transformers`` Llama layer (read with
``torch.autograd.graph.saved_tensors_hooks``): ``10·b·s·h`` values of hidden width (norm inputs and outputs,
projections' inputs, q/k/v, attention output; fp32 even under autocast, which keeps norms and the residual stream in
fp32) and ``4·b·s·i`` of MLP width (gate, up, activation, product; in the compute precision), with h the hidden
size, i the MLP width, b the microbatch's windows and s tokens per window. No ``s²`` attention scores: PyTorch's SDPA
(flash / memory-efficient kernels, CPU included) does not keep them. Plus the logits ``b·s·V`` in the compute
precision, once more in fp32 for the loss and once for their gradient. Measured against the saved tensors of the
``small`` preset at 8 x 256 tokens: 255 vs 258 MiB in fp32, 190 vs 183 MiB under bf16 autocast; a GPT-NeoX layer
(GELU MLP) saves less, so its estimate is high (214 vs 134 MiB fp32). A documented approximation: ``check_memory`` keeps
a margin (default 15%) for the allocator and workspaces.

A multi-GPU node with ``--node-sharding fsdp`` (``diloco/node_shard.py``) divides parameters, gradients and AdamW
state by its N ranks (16N/N per rank) and adds what FSDP2 holds unsharded at once: the root unit's parameters and the
two largest layers' (``node_shard.gathered_parameters``), in the compute precision, and their fp32 gradients before the
reduce-scatter; no autocast weight copies (FSDP2 gathers the parameters in bf16 itself). Rank 0 keeps a full host copy
of the model for the outer step (4N more host memory).

With activation checkpointing (``diloco.activation_checkpointing``) each layer keeps only its fp32 input ``b·s·h``
across the forward pass; the backward pass recomputes one layer at a time, so one layer's full activations are live
at once, plus the logits as before. "auto" turns it on when the run fits only with it (``run_preflight``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hivetrain.diloco.inner import resolve_precision
from hivetrain.diloco.state import SERVED_EPOCHS

GIB = 2**30
DEFAULT_MARGIN = 1.15
PROCESS_BYTES = 512 * 2**20  # a peer process before any model: 0.45 GiB of RSS measured (dev/LOG.md, session 33)


class InsufficientMemory(ValueError):
    """The device (or host) cannot hold the run's model at the configured batch; the message names the options."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes the run needs. Attributes are bytes; ``device_type`` is "cuda" or "cpu"."""

    num_parameters: int
    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    autocast_weights_bytes: int
    activations_bytes: int
    outer_state_bytes: int
    device_type: str
    microbatch: int
    seq_len: int
    activation_checkpointing: bool = False
    shards: int = 1  # FSDP: the node's ranks sharing parameters, gradients and AdamW state (1: not sharded)
    host_model_bytes: int = 0  # FSDP: rank 0's unsharded host copy of the model
    round_bytes: int = 0  # the averaging round's flat contribution, result and parts in flight
    commit_bytes: int = 0  # the outer step's new θ and momentum, beside the old
    served_bytes: int = 0  # older states kept for joiners (``SERVED_EPOCHS`` - 1)
    overlap_bytes: int = 0  # eager overlap: the previous average and our previous pseudo-gradient
    process_bytes: int = 0  # the peer process itself

    @property
    def device_bytes(self) -> int:
        """Bytes on the training device (on a CPU peer: host memory) for inner steps."""
        return (
            self.parameters_bytes
            + self.gradients_bytes
            + self.optimizer_bytes
            + self.autocast_weights_bytes
            + self.activations_bytes
        )

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory: θ, outer momentum and pseudo-gradient, the round's buffers, the commit, the served
        states, eager overlap's copies, an FSDP node's host model and the process, plus the device's share on a CPU
        peer."""
        own = self.outer_state_bytes + self.host_model_bytes + self.round_bytes + self.commit_bytes
        own += self.served_bytes + self.overlap_bytes + self.process_bytes
        return own + (self.device_bytes if self.device_type == "cpu" else 0)

    def breakdown(self) -> str:
        """One line: each part in GiB (MiB for a model whose parts are all under 1 GiB)."""
        parts = [
            ("parameters", self.parameters_bytes),
            ("gradients", self.gradients_bytes),
            ("AdamW state", self.optimizer_bytes),
            ("autocast weight copies", self.autocast_weights_bytes),
            (
                f"activations at {self.microbatch} x {self.seq_len} tokens"
                + (" (checkpointed)" if self.activation_checkpointing else ""),
                self.activations_bytes,
            ),
            ("θ + outer momentum + pseudo-gradient (host)", self.outer_state_bytes),
            ("host model copy", self.host_model_bytes),
            ("averaging round buffers", self.round_bytes),
            ("the outer step's new θ + momentum", self.commit_bytes),
            (f"{SERVED_EPOCHS - 1} earlier states served to joiners", self.served_bytes),
            ("eager overlap's previous average + pseudo-gradient", self.overlap_bytes),
            ("the peer process", self.process_bytes),
        ]
        if self.shards > 1:
            parts[0] = (f"parameters (1/{self.shards} shard + gathered layers)", self.parameters_bytes)
        unit, scale = ("GiB", GIB) if max(size for _, size in parts) >= GIB else ("MiB", 2**20)
        return ", ".join(f"{name} {size / scale:.2f}" for name, size in parts if size) + f" {unit}"


def estimate_memory(
    num_parameters: int,
    model_config: Any,
    *,
    microbatch: int,
    seq_len: int,
    device_type: str,
    half_precision: bool,
    activation_checkpointing: bool = False,
    shards: int = 1,
    gathered_parameters: int = 0,
    overlap: str = "off",
) -> MemoryEstimate:
    """Bytes to train a model of ``num_parameters`` on ``microbatch`` windows of ``seq_len`` tokens (module docstring).

    Args:
        num_parameters: trainable scalars N.
        model_config: a ``transformers`` config; ``hidden_size``, ``num_hidden_layers``, ``intermediate_size``
            (default 4 x hidden) and ``vocab_size`` are read.
        microbatch: windows per forward/backward pass (``data.batch_size``; gradient accumulation does not add).
        seq_len: tokens per window.
        device_type: "cuda" or "cpu" (any other device is treated like "cuda": memory of its own).
        half_precision: inner steps under bf16/fp16 autocast (activations 2 bytes, weight copies 2N).
        activation_checkpointing: layers keep only their input; one layer's activations are recomputed at a time.
        shards: FSDP: the node's ranks (each holds 1/shards of parameters, gradients and AdamW state); 1: whole.
        gathered_parameters: FSDP: parameters held unsharded at once (``node_shard.gathered_parameters``).
        overlap: ``diloco.overlap`` ("eager" keeps two more fp32 copies of the parameters on the host).

    Raises:
        ValueError: a non-positive size, or a config without ``hidden_size``/``num_hidden_layers``/``vocab_size``.
    """
    if shards < 1 or gathered_parameters < 0:
        raise ValueError(f"shards ({shards}) must be >= 1 and gathered_parameters ({gathered_parameters}) >= 0")
    if num_parameters <= 0 or microbatch <= 0 or seq_len <= 0:
        raise ValueError(
            f"num_parameters ({num_parameters}), microbatch ({microbatch}), seq_len ({seq_len}) must be > 0"
        )
    try:
        hidden = int(model_config.hidden_size)
        layers = int(model_config.num_hidden_layers)
        vocab = int(model_config.vocab_size)
    except (AttributeError, TypeError) as exc:
        raise ValueError(f"cannot estimate activations: the model config lacks {exc}") from None
    mlp = int(getattr(model_config, "intermediate_size", None) or 4 * hidden)
    act_bytes = 2 if half_precision else 4  # the compute precision's bytes per value
    tokens = microbatch * seq_len
    layer = tokens * (10 * hidden * 4 + 4 * mlp * act_bytes)  # what one layer keeps for its backward pass
    logits = tokens * vocab * (act_bytes + 4 + 4)
    if activation_checkpointing:  # every layer's fp32 input, and one layer recomputed at a time
        activations = layers * tokens * hidden * 4 + layer + logits
    else:
        activations = layers * layer + logits
    shard = -(-num_parameters // shards)  # parameters per rank (dim-0 chunks: at most this many)
    sharded = shards > 1
    return MemoryEstimate(
        num_parameters=num_parameters,
        parameters_bytes=4 * shard + (act_bytes * gathered_parameters if sharded else 0),
        gradients_bytes=4 * shard + (4 * gathered_parameters if sharded else 0),
        optimizer_bytes=8 * shard,
        autocast_weights_bytes=2 * num_parameters if half_precision and not sharded else 0,
        activations_bytes=activations,
        outer_state_bytes=12 * num_parameters,
        host_model_bytes=4 * num_parameters if sharded else 0,
        round_bytes=12 * num_parameters,
        commit_bytes=8 * num_parameters,
        served_bytes=8 * num_parameters * (SERVED_EPOCHS - 1),
        overlap_bytes=8 * num_parameters if overlap == "eager" else 0,
        process_bytes=PROCESS_BYTES,
        shards=shards,
        device_type="cpu" if device_type == "cpu" else "cuda",
        microbatch=microbatch,
        seq_len=seq_len,
        activation_checkpointing=activation_checkpointing,
    )


@dataclass(frozen=True)
class PreflightDecision:
    """ok: whether the run fits; reason: for people (the log and the refusal message); activation_checkpointing:
    whether the run is to train with it (``run_preflight``'s choice for "auto")."""

    ok: bool
    reason: str
    activation_checkpointing: bool = False


def check_memory(
    estimate: MemoryEstimate,
    free_device_bytes: int,
    free_host_bytes: int,
    *,
    margin: float = DEFAULT_MARGIN,
    grad_accum_steps: int = 1,
) -> PreflightDecision:
    """Whether ``estimate`` x ``margin`` fits in the free memory given (bytes; on a CPU peer only the host counts).

    Args:
        grad_accum_steps: the run's ``diloco.grad_accum_steps``, quoted in the advice.
    """
    if margin < 1.0:
        raise ValueError(f"margin {margin} must be >= 1")
    short = []
    if estimate.device_type == "cuda" and estimate.device_bytes * margin > free_device_bytes:
        short.append(
            f"{estimate.device_bytes * margin / GIB:.2f} GiB of GPU memory, {free_device_bytes / GIB:.2f} free"
        )
    if estimate.host_bytes * margin > free_host_bytes:
        short.append(
            f"{estimate.host_bytes * margin / GIB:.2f} GiB of host memory, {free_host_bytes / GIB:.2f} available"
        )
    head = f"{estimate.num_parameters / 1e6:.1f}M parameters ({estimate.breakdown()}; margin {margin:.2f}x)"
    if not short:
        return PreflightDecision(True, f"memory preflight ok: {head}", estimate.activation_checkpointing)
    advice = [] if estimate.activation_checkpointing else ["diloco.activation_checkpointing = 'on'"]
    advice += [
        f"a smaller microbatch: lower data.batch_size (now {estimate.microbatch}; activations are "
        f"{estimate.activations_bytes / GIB:.2f} GiB and scale with it) and raise diloco.grad_accum_steps (now "
        f"{grad_accum_steps}) to keep the samples per inner step",
        "a smaller model (run config `model`)",
    ]
    if estimate.device_type == "cuda":
        if estimate.shards == 1:
            advice.append(
                "a node of several GPUs sharding the model: torchrun --nproc-per-node N -m hivetrain.cli.join_swarm "
                "... --node-sharding fsdp (each GPU holds 1/N of the parameters, gradients and AdamW state)"
            )
        else:
            advice.append(f"more GPUs in the node (now {estimate.shards}: --nproc-per-node)")
        advice.append("θ, the outer momentum and the pseudo-gradient already live in CPU memory (offloaded)")
        advice.append("or --device cpu")
    advice.append("or --skip-memory-check if you know the estimate is too high")
    return PreflightDecision(
        False,
        f"not enough memory to train: needs {' and '.join(short)} for {head}. Options: " + "; ".join(advice),
        estimate.activation_checkpointing,
    )


def resolve_device(name: str) -> torch.device:
    """The torch device for ``name``: "cpu", "cuda", "cuda:N" or "auto" (cuda when one is available, else cpu).

    Raises:
        ValueError: "cuda..." when no CUDA device is available, naming the fix (``--device cpu`` or ``auto``).
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: no CUDA device is available here (use --device cpu or auto)")
    return torch.device(name)


def free_memory(device: torch.device) -> tuple[int, int]:
    """(free bytes on ``device``, available host bytes). On CPU both are the host's available memory."""
    host = _available_host_bytes()
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free), host
    return host, host


def _available_host_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil is a dependency; /proc/meminfo on Linux otherwise
        for line in open("/proc/meminfo").read().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
        raise


def run_preflight(
    run_config: Any,
    model_config: Any,
    num_parameters: int,
    device: torch.device,
    *,
    free: tuple[int, int] | None = None,
    margin: float = DEFAULT_MARGIN,
    shards: int = 1,
    gathered_parameters: int = 0,
    activation_checkpointing: str | None = None,
) -> PreflightDecision:
    """Estimate, read free memory (unless ``free`` = (device bytes, host bytes) is given) and decide.

    Args:
        run_config: a RunConfig; ``data.batch_size``, ``data.seq_len``, ``diloco.precision``,
            ``diloco.grad_accum_steps`` and ``diloco.activation_checkpointing`` are read.
        shards, gathered_parameters: an FSDP node's sharding (``estimate_memory``); 1, 0: not sharded.
        activation_checkpointing: "off", "on" or "auto" in place of the run's setting (None: the run's).

    Returns:
        The decision when it fits, with ``activation_checkpointing`` set when the run is to use it: "on", or "auto"
        when it fits only with it (the reason says so).

    Raises:
        InsufficientMemory: it does not fit; the message names the sizes and the options.
        ValueError: ``diloco.precision`` cannot run on ``device`` (``inner.resolve_precision``'s message).
    """
    diloco = run_config.diloco
    # the precision inner steps will use (the inner optimizer's own rule; native bf16 or not, both are half precision)
    precision = resolve_precision(getattr(diloco, "precision", "fp32"), device.type, native_bf16=True)
    mode = activation_checkpointing or getattr(diloco, "activation_checkpointing", "off")
    free_device, free_host = free if free is not None else free_memory(device)

    def decide(checkpointed: bool) -> PreflightDecision:
        estimate = estimate_memory(
            num_parameters,
            model_config,
            microbatch=run_config.data.batch_size,
            seq_len=run_config.data.seq_len,
            device_type=device.type,
            half_precision=precision.autocast_dtype is not None,
            activation_checkpointing=checkpointed,
            shards=shards,
            gathered_parameters=gathered_parameters,
            overlap=getattr(diloco, "overlap", "off"),
        )
        accum = getattr(diloco, "grad_accum_steps", 1)
        return check_memory(estimate, free_device, free_host, margin=margin, grad_accum_steps=accum)

    decision = decide(mode == "on")
    if not decision.ok and mode == "auto":
        checkpointed = decide(True)
        if checkpointed.ok:
            without = decision.reason.split(". Options:")[0].removeprefix("not enough memory to train: ")
            reason = f"{checkpointed.reason}; activation checkpointing on (without it the run needs {without})"
            return PreflightDecision(True, reason, True)
        decision = checkpointed  # its advice no longer names what is already applied
    if not decision.ok:
        raise InsufficientMemory(decision.reason)
    return decision


@dataclass(frozen=True)
class MemoryCheck:
    """The preflight's estimate of the training device's memory against the peak measured during the first inner
    phase (``torch.cuda.max_memory_allocated``; issue 24: "the preflight's estimate vs measured peak memory logged").
    Bytes."""

    estimated_bytes: int
    peak_bytes: int

    @property
    def ratio(self) -> float:
        """Measured over estimated (1.0 = exact; the preflight refuses runs over free memory / ``DEFAULT_MARGIN``)."""
        return self.peak_bytes / max(self.estimated_bytes, 1)

    @property
    def reason(self) -> str:
        return (
            f"memory: measured peak {self.peak_bytes / 2**30:.2f} GiB on the device in the first inner phase, "
            f"the preflight estimated {self.estimated_bytes / 2**30:.2f} GiB ({self.ratio - 1:+.0%})"
        )


def check_estimate(
    model: torch.nn.Module,
    microbatch: int,
    seq_len: int,
    device_type: str,
    half_precision: bool,
    peak_bytes: int,
    shards: int = 1,
    gathered_parameters: int = 0,
) -> MemoryCheck:
    """``estimate_memory`` of the model as it trains (its parameters, activation checkpointing on or off, FSDP's
    ``shards`` and ``gathered_parameters``) against a measured peak (``peak_bytes``)."""
    from hivetrain.model import count_parameters, is_activation_checkpointing

    estimate = estimate_memory(
        count_parameters(model),
        model.config,
        microbatch=microbatch,
        seq_len=seq_len,
        device_type=device_type,
        half_precision=half_precision,
        activation_checkpointing=is_activation_checkpointing(model),
        shards=shards,
        gathered_parameters=gathered_parameters,
    )
    return MemoryCheck(estimate.device_bytes, peak_bytes)


__all__ = [
    "InsufficientMemory",
    "MemoryCheck",
    "MemoryEstimate",
    "check_estimate",
    "PreflightDecision",
    "check_memory",
    "estimate_memory",
    "free_memory",
    "run_preflight",
]
