#!/usr/bin/env python3
"""Where an outer step's time goes outside the all-reduce, part by part, in ms per million parameters (issue 24).

On one model (``--preset``, or ``--params-m`` million parameters as one flat fp32 tensor set shaped like a
transformer's), each part the trainer runs between the end of an inner phase and the start of the next is timed alone,
``--repeats`` times (median), on this machine's CPU threads as the trainer runs it:

    pseudo_gradient   Δ = θ − θ_local (``outer.pseudo_gradient``: a copy to the CPU, a subtraction, a finiteness check)
    outer_step        outer Nesterov SGD into the next θ and momentum (``outer.outer_step``), at ``--momentum``
    state_hash        sha256 of θ and momentum (``TrainingState.state_hash``: peers compare it every epoch)
    load              θ copied into the model for the next phase (``outer.load_into_model``)
    sketch            the θ count sketch for drift (``drift.ParamSketcher``; on the exchange's worker thread)
    manifest          the state server's chunk hashes for downloads (``state_wire.build_manifest``; on demand)
    evaluate          the held-out loss after the outer step (``model.evaluate``, ``--eval-windows`` windows of
                      ``--seq-len``; presets only)

Printed: each part in ms per million parameters and in seconds for this model, and the sum of the parts on the
trainer's own thread (pseudo_gradient, outer_step, state_hash, load, evaluate) against the sum of the background
ones. Example: ``.venv/bin/python scripts/bench/outer_step.py --preset small --json`` (CI runs ``--preset tiny``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

from hivetrain.diloco.drift import ParamSketcher
from hivetrain.diloco.outer import load_into_model, outer_step, pseudo_gradient
from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_wire import build_manifest, read_range, state_segments
from hivetrain.model import PRESETS, build_config, build_model, evaluate

MAIN_THREAD = ("pseudo_gradient", "outer_step", "state_hash", "load", "evaluate")
BACKGROUND = ("sketch", "manifest")


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def flat_model(params_m: float) -> torch.nn.Module:
    """A module with ``params_m`` million fp32 parameters in 1M-sized matrices (no forward: no ``evaluate``)."""
    module = torch.nn.Module()
    count = max(1, round(params_m))
    for i in range(count):
        module.register_parameter(f"w{i}", torch.nn.Parameter(torch.randn(1000, 1000) * 0.02))
    return module


def measure(model: torch.nn.Module, args) -> dict[str, float]:
    """Seconds per part (module docstring)."""
    state = TrainingState.from_model(model)
    state.momentum = {n: torch.randn_like(t) * 1e-3 for n, t in state.params.items()}
    with torch.no_grad():  # the inner phase moved θ_local away from θ
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    deltas = pseudo_gradient(state, model)
    new_state = outer_step(state, deltas, args.outer_lr, args.momentum)
    sketcher = ParamSketcher({n: t.shape for n, t in state.params.items()}, seed=0)
    parts = {
        "pseudo_gradient": lambda: pseudo_gradient(state, model),
        "outer_step": lambda: outer_step(state, deltas, args.outer_lr, args.momentum),
        "state_hash": new_state.state_hash,
        "load": lambda: load_into_model(new_state, model),
        "sketch": lambda: sketcher.sketch(new_state.params),
        "manifest": lambda: build_manifest(
            1, "0" * 64, partial(read_range, state_segments(new_state)), new_state.num_bytes(), 4 << 20
        ),
    }
    if args.preset:
        vocab = model.config.vocab_size
        windows = torch.randint(0, vocab, (args.eval_windows, args.seq_len + 1), generator=torch.Generator())
        parts["evaluate"] = lambda: evaluate(model, windows)
    return {name: timed(fn, args.repeats) for name, fn in parts.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=PRESETS, help="a model preset (default: tiny)")
    source.add_argument("--params-m", type=float, help="a flat model of this many million parameters instead")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per eval window (presets)")
    parser.add_argument("--eval-windows", type=int, default=64, help="held-out windows (data.num_eval_windows)")
    parser.add_argument("--momentum", type=float, default=0.0, help="outer momentum (the default run: 0)")
    parser.add_argument("--outer-lr", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object too")
    args = parser.parse_args(argv)
    if args.params_m is None and args.preset is None:
        args.preset = "tiny"
    flat_size_bad = args.params_m is not None and args.params_m <= 0
    if args.repeats < 1 or args.eval_windows < 1 or args.seq_len < 1 or flat_size_bad:
        parser.error("--repeats, --eval-windows, --seq-len and --params-m must be positive")
    if args.preset:
        model = build_model(build_config(args.preset, vocab_size=256, max_seq_len=args.seq_len + 1), seed=0)
    else:
        model = flat_model(args.params_m)
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    seconds = measure(model, args)
    print(
        f"{args.preset or 'flat'} model, {millions:.2f}M parameters, momentum {args.momentum:g}, "
        f"{torch.get_num_threads()} CPU threads, torch {torch.__version__}, median of {args.repeats}"
    )
    print(f"{'part':<16} {'ms per M':>9} {'seconds':>9}  thread")
    for name, s in seconds.items():
        print(f"{name:<16} {1e3 * s / millions:>9.2f} {s:>9.3f}  {'trainer' if name in MAIN_THREAD else 'worker'}")
    main_s = sum(s for n, s in seconds.items() if n in MAIN_THREAD)
    background_s = sum(s for n, s in seconds.items() if n in BACKGROUND)
    print(f"{'trainer thread':<16} {1e3 * main_s / millions:>9.2f} {main_s:>9.3f}")
    print(f"{'background':<16} {1e3 * background_s / millions:>9.2f} {background_s:>9.3f}")
    if args.json:
        report = {
            "model": args.preset or "flat",
            "params_m": millions,
            "momentum": args.momentum,
            "seconds": seconds,
            "ms_per_m": {n: 1e3 * s / millions for n, s in seconds.items()},
            "trainer_thread_s": main_s,
            "background_s": background_s,
        }
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
