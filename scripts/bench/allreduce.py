"""All-reduce throughput on loopback: hivetrain GroupAverager vs hivemind DecentralizedAverager vs torch gloo.

Each peer is a separate process (spawn). Per case (peers x floats) every framework runs ``--repeats`` timed rounds
after one warm-up round; a round's time is the slowest peer's wall time of one call (hivetrain ``average`` and
hivemind ``step`` include their DHT matchmaking; gloo ``all_reduce`` has none), and the reported figure is the
median over rounds. The ratios use these times. A separate column ("ht match s") shows how much of hivetrain's
time the slowest peer spent matchmaking (announce, DHT reads, pushed entries/declarations) in the same rounds.

    python scripts/bench/allreduce.py                   # 2 and 4 peers x 10M and 50M float32, 3 repeats
    python scripts/bench/allreduce.py --quick           # CI size: 2 peers x 1M floats, 1 repeat
    python scripts/bench/allreduce.py --json            # one JSON list, an object per case
    python scripts/bench/allreduce.py --peers 4 --floats 50000000 --skip hivemind

Memory: about 5 x floats x 4 bytes per peer for hivetrain (input, flat copy, result, received parts), more for
hivemind. On a 2-core machine the 50M cases take a few minutes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable

FRAMEWORKS = ("hivetrain", "hivemind", "gloo")
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _input(rank: int, num_floats: int):
    import torch

    return torch.full((num_floats,), float(rank + 1)) + torch.randn(
        num_floats, generator=torch.Generator().manual_seed(rank)
    )


def _timed_rounds(rank: int, rounds: int, barrier, one_round: Callable[[int], None], out, parts=None) -> None:
    """Per round: wait for every peer (barrier), then time one call. ``parts``: a list that the call fills with the
    seconds of a sub-phase (hivetrain's matchmaking), reported alongside."""
    times = []
    for r in range(rounds):
        barrier.wait(timeout=600)
        start = time.perf_counter()
        one_round(r)
        times.append(time.perf_counter() - start)
    out.put((rank, times, list(parts or [])))


def _timed(fn: Callable, into: list) -> Callable:
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    return wrapper


def _hivetrain_worker(rank: int, peers: int, num_floats: int, rounds: int, maddrs, barrier, out) -> None:
    from hivetrain.averaging import AveragingConfig, GroupAverager
    from hivetrain.peers.node import NodeConfig, start_node

    initial = () if rank == 0 else tuple(maddrs.get(timeout=120))
    node = start_node(NodeConfig(host_maddrs=(LOOPBACK,), initial_peers=initial))
    if rank == 0:
        for _ in range(peers - 1):
            maddrs.put(node.visible_maddrs())
    config = AveragingConfig(target_group_size=peers, min_group_size=peers, matchmaking_time_s=10.0,
                             round_timeout_s=300.0, part_timeout_s=60.0, commit_timeout_s=60.0)  # fmt: skip
    avg = GroupAverager(node, "bench.avg", config, listen_host="127.0.0.1")
    avg.start()
    x = [_input(rank, num_floats)]
    match_s: list[float] = []
    avg.matchmaker.match = _timed(avg.matchmaker.match, match_s)  # this instance only: the breakdown column
    try:
        _timed_rounds(rank, rounds, barrier, lambda r: avg.average(x, 1.0, r, 300.0), out, match_s)
    finally:
        avg.shutdown()
        node.shutdown()


def _hivemind_worker(rank: int, peers: int, num_floats: int, rounds: int, maddrs, barrier, out) -> None:
    import hivemind

    mp.set_start_method("fork", force=True)  # hivemind's averager is an mp.Process that cannot be pickled for spawn
    initial = [] if rank == 0 else list(maddrs.get(timeout=120))
    dht = hivemind.DHT(initial_peers=initial, host_maddrs=[LOOPBACK], start=True)
    if rank == 0:
        for _ in range(peers - 1):
            maddrs.put([str(a) for a in dht.get_visible_maddrs()])
    avg = hivemind.averaging.DecentralizedAverager(
        [_input(rank, num_floats)], dht, prefix="bench", target_group_size=peers, min_group_size=peers,
        min_matchmaking_time=2.0, request_timeout=1.0, start=True,
    )  # fmt: skip

    def one(r: int) -> None:
        if avg.step(timeout=300) is None:
            raise RuntimeError("hivemind step failed")

    try:
        _timed_rounds(rank, rounds, barrier, one, out)
    finally:
        avg.shutdown()
        dht.shutdown()


def _gloo_worker(rank: int, peers: int, num_floats: int, rounds: int, port: int, barrier, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=peers)
    x = _input(rank, num_floats)
    try:
        _timed_rounds(rank, rounds, barrier, lambda r: dist.all_reduce(x), out)
    finally:
        dist.destroy_process_group()


def run_case(framework: str, peers: int, num_floats: int, repeats: int, timeout_s: float) -> tuple[float, float | None]:
    """Median seconds per round (slowest peer) over ``repeats`` rounds after one warm-up round, and the median of
    the slowest peer's sub-phase time (hivetrain's matchmaking; None for the others)."""
    ctx = mp.get_context("spawn")
    barrier, out, maddrs = ctx.Barrier(peers), ctx.Queue(), ctx.Queue()
    rounds = repeats + 1
    if framework == "gloo":
        target, shared = _gloo_worker, _free_port()
    else:
        target, shared = (_hivetrain_worker if framework == "hivetrain" else _hivemind_worker), maddrs
    procs = [
        ctx.Process(target=target, args=(r, peers, num_floats, rounds, shared, barrier, out)) for r in range(peers)
    ]
    for p in procs:
        p.start()
    try:
        per_rank = {rank: (times, parts) for rank, times, parts in (out.get(timeout=timeout_s) for _ in range(peers))}
    finally:
        for p in procs:
            p.join(30)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    slowest = [max(per_rank[r][0][i] for r in range(peers)) for i in range(1, rounds)]
    parts = [max(per_rank[r][1][i] for r in range(peers)) for i in range(1, rounds) if per_rank[0][1]]
    return statistics.median(slowest), (statistics.median(parts) if parts else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4], help="group sizes (processes)")
    parser.add_argument("--floats", type=int, nargs="+", default=[10_000_000, 50_000_000], help="float32 per peer")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per case (median reported)")
    parser.add_argument("--skip", nargs="*", default=[], choices=FRAMEWORKS, help="frameworks not to run")
    parser.add_argument("--quick", action="store_true", help="CI size: 2 peers x 1M floats, 1 repeat")
    parser.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per framework and case, seconds")
    args = parser.parse_args(argv)
    if args.quick:
        args.peers, args.floats, args.repeats = [2], [1_000_000], 1
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # peers share the CPU cores: one torch thread each
    rows = []
    for peers in args.peers:
        for num_floats in args.floats:
            row: dict = {"peers": peers, "floats": num_floats}
            for fw in FRAMEWORKS:
                skipped = fw in args.skip
                row[f"{fw}_s"], part = (None, None) if skipped else run_case(fw, peers, num_floats, args.repeats,
                                                                             args.timeout_s)  # fmt: skip
                if fw == "hivetrain":
                    row["hivetrain_match_s"] = part
                if not args.json:
                    print(f"  {fw:9s} peers={peers} floats={num_floats:,}: {row[f'{fw}_s']}", file=sys.stderr)
            rows.append(row)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(
        f"{'peers':>5} {'floats':>12} {'hivetrain s':>12} {'hivemind s':>11} {'gloo s':>8} {'hm/ht':>7} {'ht/gloo':>8} "
        f"{'ht match s':>11}"
    )
    for row in rows:
        ht, hm, gl = row["hivetrain_s"], row["hivemind_s"], row["gloo_s"]

        def fmt(v: float | None, spec: str) -> str:
            return "-" if v is None else format(v, spec)

        print(
            f"{row['peers']:>5} {row['floats']:>12,} {fmt(ht, '12.3f')} {fmt(hm, '11.3f')} {fmt(gl, '8.3f')} "
            f"{fmt(hm / ht if ht and hm else None, '7.2f')} {fmt(ht / gl if ht and gl else None, '8.2f')} "
            f"{fmt(row.get('hivetrain_match_s'), '11.3f')}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
