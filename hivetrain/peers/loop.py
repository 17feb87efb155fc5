"""A background asyncio event loop (uvloop when available) for a peer's RPCs, driven from synchronous code."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)


def _quiet_daemon_teardown(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """hivemind's p2pd client keeps a persistent connection served by two background tasks; when the daemon or the
    client closes (shutdown, a killed peer), they end with ConnectionResetError or "handler is closed", which asyncio
    would print as "Task exception was never retrieved" tracebacks. Those go to the debug log; anything else is
    reported as usual. (Calls made on a closed client still raise to their callers.)"""
    task, exc = context.get("future"), context.get("exception")
    coro = task.get_coro() if isinstance(task, asyncio.Task) else None
    if "_persistent_conn" in getattr(coro, "__qualname__", "") and isinstance(exc, ConnectionError | RuntimeError):
        logger.debug("p2pd client connection closed: %r", exc)
        return
    loop.default_exception_handler(context)


class LoopThread:
    """Runs one asyncio loop in a daemon thread; ``run(coro, timeout_s)`` executes a coroutine on it.

    hivemind's P2P objects are bound to the loop they were created on, so every P2P call of a peer goes through the
    same LoopThread.
    """

    def __init__(self, name: str = "hivetrain-loop"):
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is a dependency; this keeps Windows usable
            self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(_quiet_daemon_teardown)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coro`` on the loop and wait for its result.

        Raises:
            TimeoutError: it did not finish within ``timeout_s`` seconds (the coroutine is cancelled).
            Whatever ``coro`` raises.
        """
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout_s), self.loop)
        try:
            return future.result(timeout_s + 1.0)
        except asyncio.TimeoutError as exc:  # concurrent.futures / asyncio timeouts are TimeoutError subclasses
            future.cancel()
            raise TimeoutError(f"operation timed out after {timeout_s:.1f}s") from exc

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop and join the thread; idempotent."""
        if self.loop.is_running():

            async def cancel_all() -> None:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            try:
                asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(timeout_s)
            except Exception:  # noqa: BLE001 - stopping must not fail
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
