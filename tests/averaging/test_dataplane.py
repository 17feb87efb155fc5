"""One-way pushes of signed matchmaking records to a data port: delivered to their handler, refused when forged,
oversized, or of a kind the server does not take."""

from __future__ import annotations

import socket
import struct
import time

import msgpack
import pytest

from hivetrain.averaging.handshake import Pusher, send_declaration, send_ready
from hivetrain.averaging.wire import MAX_HANDSHAKE_META_BYTES, VERSION


def _wait_until(predicate, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < end:
        time.sleep(0.01)
    return predicate()


def test_ready_pushes_reach_the_handler_and_forged_ones_count_as_rejected(servers) -> None:
    offered = []

    def on_ready(raw) -> bool:
        offered.append(raw)
        return raw.get("peer_id") == "good"  # stands for Matchmaker.offer_entry's signature check

    server = servers(on_ready=on_ready)
    send_ready("127.0.0.1", server.port, {"peer_id": "good"}, timeout_s=2.0)
    send_ready("127.0.0.1", server.port, {"peer_id": "forged"}, timeout_s=2.0)
    assert _wait_until(lambda: len(offered) == 2 and server.rejected == 1, 3.0)
    assert sorted(o["peer_id"] for o in offered) == ["forged", "good"]


def test_the_pusher_delivers_each_kind_to_its_handler_and_survives_a_dead_target(servers) -> None:
    entries, decls = [], []
    server = servers(
        on_ready=lambda raw: entries.append(raw) or True, on_declaration=lambda raw: decls.append(raw) or True
    )
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]

    class Target:
        def __init__(self, port: int):
            self.peer_id, self.host, self.port = f"p{port}", "127.0.0.1", port

    push = Pusher(timeout_s=1.0)
    push("ready", {"n": 1}, [Target(server.port), Target(dead_port)])
    push("group", {"n": 2}, [Target(server.port)])
    assert _wait_until(lambda: entries == [{"n": 1}] and decls == [{"n": 2}], 3.0)
    with pytest.raises(ValueError):
        Pusher(timeout_s=0)


def test_pushes_the_server_does_not_take_or_that_are_oversized_are_refused(servers) -> None:
    offered = []
    server = servers(on_ready=lambda raw: offered.append(raw) or True)  # no declaration handler
    send_declaration("127.0.0.1", server.port, {"leader": "X"}, timeout_s=2.0)
    assert _wait_until(lambda: server.rejected == 1, 3.0)
    big = msgpack.packb({"entry": {"pad": b"x" * MAX_HANDSHAKE_META_BYTES}}, use_bin_type=True)
    with socket.create_connection(("127.0.0.1", server.port), timeout=2) as raw:
        raw.sendall(struct.pack("<4sBBHIQ", b"HVA1", VERSION, 9, 0, len(big), 0) + big)  # a READY beyond the limit
        try:
            assert raw.recv(1) == b""
        except ConnectionResetError:
            pass
    assert _wait_until(lambda: server.rejected == 2, 3.0)
    assert offered == []
