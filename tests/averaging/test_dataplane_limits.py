"""The data port's limits against strangers, with the real server on 127.0.0.1: a cap per source address, a
handshake deadline that dripped bytes do not extend, claimed headers that allocate nothing until their bytes arrive
(and a byte budget for those that do), and members that get in, and rounds that commit, while strangers flood the
port."""

from __future__ import annotations

import select
import socket
import threading
import time
import tracemalloc

import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from hivetrain.averaging import AveragingConfig
from hivetrain.averaging.admission import DataPlaneLimits
from hivetrain.averaging.allreduce import ButterflyRound
from hivetrain.averaging.handshake import RoundKeys, dial
from hivetrain.averaging.reduce import BufferPool, Member, RoundOutcome
from hivetrain.averaging.wire import HEADER, MAX_DECLARE_META_BYTES, VERSION, FrameType
from hivetrain.faults import NO_FAULTS
from hivetrain.peers.bans import BanList
from hivetrain.testing.flood import DataPortFlood, FloodConfig

from .conftest import run_threads

TIMEOUTS = dict(connect_timeout_s=2.0, part_timeout_s=2.0, buffer_num_bytes=0)


def _public(secret: X25519PrivateKey) -> bytes:
    return secret.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _wait_until(predicate, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < end:
        time.sleep(0.01)
    return predicate()


def _connect(port: int, source: str = "127.0.0.1", first: bytes = b"") -> socket.socket:
    """A connection from ``source`` that sends ``first`` (a stranger that sends nothing is never accepted)."""
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    if first:
        sock.sendall(first)
    return sock


def test_connections_that_send_nothing_are_never_accepted_and_members_get_in_beside_them(servers) -> None:
    """1000 idle connections (the issue's flood) never reach the server (TCP_DEFER_ACCEPT: the kernel hands over a
    connection once its first bytes arrive), so they take no stranger slot and cost no accept; a member's
    handshake completes beside them; one that then sends a byte is accepted as a stranger."""
    server = servers(limits=DataPlaneLimits(max_strangers=16, max_strangers_per_source=4, handshake_timeout_s=30.0))
    ours, theirs = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    attached = []
    server.register(RoundKeys("round-i", "A", ours, {"B": _public(theirs)}, attached.append))
    idle = [_connect(server.port) for _ in range(1000)]
    try:
        real = RoundKeys("round-i", "B", theirs, {"A": _public(ours)}, lambda link: None)
        dial("127.0.0.1", server.port, real, "A", **TIMEOUTS, join_wait_s=2.0).close()
        assert _wait_until(lambda: len(attached) == 1, 3.0)
        # the member connected after the idle ones and was accepted (in order): had they been, they would be here
        assert len(server.pool) == 0 and server.rejected == 0, (len(server.pool), server.refused)
        idle[0].sendall(b"H")
        assert _wait_until(lambda: len(server.pool) == 1, 3.0)
    finally:
        for sock in idle:
            sock.close()
        for link in attached:
            link.close()


def _declare_header(meta_num_bytes: int) -> bytes:
    return HEADER.pack(b"HVA1", VERSION, int(FrameType.DECLARE), 0, meta_num_bytes, 0)


def test_each_source_holds_at_most_its_cap_and_a_flood_from_one_address_leaves_another_alone(servers) -> None:
    server = servers(limits=DataPlaneLimits(max_strangers=16, max_strangers_per_source=4, handshake_timeout_s=30.0))
    honest = _connect(server.port, "127.0.0.1", b"H")  # the first byte of a header: accepted, then it waits
    flood = [_connect(server.port, "127.0.0.2", b"H") for _ in range(10)]
    try:
        assert _wait_until(lambda: server.refused["evicted"] == 6, 5.0), server.refused
        assert server.pool.count("127.0.0.2") == 4 and server.pool.count("127.0.0.1") == 1
        for sock in flood[:6]:  # the oldest six were closed
            sock.settimeout(5.0)
            assert sock.recv(1) == b""
    finally:
        for sock in [honest, *flood]:
            sock.close()


def test_the_handshake_deadline_counts_from_accept_and_dripped_bytes_do_not_extend_it(servers) -> None:
    server = servers(limits=DataPlaneLimits(handshake_timeout_s=0.6))
    hello = HEADER.pack(b"HVA1", VERSION, int(FrameType.HELLO), 0, 4000, 0) + b"\x00" * 4000
    start = time.monotonic()
    closed_after_s = None
    with _connect(server.port) as sock:
        for byte in hello[:100]:  # one byte every 0.05 s: a timeout restarted per byte would never fire
            try:
                sock.send(bytes([byte]))
            except OSError:
                closed_after_s = time.monotonic() - start
                break
            readable, _, _ = select.select([sock], [], [], 0.05)
            if readable and sock.recv(1) == b"":
                closed_after_s = time.monotonic() - start
                break
    assert closed_after_s is not None, "the dripping connection was never closed"
    assert 0.5 <= closed_after_s < 2.0, closed_after_s
    assert server.refused["handshake deadline"] == 1


def test_a_claimed_huge_header_allocates_nothing_and_sent_bytes_stay_within_the_budget(servers) -> None:
    server = servers(on_declaration=lambda raw: False,
                     limits=DataPlaneLimits(max_strangers_per_source=80, max_buffered_bytes=1 << 20,
                                            handshake_timeout_s=30.0))  # fmt: skip
    socks = []
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(64):  # each claims 8 MiB of metadata and sends none of it (the old server allocated 512 MiB)
            socks.append(_connect(server.port))
            socks[-1].sendall(_declare_header(MAX_DECLARE_META_BYTES))
        assert _wait_until(lambda: server.pool.buffered_num_bytes == 64 * HEADER.size, 5.0)
        assert tracemalloc.get_traced_memory()[0] - before < 2 << 20
        # two of them send 700 KiB each: past the 1 MiB budget, the one holding most is dropped
        for sock in socks[:2]:
            sock.sendall(b"\x00" * (700 << 10))
        assert _wait_until(lambda: server.refused["buffer budget"] == 1, 5.0), server.refused
        assert server.pool.buffered_num_bytes <= 1 << 20
        # a claim past the per-type cap is refused from the header alone
        with _connect(server.port) as sock:
            sock.sendall(_declare_header(MAX_DECLARE_META_BYTES + 1))
            sock.settimeout(5.0)
            assert sock.recv(1) == b""
        assert server.refused["LinkClosed"] == 1
    finally:
        tracemalloc.stop()
        for sock in socks:
            sock.close()


def test_a_member_that_dials_before_the_round_is_registered_gets_in_once_it_is(servers) -> None:
    server = servers()
    ours, theirs = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    attached = []
    keys = RoundKeys("round-late", "A", ours, {"B": _public(theirs)}, attached.append)
    timer = threading.Timer(0.3, server.register, args=(keys,))
    timer.start()
    try:
        real = RoundKeys("round-late", "B", theirs, {"A": _public(ours)}, lambda link: None)
        link = dial("127.0.0.1", server.port, real, "A", **TIMEOUTS, join_wait_s=3.0)
        assert _wait_until(lambda: len(attached) == 1, 3.0)
        assert server.refused["unknown round"] >= 1  # it was told RETRY, not held
        link.close()
        attached[0].close()
    finally:
        timer.cancel()


def _flood(port: int) -> DataPortFlood:
    flood = DataPortFlood("127.0.0.1", port, FloodConfig(num_idle=300, num_slowloris=30, num_oversized=16,
                                                         drip_interval_s=0.2, reopen_after_s=0.05))  # fmt: skip
    flood.start()
    return flood


def test_members_get_in_while_strangers_flood_the_port(servers) -> None:
    limits = DataPlaneLimits(max_strangers=32, max_strangers_per_source=16, handshake_timeout_s=2.0)
    server = servers(on_declaration=lambda raw: False, limits=limits)
    ours, theirs = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    attached = []
    server.register(RoundKeys("round-f", "A", ours, {"B": _public(theirs)}, attached.append))
    flood = _flood(server.port)
    try:
        assert _wait_until(lambda: flood.stats["closed_by_target"] > 300, 10.0), flood.stats
        real = RoundKeys("round-f", "B", theirs, {"A": _public(ours)}, lambda link: None)
        for _ in range(10):
            dial("127.0.0.1", server.port, real, "A", **TIMEOUTS, join_wait_s=2.0).close()
        assert _wait_until(lambda: len(attached) == 10, 3.0)
        assert server.refused["evicted"] > 100 and len(server.pool) <= 32
    finally:
        flood.stop()
        for link in attached:
            link.close()


def test_rounds_commit_while_one_member_is_flooded(servers) -> None:
    config = AveragingConfig(part_timeout_s=2.0, connect_timeout_s=2.0, commit_timeout_s=1.0)
    limits = DataPlaneLimits(max_strangers=32, max_strangers_per_source=16)
    srv = [servers(part_timeout_s=2.0, on_declaration=lambda raw: False, limits=limits) for _ in range(3)]
    flood = _flood(srv[0].port)
    try:
        assert _wait_until(lambda: flood.stats["closed_by_target"] > 300, 10.0), flood.stats
        for r in range(3):
            secrets = [X25519PrivateKey.generate() for _ in range(3)]
            members = [Member(f"peer{i}", "127.0.0.1", srv[i].port, _public(secrets[i])) for i in range(3)]
            rounds = [
                ButterflyRound(round_id=f"r{r}", members=members, me=f"peer{i}", secret=secrets[i], server=srv[i],
                               config=config, faults=NO_FAULTS, epoch=r, bans=BanList(), pool=BufferPool())
                for i in range(3)
            ]  # fmt: skip
            flats = [torch.full((3000,), float(i)) for i in range(3)]
            results = run_threads([lambda x=x, f=f: x.run(f, 1.0, time.monotonic() + 15.0)
                                   for x, f in zip(rounds, flats, strict=True)], 20.0)  # fmt: skip
            assert all(isinstance(x, RoundOutcome) for x in results), results
            assert all(torch.equal(x.flat, torch.full((3000,), 1.0)) for x in results)
        assert srv[0].refused["evicted"] > 100
    finally:
        flood.stop()
