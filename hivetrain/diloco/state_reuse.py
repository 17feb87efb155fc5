"""Chunks a state download writes itself instead of asking donors for them (``state_fetch``).

A manifest names each chunk by its sha256, and the assembled state is checked against the published state hash, so
bytes the downloader already has are as good as a donor's whenever their hash matches the manifest's:

- **all-zero chunks**: the outer momentum at μ = 0 (the default) is all zeros, half the state (a coordinator
  following a 50 MB model pulled 100.7 MB per epoch from volunteers' uplinks; dev/LOG.md, session 39);
- **chunks of the state we hold**: a peer or follower one or a few epochs behind holds most of the new state's bytes
  when the outer steps since changed only part of it. With fragments (``diloco.fragments``, Streaming DiLoCo) an
  epoch changes one fragment's θ and momentum: a follower that downloads every epoch moves 1/F of the state, not
  all of it. With whole-model rounds every θ chunk changes and nothing but the zeros is reused.

Cost: one sha256 pass over the local state per manifest's chunk size (6 ms per million parameters of θ and momentum
on one core), in the executor, not on the event loop; nothing when the manifest names no chunk we could hold.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_file import StateFile
from hivetrain.diloco.state_wire import layout_num_bytes, read_range, state_segments, zeros_sha256


class KnownChunks:
    """The bytes a downloader holds for a chunk of a manifest, if their hash is the manifest's.

    Args:
        local: the state we hold (any epoch of the same model; in memory or on disk), or None (zeros only). A state
            of another layout than ``num_bytes`` is ignored.
        num_bytes: the flat size of our model's state (``state_wire.layout_num_bytes``).
    """

    def __init__(self, local: TrainingState | StateFile | None, num_bytes: int):
        self._read: Callable[[int, int], bytes] | None = None
        if isinstance(local, StateFile) and local.num_bytes() == num_bytes:
            self._read = local.read_range
        elif isinstance(local, TrainingState) and layout_num_bytes(local) == num_bytes:
            segments = state_segments(local)
            self._read = lambda start, end: read_range(segments, start, end)
        self._hashes: dict[tuple[int, int], str] = {}

    def get(self, start: int, end: int, digest: str) -> bytes | None:
        """Bytes ``[start, end)`` of the flat state whose sha256 is ``digest``, if we hold them; else None."""
        if digest == zeros_sha256(end - start):
            return bytes(end - start)
        if self._read is None:
            return None
        known = self._hashes.get((start, end))
        if known is None:
            data = self._read(start, end)
            known = self._hashes[(start, end)] = hashlib.sha256(data).hexdigest()
            return data if known == digest else None
        return self._read(start, end) if known == digest else None
