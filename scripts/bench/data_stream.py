#!/usr/bin/env python3
"""Does a peer's memory grow with its corpus? The data pipeline on a generated corpus of ``--big-gb`` GB against one
of ``--small-mb`` MB, side by side (issue 13, item 3).

Both corpora are sharded record files (``--format`` jsonl or parquet; 64 MiB shards, like a public corpus) whose
records are random slices of 200-4000 bytes of a source text (``--source``, default tinyshakespeare if present,
else this machine's standard library). Each corpus is then read in a fresh process (``spawn``): ``load_corpus``
(listing, the held-out windows), then ``--windows`` training windows through ``train_batches`` (the shuffle buffer
included), as a peer does. Reported per corpus: tokens/s of the training stream (byte tokens, windows of
``--seq-len`` + 1), the process's peak RSS (``ru_maxrss``) and its RSS before reading; then the ratio of peak RSS,
big / small (goal: <= 1.2) and of tokens/s.

    python scripts/bench/data_stream.py                       # 2 GB vs 20 MB of jsonl, 200k windows each
    python scripts/bench/data_stream.py --format parquet --json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

SHARD_BYTES = 64 << 20
DEFAULT_SOURCE = Path(__file__).resolve().parents[3] / "shared" / "data" / "tinyshakespeare.txt"


def _source_text(path: str) -> str:
    if path:
        return Path(path).read_text(errors="replace")
    if DEFAULT_SOURCE.exists():
        return DEFAULT_SOURCE.read_text(errors="replace")
    from hivetrain.data import default_corpus_files

    return "".join(p.read_text(errors="replace") for p in default_corpus_files()[:400])


def generate(root: Path, total_bytes: int, fmt: str, text: str, seed: int) -> int:
    """Write shards of records {"text": slice} until ``total_bytes`` of text; returns the number of files."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    written, shard, batch, batch_bytes = 0, 0, [], 0

    def flush() -> None:
        nonlocal shard, batch, batch_bytes
        if not batch:
            return
        path = root / f"part-{shard:05d}.{fmt}"
        if fmt == "jsonl":
            with open(path, "w") as f:
                f.writelines(json.dumps({"text": t}) + "\n" for t in batch)
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": batch}), path, row_group_size=4096)
        shard, batch, batch_bytes = shard + 1, [], 0

    while written < total_bytes:
        n = rng.randint(200, 4000)
        start = rng.randrange(0, len(text) - n)
        piece = text[start : start + n]
        batch.append(piece)
        batch_bytes += len(piece)
        written += len(piece)
        if batch_bytes >= SHARD_BYTES:
            flush()
    flush()
    return shard


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _read(root: str, num_windows: int, seq_len: int, batch_size: int, out) -> None:
    import resource

    import torch

    from hivetrain.data import load_corpus, stream_seed
    from hivetrain.data.config import DataConfig

    torch.set_num_threads(1)
    started = time.monotonic()
    corpus = load_corpus(DataConfig(paths=(root,), seq_len=seq_len, batch_size=batch_size, max_corpus_bytes=0))
    load_s = time.monotonic() - started
    before = _rss_mb()
    batches = corpus.train_batches(seq_len, batch_size, stream_seed(0, "bench"))
    started = time.monotonic()
    tokens = 0
    for _ in range(num_windows // batch_size):
        tokens += next(batches).numel()
    seconds = time.monotonic() - started
    out.send(dict(shards=len(corpus.shards), load_s=round(load_s, 2), tokens_per_s=round(tokens / seconds),
                  rss_before_mb=round(before, 1),
                  peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)))  # fmt: skip


def measure(root: Path, args) -> dict:
    ours, theirs = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_read, args=(str(root), args.windows, args.seq_len, 16, theirs))
    proc.start()
    try:
        if not ours.poll(args.timeout_s):
            raise TimeoutError(f"reading {root} took more than {args.timeout_s} s")
        return ours.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--big-gb", type=float, default=2.0, help="size of the big corpus, GB of text")
    ap.add_argument("--small-mb", type=float, default=20.0, help="size of the small corpus, MB of text")
    ap.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    ap.add_argument("--windows", type=int, default=200_000, help="training windows read from each corpus")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per window (+1)")
    ap.add_argument("--source", default="", help="text to slice records from (default: tinyshakespeare or stdlib)")
    ap.add_argument("--dir", default="", help="where to generate the corpora (default: a temp dir, removed)")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="limit per corpus read, seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hivetrain-data-bench-"))
    text = _source_text(args.source)
    try:
        results = {}
        for name, size in (("small", int(args.small_mb * 1e6)), ("big", int(args.big_gb * 1e9))):
            root = base / f"{name}-{args.format}"
            started = time.monotonic()
            if not root.exists():
                generate(root, size, args.format, text, seed=1 if name == "big" else 2)
            made_s = time.monotonic() - started
            files = sorted(root.iterdir())
            results[name] = {"bytes_on_disk": sum(f.stat().st_size for f in files), "files": len(files),
                             "generated_s": round(made_s, 1), **measure(root, args)}  # fmt: skip
            if not args.json:
                print(f"{name}: {results[name]}", file=sys.stderr)
        big, small = results["big"], results["small"]
        summary = {
            "date": time.strftime("%Y-%m-%d"),
            "format": args.format,
            "windows": args.windows,
            "seq_len": args.seq_len,
            **results,
            "peak_rss_ratio": round(big["peak_rss_mb"] / small["peak_rss_mb"], 3),
            "tokens_per_s_ratio": round(big["tokens_per_s"] / small["tokens_per_s"], 3),
        }
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{args.format}: {big['bytes_on_disk'] / 1e9:.2f} GB in {big['files']} files vs "
              f"{small['bytes_on_disk'] / 1e6:.1f} MB in {small['files']}; "
              f"{args.windows} windows of {args.seq_len + 1}")  # fmt: skip
        print(f"tokens/s: big {big['tokens_per_s']:,} small {small['tokens_per_s']:,} (ratio "
              f"{summary['tokens_per_s_ratio']})")  # fmt: skip
        print(f"peak RSS: big {big['peak_rss_mb']} MB, small {small['peak_rss_mb']} MB, ratio "
              f"{summary['peak_rss_ratio']} (goal <= 1.2)")  # fmt: skip
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only, never the hub
    sys.exit(main())
