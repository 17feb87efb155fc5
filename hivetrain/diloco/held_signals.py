"""Holding SIGINT and SIGTERM back across a stretch of collectives (``node_ranks.NodeInner``): a signal that comes in
the middle of an inner step of a multi-rank node is delivered at the step's end, where rank 0 can still tell the other
ranks to abort, instead of leaving them inside a collective that never completes."""

from __future__ import annotations

import os
import signal
import threading


class HeldSignals:
    """Holds SIGINT and SIGTERM back while rank 0 is between two collectives of an inner phase; ``deliver()`` (at a
    step boundary, where the followers can be sent ABORT) and leaving the block run the held signal's own handler
    (join-swarm's raises ``Interrupted``; the default SIGTERM ends the process). A no-op off the main thread, where
    Python cannot set signal handlers."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self) -> HeldSignals:
        self.held: list[tuple[int, object]] = []
        self.previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._hold) for sig in self.SIGNALS}
        return self

    def _hold(self, signum: int, frame) -> None:
        self.held.append((signum, frame))

    def _restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def deliver(self) -> None:
        """If a signal was held: restore the handlers and run the first held signal's (which may raise)."""
        if not self.held:
            return
        previous = dict(self.previous)
        self._restore()
        signum, frame = self.held[0]
        self.held = []
        handler = previous.get(signum, signal.SIG_DFL)
        if callable(handler):
            handler(signum, frame)
        elif handler == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def __exit__(self, *exc) -> None:
        self.deliver()
        self._restore()
