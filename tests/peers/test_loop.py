"""LoopThread: coroutines run on a background loop; daemon-teardown noise is quiet, other task errors are not."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from hivetrain.peers.loop import LoopThread


class ControlClient:  # the name hivemind's p2pd client tasks carry
    async def _read_from_persistent_conn(self) -> None:
        raise ConnectionResetError(104, "Connection reset by peer")


async def _unrelated_task() -> None:
    raise ConnectionResetError(104, "Connection reset by peer")


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
    quiet = [r for r in caplog.records if "p2pd client connection closed" in r.getMessage()]
    loud = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert len(quiet) == 1 and quiet[0].levelno == logging.DEBUG
    assert len(loud) == 1 and "_unrelated_task" in loud[0].getMessage()
