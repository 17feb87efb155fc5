"""A trainer's ledger of parameter gradients it sent to stage servers and that are not yet durable.

A stage server sums the parameter gradients of the backward calls it accepts into its current *phase* (see
``hivetrain.swarm.runtime``); they become durable only when the phase's outer step commits. Until then the trainer
keeps, per accepted backward call, the stage input and output gradient it sent (serialized, as sent), so that if the
phase is lost the gradients can be recomputed elsewhere:

* the server reports the phase closed and not abandoned  -> the entries are dropped (durable);
* the server reports the phase abandoned (failed outer step, the server moved), or a new incarnation (restart,
  reset after a stall), or its record vanished from the DHT (dead)  -> the entries are *replayed*: the same backward
  is recomputed on another server of the stage with ``replay=True``, which only adds the parameter gradients.

Each entry leaves the ledger exactly once, either as durable or as a replay, so no microbatch's gradient is lost with
a server and none is counted twice by servers whose state survives. The remaining gap: a server that dies between
committing a phase and announcing it gets that phase replayed once more (its commit reached the stage's average).

This module is pure bookkeeping: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from hivemind.proto import runtime_pb2


@dataclass(frozen=True)
class LedgerEntry:
    """One accepted backward call: ``stage`` of microbatch ``microbatch_id`` went into ``window`` at ``peer_id``."""

    stage: int
    microbatch_id: str
    peer_id: str
    incarnation: str
    window: int
    stage_input: runtime_pb2.Tensor
    grad_output: runtime_pb2.Tensor

    def num_bytes(self) -> int:
        return len(self.stage_input.buffer) + len(self.grad_output.buffer)


@dataclass
class GradientLedger:
    """Entries per server; ``observe`` and ``observe_live`` return the entries that must be replayed.

    Args:
        max_num_bytes: keep at most this many bytes of kept tensors; the oldest entries beyond it are dropped
            unprotected (counted in ``num_unprotected``).
    """

    max_num_bytes: int = 2**30
    entries: dict[str, list[LedgerEntry]] = field(default_factory=dict)
    num_bytes: int = 0
    num_durable: int = 0
    num_unprotected: int = 0
    _seq: dict[int, int] = field(default_factory=dict)
    _next_seq: int = 0

    def add(self, entry: LedgerEntry) -> None:
        self.entries.setdefault(entry.peer_id, []).append(entry)
        self._seq[id(entry)] = self._next_seq
        self._next_seq += 1
        self.num_bytes += entry.num_bytes()
        while self.num_bytes > self.max_num_bytes and self.entries:
            oldest_peer = min(self.entries, key=lambda p: self._seq[id(self.entries[p][0])])
            dropped = self.entries[oldest_peer].pop(0)
            if not self.entries[oldest_peer]:
                del self.entries[oldest_peer]
            self._seq.pop(id(dropped), None)
            self.num_bytes -= dropped.num_bytes()
            self.num_unprotected += 1

    def __len__(self) -> int:
        return sum(len(v) for v in self.entries.values())

    def _take(self, peer_id: str, keep) -> list[LedgerEntry]:
        kept, taken = [], []
        for entry in self.entries.get(peer_id, []):
            (kept if keep(entry) else taken).append(entry)
        if kept:
            self.entries[peer_id] = kept
        else:
            self.entries.pop(peer_id, None)
        self.num_bytes -= sum(e.num_bytes() for e in taken)
        for entry in taken:
            self._seq.pop(id(entry), None)
        return taken

    def observe(self, peer_id: str, incarnation: str, open_window: int, abandoned: Iterable[int]) -> list[LedgerEntry]:
        """Apply what ``peer_id`` reported about its windows. Returns the entries to replay (removed from the ledger);
        entries of closed, committed windows are dropped as durable."""
        abandoned = set(abandoned)
        replay: list[LedgerEntry] = []
        durable = 0

        def keep(entry: LedgerEntry) -> bool:
            nonlocal durable
            if entry.incarnation != incarnation or entry.window in abandoned:
                replay.append(entry)
                return False
            if entry.window < open_window:
                durable += 1
                return False
            return True

        self._take(peer_id, keep)
        self.num_durable += durable
        return replay

    def observe_live(self, live: dict[str, tuple[str, int, tuple[int, ...]]]) -> list[LedgerEntry]:
        """Apply a fresh view of the DHT: ``live`` maps peer_id -> (incarnation, open_window, abandoned) of servers
        whose records are live. Entries at servers absent from ``live`` are all returned for replay."""
        replay: list[LedgerEntry] = []
        for peer_id in list(self.entries):
            if peer_id in live:
                replay.extend(self.observe(peer_id, *live[peer_id]))
            else:
                replay.extend(self._take(peer_id, lambda _: False))
        return replay

    def forget(self, peer_id: str) -> list[LedgerEntry]:
        """Remove and return every entry at ``peer_id`` (e.g. to replay them)."""
        return self._take(peer_id, lambda _: False)
