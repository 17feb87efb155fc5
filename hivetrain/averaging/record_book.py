"""The signed matchmaking records a ``Matchmaker`` knows of, verified: pushed to us, read from the DHT, or ours.

Entries and declarations are checked once (signatures; membership in a run that requires it) and remembered, within
bounds (``MAX_PUSHED`` round keys and declarations per round key, ``MAX_PUSHED_ENTRIES`` entries per round key,
``MAX_VERIFIED`` signature checks), so a peer flooding our data port with valid records of other round keys can
evict what was pushed to us (we then wait for the DHT), never forge it. A new declaration that lists us goes on down
its relay tree (``group_records.relay_targets``). Thread-safe: pushes arrive on data-plane threads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from hivetrain.averaging.group_records import (
    GroupDeclaration,
    ReadyEntry,
    named_peers,
    relay_targets,
    verify_declaration,
    verify_entry,
)

logger = logging.getLogger(__name__)

MAX_PUSHED = 64  # pushed declarations remembered per round key, and round keys remembered
MAX_PUSHED_ENTRIES = 1024  # pushed ready entries remembered per round key (the latest per peer)
MAX_VERIFIED = 4096  # signature checks remembered


class RecordBook:
    """Verified records per round key (module docstring); the base of ``matchmaker.Matchmaker``.

    ``prefix``: the averager's prefix the signatures are bound to; ``push(kind, raw, targets)``: best-effort pushes
    (None: none); ``admits(peer id)``: whether a peer is a member of the run (None: an open run); ``peer_id()``: ours.
    """

    def __init__(self, prefix: str, *, push=None, admits=None, peer_id: Callable[[], str] = lambda: ""):
        self.prefix, self.push, self._peer_id = prefix, push, peer_id
        self.admits = admits  # peer id -> member of the run? (None: open run); non-members' records are dropped
        self._told: set[str] = set()
        self._decls: dict[str, list[GroupDeclaration]] = {}  # round key -> verified declarations: ours, pushed, read
        self._entries: dict[str, dict[str, ReadyEntry]] = {}  # round key -> peer id -> latest pushed entry
        self._verified: dict[object, bool] = {}  # record -> whether its signatures verify
        self._lock = threading.Lock()
        self._wake = threading.Event()  # set by every new record: ``Matchmaker.match`` decides again

    def _admitted(self, record: ReadyEntry | GroupDeclaration) -> bool:
        """In a run that requires membership, whether every peer ``record`` names is a member (asked each time:
        tokens expire). A non-member's records are expected there: logged once per peer, not as invalid."""
        outsider = "" if self.admits is None else next((p for p in named_peers(record) if not self.admits(p)), "")
        if outsider and outsider not in self._told and len(self._told) < 1024:
            self._told.add(outsider)
            logger.info("ignoring matchmaking records naming %s: not a member of this run", outsider)
        return not outsider

    def _verify(self, record: ReadyEntry | GroupDeclaration) -> bool:
        """Signature check, remembered (records are frozen and hashable; polls see the same ones again)."""
        with self._lock:
            known = self._verified.get(record)
        if known is not None:
            return known
        if isinstance(record, ReadyEntry):
            ok = verify_entry(self.prefix, record)
        else:
            ok = verify_declaration(self.prefix, record, lambda _, m: self._verify(m))
        with self._lock:
            self._verified[record] = ok
            while len(self._verified) > MAX_VERIFIED:
                del self._verified[next(iter(self._verified))]
        return ok

    def offer(self, raw: object) -> bool:
        """A declaration pushed to us over the data plane (any thread). Kept if valid and signed; returns that."""
        try:
            decl = GroupDeclaration.model_validate(raw)
        except ValueError:
            return False
        return self._found(decl, "pushed")

    def _found(self, decl: GroupDeclaration, how: str = "read") -> bool:
        """Keep ``decl`` (pushed to us, or read from its chunks) if its members are admitted and it verifies."""
        if not self._admitted(decl):
            return False
        if not self._verify(decl):
            logger.warning("dropping a %s group declaration that does not verify (leader %s)", how, decl.leader)
            return False
        self._remember(decl)
        return True

    def _remember(self, decl: GroupDeclaration) -> None:
        """Keep a verified declaration (at most ``MAX_PUSHED`` per round key and round keys) and wake ``match``.
        A new one that lists us goes on down its relay tree (``group_records.relay_targets``): as its leader we push
        it to our first ``DECLARATION_FANOUT`` members, as a member to our children, however it reached us."""
        with self._lock:
            known = self._decls.setdefault(decl.round_key, [])
            new = decl not in known
            if new:
                known.append(decl)
                del known[:-MAX_PUSHED]
            while len(self._decls) > MAX_PUSHED:  # forget the oldest round keys
                del self._decls[next(iter(self._decls))]
            self._wake.set()
        if new and self.push is not None and (targets := relay_targets(decl, self._peer_id())):
            self.push("group", decl.model_dump(), targets)

    def offer_entry(self, raw: object) -> bool:
        """A ready entry pushed to us by a peer that expects us to lead (any thread). Kept if valid and signed by its
        peer (the latest per peer, at most ``MAX_PUSHED_ENTRIES`` per round key); returns that."""
        try:
            entry = ReadyEntry.model_validate(raw)
        except ValueError:
            return False
        if not self._admitted(entry):
            return False
        if not self._verify(entry):
            logger.warning("dropping a pushed ready entry that does not verify (peer %s)", entry.peer_id)
            return False
        with self._lock:
            by_peer = self._entries.setdefault(entry.round_key, {})
            old = by_peer.get(entry.peer_id)
            if old is None and len(by_peer) >= MAX_PUSHED_ENTRIES:
                return False
            if old is None or entry.announced_at > old.announced_at:
                by_peer[entry.peer_id] = entry
            while len(self._entries) > MAX_PUSHED:
                del self._entries[next(iter(self._entries))]
            self._wake.set()
        return True

    def _merge(self, round_key: str, entries: list[ReadyEntry]) -> tuple[list[ReadyEntry], list[GroupDeclaration]]:
        """Entries the DHT showed plus those pushed to us (``decide`` keeps the latest per peer), and every
        declaration we know of: read, pushed, or ours."""
        with self._lock:
            pushed_entries = list(self._entries.get(round_key, {}).values())
            decls = list(self._decls.get(round_key, ()))
        return entries + pushed_entries, decls
