"""State donors that misbehave the ways issue 12 (finding 3) saw, shared by the state-download tests and the bench.

Each is a ``StateServer`` with one step changed, as a hostile peer's modified client would:

    NaNChunks   advertises its honest manifest but serves NaN bytes (every chunk fails its hash)
    Dripper     serves the honest state one byte every ``interval_s`` (never silent long enough to look dead)
    SilentMeta  never answers a manifest request (holds the joiner's first step up to its network timeout)
    Liar        serves its own state under the hash that ``lie_about_hash`` makes it claim; its manifest matches
                what it serves, so only the assembled state (or a NaN chunk) shows the lie

Every one counts what it did (``served_nan``, ``drips``, ``stalls``; the ``lie_about_hash`` fault's ``fired``), so a
test can assert that its attack really ran.
"""

from __future__ import annotations

import asyncio

import numpy as np

from hivetrain.diloco.state_sync import StateServer
from hivetrain.faults import Fault, FaultInjector


class NaNChunks(StateServer):
    """Advertises its honest manifest but serves NaN bytes of the right length."""

    served_nan = 0

    def _payload(self, snapshot, index):
        data = super()._payload(snapshot, index)
        if data is None:
            return None
        self.served_nan += 1
        return np.full(len(data) // 4, np.nan, dtype="<f4").tobytes()


class Dripper(StateServer):
    """Serves the honest state, one byte every ``interval_s`` seconds, at most ``max_drips`` bytes per chunk (then it
    stops writing; bounded so a test's leftover handlers end)."""

    drips = 0
    interval_s = 3.0
    max_drips = 20

    async def _write_chunk(self, writer, data):
        for i in range(min(len(data), self.max_drips)):
            writer.write(data[i : i + 1])
            await writer.drain()
            self.drips += 1
            await asyncio.sleep(self.interval_s)


class SilentMeta(StateServer):
    """Accepts manifest requests and never answers them (for ``stall_s`` seconds, then closes)."""

    stalls = 0
    stall_s = 60.0

    async def _reply_meta(self, writer, request):
        self.stalls += 1
        await asyncio.sleep(self.stall_s)
        return False


class Liar(StateServer):
    """Serves chunks of its own state whatever state hash a request names (the claim is ``lie_about_hash``'s)."""

    def _find(self, epoch, state_hash):
        return super()._find(epoch, None)


def lie_about_hash(claimed_hash: str) -> tuple[FaultInjector, Fault]:
    """Faults that make a donor's meta replies claim ``claimed_hash`` (pass the injector as the server's ``faults``).
    Returns the injector and the armed fault (its ``fired`` counts the lies told)."""
    faults = FaultInjector()
    lie = Fault("state.before_serve", "call", callback=lambda ctx: ctx["meta"].update(state_hash=claimed_hash), times=0)
    return faults, faults.arm(lie)
