#!/usr/bin/env python3
"""The memory preflight's estimate against what training really takes, for any run model (issue 24 item 3).

Builds the run's model the way ``join-swarm`` does (``diloco.builder.build_model``: the preflight first, activation
checkpointing as it decides), runs ``--phases`` inner phases of ``--steps`` inner steps on random windows with
``InnerOptimizer``, then prints the estimate beside the measurement:

- on CUDA: the preflight's device bytes against ``torch.cuda.max_memory_allocated`` over the phases (what the peer
  logs after its first phase: ``InnerOptimizer.memory``), and their ratio;
- on a CPU: the estimate's training part (parameters, gradients, AdamW, activations) plus the model's and the peer
  process's share, against the process's peak RSS growth (``ru_maxrss``); the host-side parts of a peer (θ, rounds,
  served states: ``preflight`` module docstring) are not exercised here, only reported.

Examples:
    .venv/bin/python scripts/bench/memory_check.py --model tiny --steps 2 --json           # CPU smoke (CI)
    python scripts/bench/memory_check.py --model m1p5b/config.json --batch-size 8 --seq-len 1024 --device cuda --json
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch

from hivetrain.config import RunConfig
from hivetrain.diloco.builder import build_model
from hivetrain.diloco.inner import InnerOptimizer
from hivetrain.model import count_parameters, describe_run_model
from hivetrain.preflight import estimate_memory, resolve_device, run_preflight


def windows(vocab: int, batch: int, seq_len: int, device: torch.device):
    """Endless (B, T+1) int64 random windows (seeded)."""
    generator = torch.Generator().manual_seed(0)
    while True:
        yield torch.randint(0, vocab, (batch, seq_len + 1), generator=generator).to(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a preset or a config.json / model directory")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="inner steps per phase")
    parser.add_argument("--phases", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="auto", help="diloco.precision")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    device = resolve_device(args.device)
    config = RunConfig.from_dict(
        {
            "model": args.model,
            "data": {"seq_len": args.seq_len, "batch_size": args.batch_size},
            "diloco": {"precision": args.precision, "warmup_steps": 1, "compile": "off"},
        }
    )
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model_config, n = describe_run_model(config, args.vocab)
    decision = run_preflight(config, model_config, n, device)
    started = time.perf_counter()
    model, _ = build_model(config, args.vocab, device)
    built_s = time.perf_counter() - started
    inner = InnerOptimizer(model, config.diloco)
    half = inner.precision.autocast_dtype is not None
    estimate = estimate_memory(
        count_parameters(model),
        model_config,
        microbatch=args.batch_size,
        seq_len=args.seq_len,
        device_type=device.type,
        half_precision=half,
        activation_checkpointing=decision.activation_checkpointing,
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    batches = windows(args.vocab, args.batch_size, args.seq_len, device)
    losses = []
    for phase in range(args.phases):
        losses.append(inner.run(batches, phase * args.steps, args.steps).mean_loss)
    row = {
        "model": args.model,
        "parameters": n,
        "device": str(device),
        "precision": inner.precision.name,
        "activation_checkpointing": decision.activation_checkpointing,
        "microbatch": [args.batch_size, args.seq_len],
        "build_s": round(built_s, 2),
        "losses": [round(x, 4) for x in losses],
        "estimate_device_bytes": estimate.device_bytes,
        "estimate_host_bytes": estimate.host_bytes,
        "breakdown": estimate.breakdown(),
    }
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        row |= {"measured_device_bytes": peak, "measured_over_estimate": round(peak / estimate.device_bytes, 3)}
    else:  # the training part of the estimate against the process's growth in peak RSS
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_start
        row |= {"measured_rss_growth_bytes": grown, "measured_over_estimate": round(grown / estimate.device_bytes, 3)}
    gib = 2**30
    measured = row.get("measured_device_bytes", row.get("measured_rss_growth_bytes"))
    print(
        f"{args.model}: {n / 1e6:.1f}M parameters on {device} ({inner.precision.name}), {args.batch_size} x "
        f"{args.seq_len} tokens, activation checkpointing {'on' if decision.activation_checkpointing else 'off'}"
    )
    print(f"  estimate (training device) {estimate.device_bytes / gib:.3f} GiB: {estimate.breakdown()}")
    print(
        f"  measured {'max_memory_allocated' if device.type == 'cuda' else 'peak RSS growth'} "
        f"{measured / gib:.3f} GiB = {row['measured_over_estimate']:.3f}x the estimate; losses {row['losses']}"
    )
    if args.json:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
