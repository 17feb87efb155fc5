"""A hostile libp2p client (py-libp2p, no p2pd) that sends malformed messages to a real peer's state server.

Runs ONLY in its own interpreter with py-libp2p installed (it cannot be imported next to hivemind: conflicting
protobuf/multiaddr versions), e.g. ``.venv-adversary/bin/python hivetrain/chaos/adversary/attack.py``; it imports
nothing from hivetrain. It dials the target over TCP + Noise + yamux, opens ``<run_id>.state`` streams (the
``StateServer`` protocol: 4-byte big-endian length + msgpack map) and sends, in rounds until ``--duration-s``:

    huge_length      a length prefix of 0xFFFFFFFF (must be refused before allocating)
    garbage          random bytes where msgpack is expected
    not_a_map        a valid msgpack list instead of a map
    bad_chunk        {"op": "chunk"} with index -1, 2**40 and "x", and a wrong epoch
    unknown_op       {"op": "rm -rf"}
    slowloris        streams that send half a header and then nothing (the server must time them out)

Prints one JSON line per attack: {"attack", "outcome", "t_s"}; outcome is "closed", "error:<message>",
"reply:<keys>" or "timeout". Exit 0 after the duration; 2 if the target could not be dialed.

Usage: attack.py MULTIADDR RUN_ID [--duration-s 20] [--seed 0] [--slowloris 16]
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import sys
import time

import multiaddr
import trio
from libp2p import new_host
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr

STREAM_TIMEOUT_S = 5.0


def _frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def _msgpack_map(items: dict) -> bytes:
    """A tiny msgpack encoder for flat maps of str -> str/int (no msgpack dependency needed)."""
    out = bytearray([0x80 | len(items)])
    for key, value in items.items():
        for v in (key, value):
            if isinstance(v, str):
                raw = v.encode()
                out += bytes([0xA0 | len(raw)]) + raw
            elif 0 <= v < 128:
                out += bytes([v])
            elif -32 <= v < 0:
                out += struct.pack(">b", v)
            else:
                out += b"\xd3" + struct.pack(">q", v)
    return bytes(out)


def attacks(rng: random.Random) -> list[tuple[str, bytes]]:
    return [
        ("huge_length", b"\xff\xff\xff\xff" + rng.randbytes(64)),
        ("garbage", _frame(rng.randbytes(200))),
        ("not_a_map", _frame(b"\x93\x01\x02\x03")),
        ("bad_chunk_negative", _frame(_msgpack_map({"op": "chunk", "index": -1, "epoch": 0}))),
        ("bad_chunk_huge", _frame(_msgpack_map({"op": "chunk", "index": 2**40, "epoch": 0}))),
        ("bad_chunk_type", _frame(_msgpack_map({"op": "chunk", "index": "x", "epoch": 0}))),
        ("bad_chunk_epoch", _frame(_msgpack_map({"op": "chunk", "index": 0, "epoch": 10**9}))),
        ("unknown_op", _frame(_msgpack_map({"op": "rm -rf"}))),
    ]


async def _one(host, peer_id, protocol, name: str, payload: bytes, t0: float) -> None:
    outcome = "timeout"
    with trio.move_on_after(STREAM_TIMEOUT_S):
        try:
            stream = await host.new_stream(peer_id, [protocol])
            await stream.write(payload)
            reply = await stream.read(4096)
            if not reply:
                outcome = "closed"
            elif b"error" in reply:
                text = reply[4:].decode(errors="replace")
                outcome = "error:" + "".join(c for c in text[text.find("error") + 5 :] if c.isprintable())[:80]
            else:
                outcome = f"reply:{len(reply)} bytes"
            await stream.close()
        except Exception as exc:  # noqa: BLE001 - every failure is an outcome to report
            outcome = f"closed ({type(exc).__name__})"
    print(json.dumps({"attack": name, "outcome": outcome, "t_s": round(time.monotonic() - t0, 2)}), flush=True)


async def _slowloris(host, peer_id, protocol, hold_s: float) -> None:
    try:
        stream = await host.new_stream(peer_id, [protocol])
        await stream.write(b"\x00\x00")  # half a length prefix, then nothing
        with trio.move_on_after(hold_s):
            await stream.read(1)
    except Exception:  # noqa: BLE001 - the server closing us is the expected outcome
        pass


async def main_async(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    info = info_from_p2p_addr(multiaddr.Multiaddr(args.target))
    protocol = TProtocol(f"{args.run_id}.state")
    host = new_host()
    t0 = time.monotonic()
    async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        try:
            with trio.fail_after(15):
                await host.connect(info)
        except Exception as exc:  # noqa: BLE001
            print(json.dumps({"attack": "dial", "outcome": f"failed: {exc!r}"}), flush=True)
            return 2
        print(json.dumps({"attack": "dial", "outcome": "connected", "t_s": round(time.monotonic() - t0, 2)}))
        async with trio.open_nursery() as nursery:
            for _ in range(args.slowloris):
                nursery.start_soon(_slowloris, host, info.peer_id, protocol, args.duration_s)
            while time.monotonic() - t0 < args.duration_s:
                for name, payload in attacks(rng):
                    await _one(host, info.peer_id, protocol, name, payload, t0)
                await trio.sleep(0.5)
            nursery.cancel_scope.cancel()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="multiaddr of the peer, with /p2p/<peer id>")
    parser.add_argument("run_id", help="run id (the state protocol is <run_id>.state)")
    parser.add_argument("--duration-s", type=float, default=20.0, help="seconds of attacks")
    parser.add_argument("--seed", type=int, default=0, help="seeds the garbage bytes")
    parser.add_argument("--slowloris", type=int, default=16, help="streams held open without a full request")
    args = parser.parse_args()
    return trio.run(main_async, args)


if __name__ == "__main__":
    sys.exit(main())
