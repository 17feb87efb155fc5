#!/usr/bin/env python3
"""Inner-step throughput, side by side in one run: hivetrain's inner loop against hand-written PyTorch loops (issue 24).

Each arm trains a fresh copy of one model (same seed) on the same random token windows, on the device it finds (CUDA
if there is one, else the CPU), in the precision hivetrain picks there (``diloco.precision = "auto"``: bf16 autocast
on a GPU with native bf16, fp32 on a CPU):

    plain            zero_grad, forward under autocast, backward, clip, AdamW (torch's default multi-tensor), no
                     host synchronisation inside the loop
    plain-fused      the same with AdamW(fused=True)
    compiled-fused   torch.compile(model) + AdamW(fused=True): the reference a good hand-written loop reaches
    hivetrain        ``InnerOptimizer.run`` at the run's defaults on this device (compile "auto", fused AdamW and
                     deferred reads on CUDA; on a CPU the plain eager path), with a per-step callback as the trainer
    hivetrain-eager  the same with ``diloco.compile = "off"`` (what compiling buys)

Per arm: tokens/s over ``--steps`` timed steps after ``--warmup-steps`` untimed ones (compiling happens there; its
seconds are ``warmup_s``), MFU (model FLOPs per token, 6N + 12·L·d·T as in PaLM's appendix B, over the device's dense
bf16 peak: known GPUs by name, else ``--peak-tflops``; none on a CPU), peak device memory (CUDA), and each arm's ratio
to ``compiled-fused`` and to ``plain``. Arms run in rounds (``--repeats``), so they share the machine's load; the
median is reported, with the spread over rounds ((max - min) / median). On a CPU, time at least a few seconds per
arm (``--steps 200`` for tiny): 40 steps of tiny gave ratios 0.88-1.14 run to run. ``--compile-backend aot_eager``
(CI's smoke) traces the compiled arm without inductor's code generation: 27.7 s of the CPU smoke's run was inductor
compiling tiny with a cold cache (its code generation is tested by ``tests/diloco/test_inner_speed.py`` and the
compiled e2e swarm).

Examples:
    .venv/bin/python scripts/bench/inner_loop.py --preset tiny --steps 20 --json          # CPU smoke (CI)
    python scripts/bench/inner_loop.py --preset base --batch-size 16 --seq-len 1024 --steps 30 --json   # a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator

import torch

from hivetrain.diloco.config import DilocoConfig
from hivetrain.diloco.inner import InnerOptimizer, cuda_native_bf16, resolve_precision
from hivetrain.model import PRESETS, build_config, build_model, lm_loss

ARMS = ("plain", "plain-fused", "compiled-fused", "hivetrain", "hivetrain-eager")

# dense bf16 tensor-core peaks, FLOP/s (vendor data sheets; SXM parts where both exist)
PEAK_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "4090": 165.2e12}


def peak_flops(device: torch.device, override_tflops: float) -> float | None:
    """The device's dense bf16 peak in FLOP/s: ``override_tflops`` if given, else from the GPU's name; None if
    unknown (and on a CPU)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16.items() if key in name), None)


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the parameters that multiply (all but the input embedding) + 12·L·d·T for the
    attention scores and their values (PaLM, Chowdhery et al. 2022, appendix B)."""
    config = model.config
    embedding = model.get_input_embeddings().weight.numel()
    dense = sum(p.numel() for p in model.parameters()) - embedding
    return 6.0 * dense + 12.0 * config.num_hidden_layers * config.hidden_size * seq_len


def windows(batch_size: int, seq_len: int, vocab: int, count: int, seed: int = 0) -> list[torch.Tensor]:
    """``count`` host (B, T+1) int64 batches of random tokens (a data stream's output)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch_size, seq_len + 1), generator=gen) for _ in range(count)]


def cycle(batches: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    while True:
        yield from batches


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_loop(
    model, device, precision, batches, steps, *, fused: bool, compiled: bool, backend: str = "inductor"
) -> tuple[float, float]:
    """(warm-up seconds, timed seconds) of a hand-written loop; ``steps`` = (warm-up steps, timed steps); ``backend``:
    ``torch.compile``'s, when ``compiled``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), fused=fused or None)
    forward = torch.compile(model, backend=backend) if compiled else model
    stream = cycle(batches)
    losses = []

    def step() -> None:
        batch = next(stream)
        if device.type == "cuda":
            batch = batch.pin_memory()
        batch = batch.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        with precision.autocast():
            loss = lm_loss(forward, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.detach())

    times = []
    for count in steps:
        sync(device)
        started = time.perf_counter()
        for _ in range(count):
            step()
        sync(device)
        times.append(time.perf_counter() - started)
    if not all(torch.isfinite(torch.stack(losses))):
        raise FloatingPointError("the plain loop diverged")
    return times[0], times[1]


def hivetrain_loop(model, device, batches, steps, *, compile_mode: str) -> tuple[float, float]:
    """(warm-up seconds incl. ``InnerOptimizer.warm_up``, timed seconds) of ``InnerOptimizer.run``."""
    batch_size, window = batches[0].shape
    inner = InnerOptimizer(model, DilocoConfig(inner_lr=1e-4, warmup_steps=0, compile=compile_mode))
    stream = cycle(batches)
    seen = []
    started = time.perf_counter()
    inner.warm_up(batch_size, window - 1)
    inner.run(stream, 0, steps[0], on_step=lambda i, loss: seen.append(loss))
    warmup_s = time.perf_counter() - started
    result = inner.run(stream, steps[0], steps[1], on_step=lambda i, loss: seen.append(loss))
    return warmup_s, result.duration_s


def run_arm(arm, args, device, precision, batches) -> dict:
    torch.manual_seed(0)
    model = build_model(build_config(args.preset, vocab_size=args.vocab, max_seq_len=args.seq_len + 1), seed=0)
    model = model.to(device)
    fpt = flops_per_token(model, args.seq_len)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    steps = (args.warmup_steps, args.steps)
    if arm.startswith("hivetrain"):
        mode = "off" if "eager" in arm else "auto"
        warmup_s, timed_s = hivetrain_loop(model, device, batches, steps, compile_mode=mode)
    else:
        warmup_s, timed_s = plain_loop(
            model,
            device,
            precision,
            batches,
            steps,
            fused=arm != "plain",
            compiled=arm == "compiled-fused",
            backend=args.compile_backend,
        )
    tokens_per_s = args.steps * args.batch_size * args.seq_len / timed_s
    peak = peak_flops(device, args.peak_tflops)
    return {
        "arm": arm,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * fpt / peak if peak else None,
        "warmup_s": warmup_s,
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per window (T)")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30, help="timed inner steps per arm")
    parser.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first (compiling happens here)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every arm; the median is reported")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:1, ...")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="the device's bf16 peak (MFU); 0 = by name")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object too")
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of the compiled-fused arm (default inductor, what a good loop uses; aot_eager "
        "traces the same graphs without generating kernels: a smoke run's compile path in seconds)",
    )
    args = parser.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or not arms:
        parser.error(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
    backends = torch.compiler.list_backends(exclude_tags=())
    if args.compile_backend not in backends:
        parser.error(f"--compile-backend {args.compile_backend!r}: choose from {', '.join(backends)}")
    if min(args.batch_size, args.seq_len, args.steps, args.repeats) < 1 or args.warmup_steps < 0:
        parser.error("--batch-size, --seq-len, --steps and --repeats must be positive, --warmup-steps >= 0")
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            parser.error(f"--device {args.device!r}: not a torch device (auto, cpu, cuda, cuda:1, ...)")
    precision = resolve_precision("auto", device.type, cuda_native_bf16(device))
    batches = windows(args.batch_size, args.seq_len, args.vocab, count=16)
    rounds: dict[str, list[dict]] = {arm: [] for arm in arms}
    for _ in range(args.repeats):
        for arm in arms:
            rounds[arm].append(run_arm(arm, args, device, precision, batches))
    results = {}
    for arm, runs in rounds.items():
        median = statistics.median(r["tokens_per_s"] for r in runs)
        spread = (max(r["tokens_per_s"] for r in runs) - min(r["tokens_per_s"] for r in runs)) / median
        results[arm] = {**min(runs, key=lambda r: abs(r["tokens_per_s"] - median)), "tokens_per_s": median}
        results[arm]["spread"] = spread  # (max - min) / median over the rounds: how far to trust the ratios
    for r in results.values():
        for ref in ("compiled-fused", "plain"):
            if ref in results:
                r[f"vs_{ref}"] = r["tokens_per_s"] / results[ref]["tokens_per_s"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"device {name}, {precision.name}, preset {args.preset}, B={args.batch_size} T={args.seq_len}, "
        f"{args.steps} timed steps after {args.warmup_steps}, {args.repeats} round(s), torch {torch.__version__}"
    )
    header = ("arm", "tokens/s", "MFU", "vs compiled", "vs plain", "warm-up s", "peak GB", "spread")
    print(f"{header[0]:<16} " + " ".join(f"{h:>{w}}" for h, w in zip(header[1:], (11, 6, 11, 9, 9, 8, 7), strict=True)))
    for arm, r in results.items():

        def fmt(value, spec):
            return format(value, spec) if value is not None else "-"

        print(
            f"{arm:<16} {r['tokens_per_s']:>11,.0f} {fmt(r['mfu'], '6.3f'):>6} "
            f"{fmt(r.get('vs_compiled-fused'), '11.3f'):>11} {fmt(r.get('vs_plain'), '9.3f'):>9} "
            f"{r['warmup_s']:>9.1f} {fmt(r['peak_memory_gb'], '8.2f'):>8} {r['spread']:>7.3f}"
        )
    if args.json:
        print(json.dumps({"device": name, "precision": precision.name, "args": vars(args), "arms": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
