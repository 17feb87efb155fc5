#!/usr/bin/env python3
"""State download time with hostile donors (issue 12, item 2 / finding 3), side by side in one run.

Real hivemind peers on 127.0.0.1 (one p2pd each): donors serve one random ``--state-mb`` state (θ plus momentum, fp32)
in ``--chunk-kib`` chunks, and a joiner downloads it with ``state_sync.fetch_state`` (once untimed from every donor,
so each has hashed its snapshot). Scenarios, interleaved repeat by repeat so they share the machine's load:

    honest3     3 honest donors
    honest2     2 honest donors (the floor for the next two: their hostile donor contributes nothing)
    drip1       1 donor dripping 1 byte every 3 s (listed first) + 2 honest
    nan1        1 donor serving NaN chunks under its honest manifest (listed first) + 2 honest

Reported per scenario: the median, min and max download time over ``--repeats`` (seconds), whether every download
returned the published state, how many donors it reported as bad (summed over repeats), and the ratios
drip1/honest3, drip1/honest2, nan1/honest3 of the medians. Before this change a dripping donor cost 30 s (one network
timeout of the trainer's ``state_timeout_s``) and a first-listed NaN donor with a matching manifest made every
download fail.

Example (40 s of CPU, 2026-11-25): nice -n 19 .venv/bin/python scripts/bench/state_download.py --state-mb 128 \
    --chunk-kib 4096 --repeats 7 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_sync import StateServer, fetch_state
from hivetrain.peers.loop import LoopThread
from hivetrain.peers.node import NodeConfig, start_node
from hivetrain.testing.hostile_donors import Dripper, NaNChunks

SCENARIOS = {
    "honest3": ("honest0", "honest1", "honest2"),
    "honest2": ("honest0", "honest1"),
    "drip1": ("drip", "honest0", "honest1"),
    "nan1": ("nan", "honest0", "honest1"),
}


def _state(num_bytes: int, epoch: int = 7, seed: int = 0) -> TrainingState:
    numel = num_bytes // 8  # θ and momentum, 4 bytes each
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(numel, generator=gen)}
    return TrainingState(epoch, params, {"w": torch.randn(numel, generator=gen)})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-mb", type=float, default=32.0, help="size of θ plus momentum, MB (10^6 bytes)")
    parser.add_argument("--chunk-kib", type=int, default=1024, help="chunk size, KiB")
    parser.add_argument("--repeats", type=int, default=5, help="downloads per scenario")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="per network call, seconds (the trainer's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()

    state = _state(int(args.state_mb * 1e6))
    reference = _state(int(args.state_mb * 1e6), epoch=0, seed=1)
    expected = {state.epoch: state.state_hash()}
    chunk_bytes = args.chunk_kib * 1024
    loop, nodes = LoopThread(), []
    times: dict[str, list[float]] = {name: [] for name in SCENARIOS}
    ok: dict[str, bool] = {name: True for name in SCENARIOS}
    reported_bad: dict[str, int] = {name: 0 for name in SCENARIOS}
    with tempfile.TemporaryDirectory() as tmp:
        try:

            def node(name: str, initial=()):
                config = NodeConfig(
                    initial_peers=tuple(initial),
                    host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                    identity_path=str(Path(tmp) / f"{name}.key"),
                    startup_timeout_s=30,
                )
                nodes.append(start_node(config))
                return nodes[-1]

            first = node("honest0")
            donors = {"honest0": first}
            for name in ("honest1", "honest2", "drip", "nan"):
                donors[name] = node(name, first.visible_maddrs())
            joiner = node("joiner", first.visible_maddrs())
            servers = {
                "drip": Dripper(lambda: state, chunk_bytes=chunk_bytes),
                "nan": NaNChunks(lambda: state, chunk_bytes=chunk_bytes),
            }
            for name, peer in donors.items():
                server = servers.setdefault(name, StateServer(lambda: state, chunk_bytes=chunk_bytes))
                loop.run(server.register(loop.run(peer.dht.replicate_p2p(), 30), "bench"), 30)
            p2p = loop.run(joiner.dht.replicate_p2p(), 30)
            peers = [donors[n].peer_id for n in donors]  # untimed: every donor hashes its snapshot once
            loop.run(fetch_state(p2p, "bench", peers, expected, reference, args.timeout_s), 300)
            for _ in range(args.repeats):
                for scenario, names in SCENARIOS.items():
                    peers = [donors[n].peer_id for n in names]
                    start = time.monotonic()
                    try:
                        result = loop.run(fetch_state(p2p, "bench", peers, expected, reference, args.timeout_s), 300)
                        ok[scenario] &= result.state.state_hash() == expected[state.epoch]
                        reported_bad[scenario] += len(result.bad_donors)
                    except Exception as exc:  # noqa: BLE001 - a failure is a result
                        print(f"{scenario}: {exc!r}", file=sys.stderr)
                        ok[scenario] = False
                    times[scenario].append(time.monotonic() - start)
            attacks_ran = {"drips": servers["drip"].drips, "nan_chunks": servers["nan"].served_nan}
        finally:
            for peer in reversed(nodes):
                peer.shutdown()
            loop.stop()

    median = {s: statistics.median(t) for s, t in times.items()}
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "state_mb": args.state_mb,
        "chunk_kib": args.chunk_kib,
        "repeats": args.repeats,
        "scenarios": {
            s: {"median_s": median[s], "min_s": min(t), "max_s": max(t), "all_verified": ok[s], "bad": reported_bad[s]}
            for s, t in times.items()
        },
        "ratios": {
            "drip1/honest3": median["drip1"] / median["honest3"],
            "drip1/honest2": median["drip1"] / median["honest2"],
            "nan1/honest3": median["nan1"] / median["honest3"],
        },
        "attacks_ran": attacks_ran,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{args.state_mb:.0f} MB state, {args.chunk_kib} KiB chunks, {args.repeats} repeats")
        print(f"{'scenario':10} {'median_s':>9} {'min_s':>7} {'max_s':>7} verified reported_bad")
        for s, row in report["scenarios"].items():
            print(
                f"{s:10} {row['median_s']:9.3f} {row['min_s']:7.3f} {row['max_s']:7.3f} {row['all_verified']!s:8} "
                f"{row['bad']}"
            )
        for name, value in report["ratios"].items():
            print(f"{name}: {value:.2f}")
        print(f"attacks ran: {attacks_ran}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
