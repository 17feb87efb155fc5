#!/usr/bin/env python3
"""Issue 24's GPU checks as one prepared run, for a session that is lent a GPU for a few minutes.

Runs, each bounded in time, and writes every log and a ``report.json`` under ``--out``:

1. ``inner_loop``: ``scripts/bench/inner_loop.py`` on the ``base`` preset (B = 16, T = 1024): hivetrain's inner step
   against the compiled fused loop (acceptance: >= 0.95x) and the plain loop, tokens/s and MFU.
2. ``memory``: ``scripts/bench/memory_check.py`` on a ~1.5B-parameter llama ``config.json`` written here (acceptance:
   the measured peak within 15% of the preflight's estimate), with activation checkpointing if the preflight chooses it.
3. ``swarm``: a 2-peer ``local-swarm`` of ``configs/gpu-base.toml`` at H = 100 on the GPU (both peers share it), 3
   outer steps; from the peers' summaries the seconds per outer step outside the all-reduce (``outer_overhead_s``:
   acceptance <= 1.5 s), the round seconds, ``compile_s``, whether evaluations ran in the background (``eval``
   events) and whether the peers' state hashes agree.

``--smoke`` runs the same on the CPU at toy sizes (the tiny preset, a 2-layer config.json, H = 2): what CI runs, so
the script is known to work before a GPU is ever lent.

Examples:
    .venv/bin/python scripts/bench/gpu_acceptance.py --smoke --out /tmp/gpu-smoke
    python scripts/bench/gpu_acceptance.py --out "$OUT"      # on the device machine (the device tool's $OUT)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parents[1]

# a llama of ~1.5B parameters for the byte vocabulary (30 layers of 50.6M, hidden 2048)
LLAMA_1P5B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 2048,
    "intermediate_size": 5504,
    "num_hidden_layers": 30,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
LLAMA_SMOKE = {**LLAMA_1P5B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 4}  # fmt: skip


def run_step(name: str, argv: list[str], limit_s: float, out: Path) -> dict:
    """Run one check with a time limit; its output goes to ``out/NAME.log``. Returns rc, seconds and the last
    JSON line it printed (if any)."""
    started = time.monotonic()
    log = out / f"{name}.log"
    with open(log, "w") as stream:
        try:
            rc = subprocess.run(argv, stdout=stream, stderr=subprocess.STDOUT, timeout=limit_s, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    seconds = round(time.monotonic() - started, 1)
    last_json = None
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                last_json = json.loads(line)
                break
            except json.JSONDecodeError:
                continue
    print(f"== {name}: rc {rc}, {seconds} s (log {log})", flush=True)
    return {"rc": rc, "seconds": seconds, "result": last_json}


def swarm_figures(swarm_dir: Path) -> dict:
    """What the acceptance reads from a local swarm's peers: per peer the mean seconds per outer step of each part
    outside the all-reduce and their sum, the mean round seconds, compile seconds, background evaluations; and
    whether all peers hold the same state hashes."""
    peers, hashes = {}, []
    for summary_path in sorted(p for p in swarm_dir.glob("peer*.json") if re.fullmatch(r"peer\d+\.json", p.name)):
        summary = json.loads(summary_path.read_text())
        events = []
        metrics = summary_path.with_suffix(".jsonl")
        if metrics.exists():
            events = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        rounds = [e["round_s"] for e in events if e.get("event") == "outer_step" and e.get("round_s") is not None]
        overhead = summary.get("outer_overhead_s") or {}
        peers[summary_path.stem] = {
            "epoch": summary.get("epoch"),
            "outer_overhead_s": overhead,
            "outside_allreduce_s": round(sum(overhead.values()), 3),
            "round_s_mean": round(sum(rounds) / len(rounds), 3) if rounds else None,
            "compile_s": summary.get("compile_s"),
            "background_evals": sum(1 for e in events if e.get("event") == "eval"),
            "peak_device_bytes": summary.get("peak_device_bytes"),
            "preflight_device_bytes": summary.get("preflight_device_bytes"),
        }
        hashes.append(summary.get("state_hashes"))
    return {"peers": peers, "hashes_agree": bool(hashes) and all(h == hashes[0] for h in hashes)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu-acceptance"), help="where logs go")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (CI)")
    parser.add_argument("--only", default="inner_loop,memory,swarm", help="comma-separated checks to run")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(","))
    py = sys.executable
    device = "cpu" if args.smoke else "cuda"
    report: dict = {"smoke": args.smoke, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if not args.smoke:
        import torch

        report["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        report["torch"] = torch.__version__
    if "inner_loop" in only:
        sizes = ["--preset", "tiny", "--batch-size", "2", "--seq-len", "16", "--steps", "2", "--warmup-steps", "1"]
        if not args.smoke:
            sizes = ["--preset", "base", "--batch-size", "16", "--seq-len", "1024", "--steps", "30"]
        arms = "plain,hivetrain" if args.smoke else "plain,compiled-fused,hivetrain"
        argv = [py, str(BENCH / "inner_loop.py"), *sizes, "--arms", arms, "--repeats", "1", "--device", device]
        report["inner_loop"] = run_step("inner_loop", [*argv, "--json"], 60 if args.smoke else 300, out)
    if "memory" in only:
        config = out / "model" / "config.json"
        config.parent.mkdir(exist_ok=True)
        config.write_text(json.dumps(LLAMA_SMOKE if args.smoke else LLAMA_1P5B))
        sizes = ["--batch-size", "2", "--seq-len", "16"] if args.smoke else ["--batch-size", "8", "--seq-len", "1024"]
        argv = [py, str(BENCH / "memory_check.py"), "--model", str(config), *sizes, "--steps", "2", "--phases", "1"]
        report["memory"] = run_step("memory", [*argv, "--device", device, "--json"], 60 if args.smoke else 240, out)
    if "swarm" in only:
        swarm_dir = out / "swarm"
        base = ["--config", str(ROOT / "configs" / "gpu-base.toml"), "--inner-steps", "100", "--outer-steps", "3"]
        if args.smoke:
            base = ["--model", "tiny", "--inner-steps", "2", "--outer-steps", "2"]
        argv = [py, "-m", "hivetrain.cli.main", "local-swarm", "--peers", "2", *base, "--out", str(swarm_dir)]
        argv += ["--peer-args", f"--device {device}", "--timeout", "100" if args.smoke else "330"]
        report["swarm"] = run_step("swarm", argv, 120 if args.smoke else 360, out)
        report["swarm"]["figures"] = swarm_figures(swarm_dir)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return 0 if all(v.get("rc") == 0 for v in report.values() if isinstance(v, dict) and "rc" in v) else 1


if __name__ == "__main__":
    sys.exit(main())
