"""``peers.node.LockedPipe``: several threads sending on hivemind's DHT command pipe at once (the record heartbeat,
matchmaking, the routing-table check) must not interleave their messages. Without the lock, two threads sending
100 KB messages while the reader lags corrupted the stream in 3 of 3 trials ("invalid load key"); the DHT process
would then wait forever on a broken stream."""

from __future__ import annotations

import multiprocessing as mp
import threading

from hivetrain.peers.node import LockedPipe


def test_messages_from_several_threads_arrive_whole_and_in_each_senders_order():
    reader, writer = mp.Pipe(duplex=False)
    pipe, per_sender, size = LockedPipe(writer), 40, 100_000  # larger than the pipe's buffer: several writes each
    got, errors = [], []

    def send(tag: int) -> None:
        for i in range(per_sender):
            pipe.send((tag, i, bytes([tag]) * size))

    def receive() -> None:
        try:
            for _ in range(3 * per_sender):
                got.append(reader.recv())
        except Exception as exc:  # noqa: BLE001 - a corrupt stream is the failure this test looks for
            errors.append(exc)

    threads = [threading.Thread(target=receive), *(threading.Thread(target=send, args=(t,)) for t in (1, 2, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and len(got) == 3 * per_sender
    for tag in (1, 2, 3):
        mine = [(i, body) for t, i, body in got if t == tag]
        assert [i for i, _ in mine] == list(range(per_sender))
        assert all(body == bytes([tag]) * size for _, body in mine)
    pipe.close()  # anything else goes to the wrapped connection
    assert writer.closed
