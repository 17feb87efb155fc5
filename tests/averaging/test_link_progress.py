"""A link's send waits for progress: bytes leaving the send queue count, not only ``send()`` returning."""

import socket
import time

import pytest

from hivetrain.averaging.wire import Link, LinkClosed


class _SlowUplink:
    """A socket whose ``send`` times out ``timeouts`` times before it takes the data, while its send queue drains by
    ``drain`` bytes per call of the queue probe (0: a peer that acknowledges nothing)."""

    def __init__(self, timeouts: int, drain: int):
        self.timeouts, self.drain, self.queued, self.sent = timeouts, drain, 1 << 20, 0

    def settimeout(self, timeout_s: float) -> None:
        pass

    def send(self, view) -> int:
        if self.timeouts:
            self.timeouts -= 1
            raise TimeoutError("timed out")
        self.sent += view.nbytes
        return view.nbytes


def _link(sock: _SlowUplink, monkeypatch) -> Link:
    link = Link(sock, "peer", b"k" * 32, timeout_s=0.1)  # type: ignore[arg-type]

    def unsent_bytes() -> int:
        sock.queued -= sock.drain
        return sock.queued

    monkeypatch.setattr(link, "_unsent_bytes", unsent_bytes)
    return link


def test_a_send_that_times_out_while_the_queue_drains_keeps_waiting(monkeypatch) -> None:
    sock = _SlowUplink(timeouts=3, drain=1500)
    _link(sock, monkeypatch)._send(b"x" * 4096)
    assert sock.sent == 4096


def test_a_send_that_times_out_while_nothing_leaves_the_queue_is_a_stall(monkeypatch) -> None:
    sock = _SlowUplink(timeouts=1, drain=0)
    with pytest.raises(LinkClosed, match="no progress within the part timeout"):
        _link(sock, monkeypatch)._send(b"x" * 4096)
    assert sock.sent == 0


def test_the_kernel_reports_the_unacknowledged_bytes_of_a_real_socket_and_none_once_closed() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    try:
        link = Link(client, "peer", b"k" * 32, timeout_s=5.0)
        assert link._unsent_bytes() == 0
        link._send(b"x" * 100_000)
        deadline = time.monotonic() + 5
        while link._unsent_bytes() and time.monotonic() < deadline:  # loopback acknowledges at once
            time.sleep(0.01)
        assert link._unsent_bytes() == 0 and link.bytes_sent == 100_000
        client.close()
        assert link._unsent_bytes() is None
    finally:
        for s in (client, peer, server):
            s.close()
