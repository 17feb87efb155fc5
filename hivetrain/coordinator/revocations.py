"""The token issuer's revocation list: a leaked join token stops admitting its peer before it expires.

``hivetrain coordinator revoke PEER_ID --revocations FILE`` adds an entry to a JSON file; the coordinator started
with ``--revocations FILE`` reads it again at every refresh and publishes it in its own signed peer record
(``PeerRecord.revoked``). Every honest peer reads that record with the others (``peers.membership.MemberRoster``):
from the first read that carries the entry, i.e. within one record refresh, the revoked peer is no member for it:
its records are left out of every decision, its matchmaking entries and data-plane HELLOs are refused, and no state
is served to or taken from it. A revocation voids the peer's tokens issued at or before its time, so the operator
can invite the same peer ID again with a new token.

The file: ``{"revoked": [{"peer_id": "Qm...", "revoked_at": 1795900000.0}, ...]}``, at most ``MAX_REVOKED``
entries (the record's size cap; a run that must revoke more should move to an allowlist or a new issuer). It is
written atomically (a temporary file renamed over it), so the coordinator never reads half of one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from pathlib import Path

from hivetrain.peers.membership import MAX_REVOKED, peer_id_problem

logger = logging.getLogger(__name__)


class RevocationsError(ValueError):
    """The revocation file cannot be read or written; the message names the file and the fix."""


def load_revocations(path: Path) -> dict[str, float]:
    """peer ID -> revoked at (unix seconds) from ``path``; {} if the file does not exist.

    Raises:
        RevocationsError: the file is not the JSON described in the module docstring (an entry with a malformed peer
            ID or time, more than ``MAX_REVOKED`` entries, unreadable).
    """
    path = Path(path)
    if not path.exists():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RevocationsError(f"cannot read the revocation list {path}: {exc}") from None
    entries = raw.get("revoked") if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        raise RevocationsError(f'{path} is no revocation list: expected {{"revoked": [{{"peer_id": ..., ...}}]}}')
    if len(entries) > MAX_REVOKED:
        raise RevocationsError(
            f"{path} lists {len(entries)} revoked peers, more than the {MAX_REVOKED} a coordinator record carries: "
            "move the run to an allowlist ([admission] mode = 'allowlist') or a new issuer"
        )
    revoked: dict[str, float] = {}
    for i, entry in enumerate(entries):
        peer_id = entry.get("peer_id") if isinstance(entry, dict) else None
        at = entry.get("revoked_at") if isinstance(entry, dict) else None
        problem = peer_id_problem(peer_id) if isinstance(peer_id, str) else "no peer_id"
        if problem or not isinstance(at, int | float) or isinstance(at, bool) or not math.isfinite(at):
            raise RevocationsError(f"{path}, entry {i}: {problem or f'revoked_at {at!r} is not a unix time'}")
        revoked[peer_id] = max(float(at), revoked.get(peer_id, -math.inf))
    return revoked


def revoke(path: Path, peer_id: str, at: float) -> dict[str, float]:
    """Add ``peer_id`` (revoked at ``at``, unix seconds) to the list in ``path`` (created if missing); returns the
    new list. A peer already listed gets the later of its two times.

    Raises:
        RevocationsError: a malformed peer ID, an unreadable list, or a full one (``MAX_REVOKED``).
    """
    problem = peer_id_problem(peer_id)
    if problem:
        raise RevocationsError(f"{problem}; give the peer ID the token was issued to")
    path = Path(path)
    revoked = load_revocations(path)
    revoked[peer_id] = max(at, revoked.get(peer_id, -math.inf))
    if len(revoked) > MAX_REVOKED:
        raise RevocationsError(
            f"{path} already lists {MAX_REVOKED} revoked peers, the most a coordinator record carries: move the run "
            "to an allowlist ([admission] mode = 'allowlist') or a new issuer"
        )
    body = {"revoked": [{"peer_id": p, "revoked_at": t} for p, t in sorted(revoked.items())]}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(body, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return revoked


class RevocationFile:
    """What the coordinator publishes: the list in ``path``, read again whenever the file changes. A file that
    becomes unreadable keeps the last good list (logged once per change), so an operator's typo never reinstates a
    revoked peer."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._seen: tuple[int, int] | None = None  # (mtime ns, size) of the last read
        self._revoked: dict[str, float] = {}

    def current(self) -> tuple[tuple[str, float], ...]:
        """The list as ``PeerRecord.revoked`` carries it, sorted by peer ID."""
        try:
            stat = self.path.stat()
            seen = (stat.st_mtime_ns, stat.st_size)
        except FileNotFoundError:
            seen = None
        if seen != self._seen:
            self._seen = seen
            try:
                self._revoked = load_revocations(self.path)
                logger.info("revocation list %s: %d revoked peer(s)", self.path, len(self._revoked))
            except RevocationsError as exc:
                logger.warning("%s; still publishing the last good list (%d peers)", exc, len(self._revoked))
        return tuple(sorted(self._revoked.items()))
