#!/usr/bin/env python3
"""Round time with slices sized by upload rate vs equal slices, on real rate-limited links (issue 25 item 3).

Four members, each in its own network namespace on one bridge (``chaos.network.NetnsTopology``), each link shaped
with ``tc tbf`` to its rate (``--rates``: upload, Mbit/s; download ``--download-ratio`` x that, 4 by default: home
links are asymmetric, and with symmetric ones a member that reduces nothing waits for the whole all-gather on its slow
download after its whole scatter on its slow upload), run real butterfly rounds
(``averaging.allreduce.ButterflyRound``: authenticated TCP, validation, two-phase commit) on a ``--floats`` fp32
vector. Per arm, every member runs ``--repeats`` rounds; a round's time is the slowest member's wall time, and the
arm's figure the median over rounds. Arms: dense fp32 and ``topk`` (2%, 2-bit, error feedback), each with equal slices
(``bandwidth_slices = false``) and with slices sized by the declared rates (each member's ``upload_mbps`` = its link's
rate, as a measured or declared rate reaches its entry). Root only (netns, tc).

    sudo python scripts/bench/bandwidth_slices.py                       # 100,100,100,10 Mbit/s, 4M floats
    python scripts/bench/bandwidth_slices.py --rates 100,100,100,100 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARMS = {
    "fp32-equal": dict(compression="none", bandwidth_slices=False),
    "fp32-by-rate": dict(compression="none", bandwidth_slices=True),
    "topk-equal": dict(
        compression="topk", error_feedback=True, topk_density=0.02, topk_value_bits=2, bandwidth_slices=False
    ),
    "topk-by-rate": dict(
        compression="topk", error_feedback=True, topk_density=0.02, topk_value_bits=2, bandwidth_slices=True
    ),
}


def worker(args: argparse.Namespace) -> None:
    """One member inside its namespace: serve, publish (port, key), wait for the others, run the rounds."""
    import torch
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    from hivetrain.averaging import AveragingConfig
    from hivetrain.averaging.allreduce import ButterflyRound
    from hivetrain.averaging.dataplane import DataPlaneServer
    from hivetrain.averaging.reduce import BufferPool, Member
    from hivetrain.faults import NO_FAULTS
    from hivetrain.peers.bans import BanList

    torch.set_num_threads(1)
    folder, me, rates = Path(args.dir), args.index, [float(r) for r in args.rates.split(",")]
    config = AveragingConfig(part_timeout_s=60.0, connect_timeout_s=20.0, commit_timeout_s=30.0,
                             round_timeout_s=600.0, matchmaking_time_s=5.0, **ARMS[args.arm])  # fmt: skip
    server = DataPlaneServer(args.ip, connect_timeout_s=20.0, part_timeout_s=60.0, buffer_num_bytes=1 << 20,
                             join_wait_s=20.0)  # fmt: skip
    server.start()
    flat = torch.randn(args.floats, generator=torch.Generator().manual_seed(me))
    times = []
    for r in range(args.repeats):
        secret = X25519PrivateKey.generate()
        public = secret.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
        tmp = folder / f".{r}.{me}.tmp"
        tmp.write_text(json.dumps({"ip": args.ip, "port": server.port, "kx": public}))
        tmp.rename(folder / f"{r}.{me}.json")  # whole or absent
        while len(list(folder.glob(f"{r}.*.json"))) < len(rates):
            time.sleep(0.05)
        infos = [json.loads((folder / f"{r}.{i}.json").read_text()) for i in range(len(rates))]
        members = [
            Member(f"peer{i}", x["ip"], x["port"], bytes.fromhex(x["kx"]), rates[i]) for i, x in enumerate(infos)
        ]
        round_ = ButterflyRound(round_id=f"bench-{args.arm}-{r}", members=members, me=f"peer{me}", secret=secret,
                                server=server, config=config, faults=NO_FAULTS, epoch=r, bans=BanList(),
                                pool=BufferPool())  # fmt: skip
        (folder / f"{r}.{me}.ready").write_text("")
        while len(list(folder.glob(f"{r}.*.ready"))) < len(rates):
            time.sleep(0.01)
        started = time.monotonic()
        outcome = round_.run(flat.clone(), 1.0, time.monotonic() + 600.0)
        times.append({"s": time.monotonic() - started, "sent": outcome.bytes_sent})
    server.shutdown()
    (folder / f"out.{me}.json").write_text(json.dumps(times))


def run_arm(arm: str, rates: list[float], floats: int, repeats: int, download_ratio: float) -> dict:
    from hivetrain.chaos.network import NetnsTopology

    with NetnsTopology() as net, tempfile.TemporaryDirectory() as folder:
        members = [net.add_member() for _ in rates]
        for m, mbps in zip(members, rates, strict=True):
            net.set_bandwidth(m, mbps, mbps * download_ratio)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        procs = [
            subprocess.Popen(
                [
                    *m.exec_prefix,
                    sys.executable,
                    __file__,
                    "--worker",
                    "--index",
                    str(i),
                    "--ip",
                    m.ip,
                    "--dir",
                    folder,
                    "--arm",
                    arm,
                    "--rates",
                    ",".join(map(str, rates)),
                    "--floats",
                    str(floats),
                    "--repeats",
                    str(repeats),
                ],
                env=env,
            )  # fmt: skip
            for i, m in enumerate(members)
        ]
        try:
            for p in procs:
                if p.wait(timeout=1800) != 0:
                    raise RuntimeError(f"{arm}: a member exited with {p.returncode}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        outs = [json.loads((Path(folder) / f"out.{i}.json").read_text()) for i in range(len(rates))]
    per_round = [max(o[r]["s"] for o in outs) for r in range(repeats)]
    return {"arm": arm, "round_s": statistics.median(per_round), "rounds_s": per_round,
            "mb_sent": [round(o[-1]["sent"] / 1e6, 2) for o in outs]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="100,100,100,10", help="each member's upload, Mbit/s")
    parser.add_argument(
        "--download-ratio", type=float, default=4.0, help="download = this x upload (home links are asymmetric)"
    )
    parser.add_argument("--floats", type=int, default=4_000_000, help="fp32 elements averaged per round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--ip", default="", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--arm", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    rates = [float(r) for r in args.rates.split(",")]
    rows = []
    for arm in args.arms.split(","):
        row = run_arm(arm, rates, args.floats, args.repeats, args.download_ratio)
        rows.append(row)
        print(f"{arm:14s} round {row['round_s']:7.2f} s (rounds {', '.join(f'{s:.2f}' for s in row['rounds_s'])}); "
              f"MB sent per member {row['mb_sent']}", flush=True)  # fmt: skip
    by = {r["arm"]: r["round_s"] for r in rows}
    for codec in ("fp32", "topk"):
        if f"{codec}-equal" in by and f"{codec}-by-rate" in by:
            print(f"{codec}: by-rate / equal round time = {by[f'{codec}-by-rate'] / by[f'{codec}-equal']:.2f}")
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
