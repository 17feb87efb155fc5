"""What a volunteer behind NAT costs an all-reduce: direct TCP vs dial-back vs a libp2p stream, side by side.

Two peers (separate processes, each with its own DHT node and GroupAverager on 127.0.0.1) average ``--floats``
float32 values per round. Three cases, run one after another in the same invocation so that the ratios compare like
with like on a noisy machine:

    direct      both data ports dialable: the smaller peer id dials the other (the baseline)
    dial-back   one peer announces an undialable data address (as behind NAT): if it is the one to be dialed, the
                other asks it over libp2p to dial back; either way the link is direct TCP
    stream      both announce undialable addresses: the link is a libp2p stream through both p2pd daemons

The figure per case is the median over ``--repeats`` rounds (after one warm-up round that also discovers
unreachability) of the slower peer's wall time of ``average``, matchmaking included.

    python scripts/bench/nat_links.py                  # 10M floats, 5 repeats
    python scripts/bench/nat_links.py --floats 1000000 --repeats 3 --json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from allreduce import LOOPBACK, _input, _timed_rounds  # noqa: E402 - sibling bench module

UNDIALABLE_HOST = "127.0.0.2"  # loopback, but the data ports listen on 127.0.0.1 only: a dial is refused
CASES = {"direct": (), "dial-back": (1,), "stream": (0, 1)}


def _worker(rank: int, num_floats: int, rounds: int, unreachable, maddrs, barrier, out) -> None:
    from hivetrain.averaging import AveragingConfig, GroupAverager
    from hivetrain.peers.node import NodeConfig, start_node

    initial = () if rank == 0 else tuple(maddrs.get(timeout=120))
    node = start_node(NodeConfig(host_maddrs=(LOOPBACK,), initial_peers=initial))
    if rank == 0:
        maddrs.put(node.visible_maddrs())
    config = AveragingConfig(target_group_size=2, min_group_size=2, matchmaking_time_s=10.0, round_timeout_s=300.0,
                             part_timeout_s=60.0, commit_timeout_s=60.0)  # fmt: skip
    announce = UNDIALABLE_HOST if rank in unreachable else "127.0.0.1"
    avg = GroupAverager(node, "bench.nat", config, listen_host="127.0.0.1", announce_host=announce)
    avg.start()
    x = [_input(rank, num_floats)]
    try:
        _timed_rounds(rank, rounds, barrier, lambda r: avg.average(x, 1.0, r, 300.0), out)
        fallback = avg.fallback
        out.put(("paths", rank, fallback.streams_opened, fallback.dial_backs_served))
    finally:
        avg.shutdown()
        node.shutdown()


def run_case(name: str, num_floats: int, repeats: int, timeout_s: float) -> dict:
    ctx = mp.get_context("spawn")
    maddrs, out, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(2)
    rounds = repeats + 1
    procs = [
        ctx.Process(target=_worker, args=(r, num_floats, rounds, CASES[name], maddrs, barrier, out))  # has children
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        times, streams, dial_backs = {}, 0, 0
        deadline = time.monotonic() + timeout_s
        for _ in range(4):
            while True:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"case {name}: a peer exited with {failed} or the case timed out")
                try:
                    item = out.get(timeout=2.0)
                    break
                except queue.Empty:
                    continue
            if item[0] == "paths":
                streams, dial_backs = streams + item[2], dial_backs + item[3]
            else:
                times[item[0]] = item[1]
        slowest = [max(t) for t in zip(*times.values(), strict=True)][1:]  # drop the warm-up round
        return {"case": name, "floats": num_floats, "median_s": statistics.median(slowest),
                "libp2p_streams": streams, "dial_backs": dial_backs}  # fmt: skip
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floats", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per case")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.floats <= 0 or args.repeats <= 0:
        parser.error("--floats and --repeats must be > 0")
    results = [run_case(name, args.floats, args.repeats, args.timeout) for name in CASES]
    base = results[0]["median_s"]
    for r in results:
        r["vs_direct"] = r["median_s"] / base
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"{args.floats:,} float32 per round, 2 peers, median of {args.repeats} rounds")
    print(f"{'case':<10} {'round s':>9} {'x direct':>9} {'libp2p streams':>15} {'dial-backs':>11}")
    for r in results:
        row = f"{r['case']:<10} {r['median_s']:>9.3f} {r['vs_direct']:>9.2f} {r['libp2p_streams']:>15}"
        print(row + f" {r['dial_backs']:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
