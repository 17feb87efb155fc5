"""LoopThread: coroutines run on a background loop; daemon-teardown noise is quiet, other task errors are not."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from hivetrain.peers.loop import LoopThread

# Our own tasks' errors carry this text: daemon connections of peers that earlier tests in this process started may
# close during the test and log the same message (the suite run in another order counted 5 quiet records, not 1).
MARK = "Connection reset by peer (test_loop)"


class ControlClient:  # the name hivemind's p2pd client tasks carry
    async def _read_from_persistent_conn(self) -> None:
        raise ConnectionResetError(104, MARK)


async def _unrelated_task() -> None:
    raise ConnectionResetError(104, MARK)


def _leak_failed_task(loop: LoopThread, coro_fn) -> None:
    async def start() -> None:
        task = asyncio.get_running_loop().create_task(coro_fn())
        await asyncio.sleep(0.05)
        assert task.done()

    loop.run(start(), timeout_s=5)


def test_loop_runs_coroutines_and_times_out() -> None:
    loop = LoopThread()
    try:
        assert loop.run(asyncio.sleep(0, result=7), timeout_s=5) == 7
        with pytest.raises(TimeoutError):
            loop.run(asyncio.sleep(10), timeout_s=0.1)
    finally:
        loop.stop()


def test_unretrieved_daemon_connection_errors_are_debug_only(caplog) -> None:
    loop = LoopThread()
    try:
        with caplog.at_level(logging.DEBUG):
            _leak_failed_task(loop, ControlClient()._read_from_persistent_conn)
            _leak_failed_task(loop, _unrelated_task)
            gc.collect()
            loop.run(asyncio.sleep(0.05), timeout_s=5)
            gc.collect()
    finally:
        loop.stop()
    ours = [r for r in caplog.records if MARK in r.getMessage() or MARK in str(r.exc_info and r.exc_info[1])]
    quiet = [r for r in ours if "p2pd client connection closed" in r.getMessage()]
    loud = [r for r in ours if "never retrieved" in r.getMessage()]
    assert len(quiet) == 1 and quiet[0].levelno == logging.DEBUG
    assert len(loud) == 1 and "_unrelated_task" in loud[0].getMessage()
