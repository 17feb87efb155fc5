#!/usr/bin/env python3
"""DiLoCo vs synchronous data parallelism: same model, same data, same total samples, in one run.

Both arms run W worker processes (torch.distributed, gloo, 127.0.0.1) from the same initial parameters:

* DDP: every step, gradients are all-reduced (averaged) and every worker takes the same AdamW step.
* DiLoCo: every worker takes H local AdamW steps (hivetrain's InnerOptimizer), then the pseudo-gradients are
  all-reduced (sample-weighted mean; equal weights here) and hivetrain's outer Nesterov step is applied.

Bytes communicated are counted as a ring all-reduce sends them: 2·(W−1)/W · payload bytes per worker per call.
Eval loss is measured on the same held-out windows for both. Prints a table and the ratios; ``--json`` prints one
JSON object with diloco_eval_loss, ddp_eval_loss, diloco_bytes, ddp_bytes (and more).

Example: scripts/bench/diloco_vs_ddp.py --workers 4 --steps 400 --inner-steps 50
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hivetrain.config import DataConfig, DilocoConfig
from hivetrain.data import load_corpus, stream_seed
from hivetrain.diloco.inner import InnerOptimizer, lr_multiplier
from hivetrain.diloco.outer import load_into_model, outer_step, pseudo_gradient
from hivetrain.diloco.state import TrainingState
from hivetrain.model import build_config, build_model, evaluate, lm_loss

DEFAULT_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinyshakespeare.txt"


def ring_bytes(num_floats: int, workers: int) -> int:
    return int(2 * (workers - 1) / workers * num_floats * 4)


def worker(rank: int, args: argparse.Namespace, port: int, arm: str, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.workers)
    data_cfg = DataConfig(
        paths=(args.data,),
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        num_eval_windows=args.eval_windows,
        max_corpus_bytes=0,
    )
    corpus = load_corpus(data_cfg)
    model = build_model(build_config(args.model, corpus.vocab_size, args.seq_len), seed=args.seed)
    params = [p for p in model.parameters()]
    num_floats = sum(p.numel() for p in params)
    batches = corpus.train_batches(args.seq_len, args.batch_size, stream_seed(args.seed, f"worker{rank}"))
    cfg = DilocoConfig(
        inner_steps=args.inner_steps,
        inner_lr=args.lr,
        warmup_steps=args.warmup,
        total_inner_steps=args.steps,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
    )
    sent = 0
    codec, feedback, bits_per_float = None, None, 32.0
    if arm.startswith("diloco-"):
        from hivetrain.averaging.codecs import CodecConfig, ErrorFeedback, make_codec

        name = arm.removeprefix("diloco-")
        codec = make_codec(CodecConfig(name=name.removesuffix("-ef"), block_size=64))
        feedback = ErrorFeedback() if name.endswith("-ef") else None
        bits_per_float = codec.encode(torch.zeros(1 << 16)).num_bytes * 8 / (1 << 16)
    started = time.perf_counter()
    if arm == "ddp":
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        for step in range(args.steps):
            for group in opt.param_groups:
                group["lr"] = args.lr * lr_multiplier(step, cfg)
            loss = lm_loss(model, next(batches))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat /= args.workers
            sent += ring_bytes(num_floats, args.workers)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
    else:
        state = TrainingState.from_model(model)
        inner = InnerOptimizer(model, cfg)
        for epoch in range(args.steps // args.inner_steps):
            load_into_model(state, model)
            inner.run(batches, first_step=epoch * args.inner_steps, num_steps=args.inner_steps)
            deltas = pseudo_gradient(state, model)
            flat = torch.cat([d.reshape(-1) for d in deltas])
            if codec is not None:  # as hivetrain's round: each contribution (+ EF residual) is quantized per block
                residual = feedback.apply(flat) if feedback is not None else None
                quantized = codec.decode(codec.encode(flat))
                if residual is not None:
                    torch.sub(flat, quantized, out=residual)
                    feedback.commit()
                flat = quantized
            dist.all_reduce(flat)
            flat /= args.workers
            if codec is not None:  # ... and so is the reduced mean, which every worker decodes from the same bytes
                flat = codec.decode(codec.encode(flat))
            sent += int(ring_bytes(num_floats, args.workers) * bits_per_float / 32)
            avg, offset = [], 0
            for d in deltas:
                avg.append(flat[offset : offset + d.numel()].view_as(d).clone())
                offset += d.numel()
            state = outer_step(state, avg, args.outer_lr, args.outer_momentum)
        load_into_model(state, model)
    wall = time.perf_counter() - started
    if rank == 0:
        eval_loss = evaluate(model, corpus.eval_windows(args.seq_len, args.eval_windows))
        out.put({"arm": arm, "eval_loss": eval_loss, "wall_s": wall, "num_parameters": num_floats})
    out.put({"arm": arm, "rank": rank, "bytes": sent})
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_arm(args: argparse.Namespace, arm: str) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args, port, arm, queue)) for r in range(args.workers)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in range(args.workers + 1):
            results.append(queue.get(timeout=args.timeout))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    summary = next(r for r in results if "eval_loss" in r)
    summary["bytes"] = sum(r["bytes"] for r in results if "bytes" in r)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="text file (default: shared tinyshakespeare.txt)")
    parser.add_argument("--workers", type=int, default=4, help="data-parallel workers")
    parser.add_argument("--model", default="tiny", help="model preset")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per worker (same total samples)")
    parser.add_argument("--inner-steps", type=int, default=50, help="DiLoCo H")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per window")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per worker per step")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW peak learning rate (both arms)")
    parser.add_argument("--warmup", type=int, default=20, help="warmup steps")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo outer learning rate")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="DiLoCo outer Nesterov momentum")
    parser.add_argument("--eval-windows", type=int, default=64, help="held-out windows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per arm")
    parser.add_argument(
        "--codecs",
        default="",
        help="also run DiLoCo with these pseudo-gradient codecs, comma-separated: fp16, int8, int4, and any of "
        "them with -ef for error feedback (e.g. int4,int4-ef)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.steps % args.inner_steps:
        parser.error("--steps must be a multiple of --inner-steps")
    if not Path(args.data).is_file():
        parser.error(f"--data {args.data}: no such file")
    for name in filter(None, args.codecs.split(",")):
        if name.removesuffix("-ef") not in ("fp16", "int8", "int4"):
            parser.error(f"--codecs: unknown codec {name!r} (fp16, int8, int4, optionally with -ef)")
    ddp = run_arm(args, "ddp")
    diloco = run_arm(args, "diloco")
    codecs = {name: run_arm(args, f"diloco-{name}") for name in filter(None, args.codecs.split(","))}
    result = {
        "workers": args.workers,
        "model": args.model,
        "num_parameters": ddp["num_parameters"],
        "steps_per_worker": args.steps,
        "inner_steps": args.inner_steps,
        "samples_total": args.steps * args.workers * args.batch_size,
        "diloco_eval_loss": diloco["eval_loss"],
        "ddp_eval_loss": ddp["eval_loss"],
        "diloco_bytes": diloco["bytes"],
        "ddp_bytes": ddp["bytes"],
        "bytes_ratio_ddp_over_diloco": ddp["bytes"] / max(diloco["bytes"], 1),
        "eval_loss_ratio_diloco_over_ddp": diloco["eval_loss"] / ddp["eval_loss"],
        "diloco_wall_s": diloco["wall_s"],
        "ddp_wall_s": ddp["wall_s"],
        "codecs": {name: {k: r[k] for k in ("eval_loss", "bytes", "wall_s")} for name, r in codecs.items()},
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'':16}{'eval loss':>12}{'bytes sent':>16}{'wall s':>10}")
        print(f"{'DDP':16}{ddp['eval_loss']:12.4f}{ddp['bytes']:16,}{ddp['wall_s']:10.1f}")
        print(f"{'DiLoCo':16}{diloco['eval_loss']:12.4f}{diloco['bytes']:16,}{diloco['wall_s']:10.1f}")
        for name, r in codecs.items():
            print(f"{'DiLoCo ' + name:16}{r['eval_loss']:12.4f}{r['bytes']:16,}{r['wall_s']:10.1f}")
        print(
            f"DiLoCo/DDP eval loss {result['eval_loss_ratio_diloco_over_ddp']:.3f}; "
            f"DDP sent {result['bytes_ratio_ddp_over_diloco']:.0f}x the bytes of DiLoCo (H={args.inner_steps})"
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
