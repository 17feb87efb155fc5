"""Admission for runs that want it: who is a member, decided the same way by every honest peer.

A run is permissionless by default (``admission.mode = "open"``). A run config can instead admit only:

- ``"allowlist"``: the peer IDs listed in ``admission.allowlist``;
- ``"token"``: those, plus any peer holding a join token for its own peer ID that the run's issuer signed
  (``hivetrain coordinator invite PEER_ID``).

The issuer (``admission.issuer``, by default the run's coordinator: the signer of the run config record) is always
a member. A peer carries its token in its signed peer record (``PeerRecord.join_token``), so anyone can check
anyone: the DHT record guard (``validators.RecordGuard``) drops records of non-members on every honest node, the
matchmaker groups only members, the data-plane server refuses HELLOs of non-members, state downloads use only member
donors and the state server answers only members (``MemberRoster``).

A join token is ``hvt1.`` + base64url(msgpack ``{"p": payload, "s": signature}``), about 900 characters, where
``payload`` is the msgpack map ``{"v": 1, "run": run_id, "peer": peer_id, "iat": issued_at, "exp": expires_at,
"key": issuer's RSA public key (OpenSSH bytes)}`` and ``signature`` the issuer's RSA signature (hivemind's
``RSAPrivateKey.sign``: PKCS#1 v1.5, SHA-256) of ``TOKEN_DOMAIN + payload``. The issuer's peer ID is derived from
``key``, so a token proves who signed it. Parsing bounds every size and type; nothing is unpickled. A token is a
bearer credential bound to one peer ID: useless to anyone without that peer's identity key.

Everything here except ``MemberRoster`` is pure (time injected).
"""

from __future__ import annotations

import base64
import binascii
import functools
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal

import base58
import msgpack
import multihash

__all__ = [
    "Admission",
    "AdmissionPolicy",
    "JoinToken",
    "MemberRoster",
    "NotAdmitted",
    "TokenError",
    "admit_self",
    "decide_membership",
    "make_token",
    "parse_token",
    "peer_id_problem",
    "refusal_message",
    "revocation_list",
    "run_policy",
]

Mode = Literal["open", "allowlist", "token"]
Cause = Literal[
    "open", "issuer", "allowlist", "token",  # admitted
    "not_listed", "no_token", "malformed", "bad_signature", "wrong_issuer", "wrong_run", "wrong_peer", "expired",
    "not_yet_valid", "revoked",
]  # fmt: skip
MAX_REVOKED = 128  # entries in the issuer's revocation list (``PeerRecord.revoked``)

TOKEN_PREFIX = "hvt1."
TOKEN_DOMAIN = b"hivetrain.join_token.v1|"
MAX_TOKEN_CHARS = 2048
MAX_PEER_ID_CHARS = 128
MAX_KEY_BYTES = 1024
MAX_SIGNATURE_BYTES = 1024
MAX_LIFETIME_S = 10 * 365 * 86400.0


def peer_id_problem(text: object) -> str | None:
    """What is wrong with ``text`` as a base58 libp2p peer ID (``Qm...``, ``12D3KooW...``), or None if nothing."""
    if not isinstance(text, str) or not 1 <= len(text) <= MAX_PEER_ID_CHARS:
        return f"{str(text)[:40]!r} is not a peer ID (a base58 string of at most {MAX_PEER_ID_CHARS} characters)"
    try:
        multihash.decode(base58.b58decode(text))
    except Exception:  # noqa: BLE001 - base58 and multihash raise several types
        return f"{text!r} is not a valid base58 peer ID (expected e.g. QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N)"
    return None


@dataclass(frozen=True)
class AdmissionPolicy:
    """Who a run admits, as every honest peer applies it. Picklable (it travels to the DHT process).

    Attributes:
        run_id: the run.
        mode: "open", "allowlist" or "token" (module docstring).
        allowlist: base58 peer IDs that are members in both closed modes.
        issuer: base58 peer ID whose signed tokens count ("" = unknown; required in "token" mode). Always a member.

    Raises:
        ValueError: a malformed peer ID, or "token" mode without an issuer.
    """

    run_id: str
    mode: Mode = "open"
    allowlist: frozenset[str] = frozenset()
    issuer: str = ""

    def __post_init__(self) -> None:
        if self.mode not in ("open", "allowlist", "token"):
            raise ValueError(f"admission mode {self.mode!r}: use 'open', 'allowlist' or 'token'")
        for peer_id in (*self.allowlist, *([self.issuer] if self.issuer else [])):
            problem = peer_id_problem(peer_id)
            if problem:
                raise ValueError(f"admission: {problem}")
        if self.mode == "token" and not self.issuer:
            raise ValueError(
                "admission.mode = 'token' needs the token issuer: join through the coordinator's address (its run "
                "config names it) or set admission.issuer to the coordinator's peer ID"
            )

    @property
    def closed(self) -> bool:
        return self.mode != "open"


@dataclass(frozen=True)
class JoinToken:
    """A parsed, signature-checked join token. Times are unix seconds."""

    run_id: str
    peer_id: str
    issuer: str
    issued_at: float
    expires_at: float


@dataclass(frozen=True)
class Admission:
    """Whether a peer is a member. ``cause`` is for programs (the names in ``Cause``), ``reason`` for people;
    ``expires_at`` and ``issued_at`` are the token's when a token admitted it (unix seconds), else None."""

    ok: bool
    cause: Cause
    reason: str
    expires_at: float | None = None
    issued_at: float | None = None


class TokenError(ValueError):
    """A join token that cannot be used: ``cause`` is "malformed" or "bad_signature"."""

    def __init__(self, cause: Cause, message: str):
        super().__init__(message)
        self.cause = cause


def _payload_bytes(run_id: str, peer_id: str, issued_at: float, expires_at: float, key: bytes) -> bytes:
    payload = {"v": 1, "run": run_id, "peer": peer_id, "iat": float(issued_at), "exp": float(expires_at), "key": key}
    return msgpack.packb(payload, use_bin_type=True)


def make_token(private_key, run_id: str, peer_id: str, issued_at: float, expires_at: float) -> str:
    """A join token for ``peer_id`` in ``run_id``, signed with ``private_key`` (hivemind ``RSAPrivateKey``).

    Args:
        private_key: the issuer's identity key (``Identity.private_key``).
        run_id: the run the token admits to.
        peer_id: the base58 peer ID of the invited peer.
        issued_at, expires_at: unix seconds; ``issued_at < expires_at <= issued_at + 10 years``.

    Raises:
        ValueError: a malformed peer ID, or bad times.
    """
    problem = peer_id_problem(peer_id)
    if problem:
        raise ValueError(problem)
    if not 0 <= issued_at < expires_at <= issued_at + MAX_LIFETIME_S:
        raise ValueError(f"need issued_at < expires_at <= issued_at + 10 years (got {issued_at}, {expires_at})")
    key = private_key.get_public_key().to_bytes()
    payload = _payload_bytes(run_id, peer_id, issued_at, expires_at, key)
    signed = msgpack.packb({"p": payload, "s": private_key.sign(TOKEN_DOMAIN + payload)}, use_bin_type=True)
    return TOKEN_PREFIX + base64.urlsafe_b64encode(signed).decode().rstrip("=")


def _unpack(data: bytes) -> object:
    return msgpack.unpackb(
        data, raw=False, strict_map_key=True, max_bin_len=4096, max_str_len=512, max_array_len=0, max_map_len=8
    )


@functools.lru_cache(maxsize=4096)
def parse_token(text: str) -> JoinToken:
    """Decode ``text`` and check its signature (not its run, peer, issuer or times: ``decide_membership`` does).

    Raises:
        TokenError: "malformed" (not a join token, or a field of the wrong type or size), "bad_signature" (the
            signature does not verify with the key in the token).
    """
    from hivetrain.peers.identity import peer_id_of_public_key  # hivemind: imported only when a token is used

    if not isinstance(text, str) or not text.startswith(TOKEN_PREFIX) or len(text) > MAX_TOKEN_CHARS:
        raise TokenError("malformed", f"not a join token (it starts with {TOKEN_PREFIX!r}, <= {MAX_TOKEN_CHARS} chars)")
    body = text[len(TOKEN_PREFIX) :].strip()
    try:
        outer = _unpack(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        if not isinstance(outer, dict) or set(outer) != {"p", "s"}:
            raise ValueError("not a signed payload")
        payload, signature = outer["p"], outer["s"]
        if not isinstance(payload, bytes) or not isinstance(signature, bytes) or len(signature) > MAX_SIGNATURE_BYTES:
            raise ValueError("payload or signature is not bytes")
        fields = _unpack(payload)
        if not isinstance(fields, dict) or set(fields) != {"v", "run", "peer", "iat", "exp", "key"}:
            raise ValueError("unexpected fields")
        run_id, peer_id, key = fields["run"], fields["peer"], fields["key"]
        issued_at, expires_at = fields["iat"], fields["exp"]
        if fields["v"] != 1 or not isinstance(run_id, str) or not isinstance(peer_id, str):
            raise ValueError("unknown version or mistyped run/peer")
        if not (isinstance(issued_at, float) and isinstance(expires_at, float)):
            raise ValueError("mistyped times")
        if not isinstance(key, bytes) or len(key) > MAX_KEY_BYTES or len(run_id) > 64:
            raise ValueError("mistyped or oversized key/run")
        if peer_id_problem(peer_id):
            raise ValueError("malformed peer ID")
        issuer = peer_id_of_public_key(key)
    except (ValueError, TypeError, binascii.Error, msgpack.UnpackException) as exc:
        raise TokenError("malformed", f"the join token is damaged ({exc})") from None
    from hivemind.utils.crypto import RSAPublicKey

    try:
        genuine = RSAPublicKey.from_bytes(key).verify(TOKEN_DOMAIN + payload, signature)
    except Exception:  # noqa: BLE001 - a key that does not load is a bad signature, whatever the type
        genuine = False
    if not genuine:
        raise TokenError("bad_signature", "the join token's signature does not verify (altered or truncated)")
    return JoinToken(run_id, peer_id, issuer, issued_at, expires_at)


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def decide_membership(
    peer_id: str, token: str, policy: AdmissionPolicy, now: float, revoked: Mapping[str, float] | None = None
) -> Admission:
    """Whether ``peer_id``, presenting ``token`` ("" = none), is a member of ``policy.run_id`` at ``now``.

    Args:
        peer_id: base58 peer ID (of the record's signer, or of the connection's authenticated peer).
        token: the join token it presents; ignored unless ``policy.mode`` is "token".
        policy: the run's admission policy.
        now: unix seconds (the record guard passes the record's own ``updated_at``, so its verdict never changes).
        revoked: the issuer's revocation list, peer ID -> unix seconds: that peer's tokens issued at or before it are
            void (a leaked token is refused before it expires; a new token issued later admits the peer again).
            Tokens only: the issuer and the allowlist are the run config's, changed by editing it.

    Returns:
        The admission; never raises.
    """
    if policy.mode == "open":
        return Admission(True, "open", "the run is open")
    if policy.issuer and peer_id == policy.issuer:
        return Admission(True, "issuer", "the run's coordinator")
    if peer_id in policy.allowlist:
        return Admission(True, "allowlist", "on the allowlist")
    if policy.mode == "allowlist":
        return Admission(False, "not_listed", f"{peer_id} is not on run {policy.run_id!r}'s allowlist")
    if not token:
        return Admission(False, "no_token", f"{peer_id} presents no join token for run {policy.run_id!r}")
    try:
        parsed = parse_token(token)
    except TokenError as exc:
        return Admission(False, exc.cause, str(exc))
    if parsed.run_id != policy.run_id:
        return Admission(False, "wrong_run", f"the join token is for run {parsed.run_id!r}, not {policy.run_id!r}")
    if parsed.peer_id != peer_id:
        return Admission(False, "wrong_peer", f"the join token was issued to {parsed.peer_id}, not to {peer_id}")
    if parsed.issuer != policy.issuer:
        return Admission(
            False,
            "wrong_issuer",
            f"the join token was signed by {parsed.issuer}, but run {policy.run_id!r} accepts tokens only from "
            f"{policy.issuer}",
        )
    if now > parsed.expires_at:
        return Admission(False, "expired", f"the join token expired at {_utc(parsed.expires_at)}")
    refusal = _revocation(peer_id, parsed.issued_at, revoked or {})
    if refusal is not None:
        return refusal
    if now < parsed.issued_at - 300.0:  # a clock far behind the issuer's
        return Admission(False, "not_yet_valid", f"the join token is valid only from {_utc(parsed.issued_at)}")
    return Admission(
        True, "token", f"invited until {_utc(parsed.expires_at)}", expires_at=parsed.expires_at,
        issued_at=parsed.issued_at,
    )  # fmt: skip


def _revocation(peer_id: str, issued_at: float, revoked: Mapping[str, float]) -> Admission | None:
    """The refusal of a token of ``peer_id`` issued at ``issued_at`` that ``revoked`` voids, else None."""
    cutoff = revoked.get(peer_id)
    if cutoff is None or issued_at > cutoff:
        return None
    why = f"the join token of {peer_id} (issued {_utc(issued_at)}) was revoked by the run's operator at {_utc(cutoff)}"
    return Admission(False, "revoked", why)


def revocation_list(entries: Iterable[tuple[str, float]]) -> dict[str, float]:
    """peer ID -> revocation time from ``(peer_id, unix seconds)`` pairs (``PeerRecord.revoked``): the latest time
    per peer; malformed entries (a bad peer ID, a time that is not finite) are dropped."""
    revoked: dict[str, float] = {}
    for peer_id, at in entries:
        if peer_id_problem(peer_id) is None and isinstance(at, int | float) and math.isfinite(at):
            revoked[peer_id] = max(float(at), revoked.get(peer_id, float("-inf")))
    return revoked


def refusal_message(admission: Admission, run_id: str, peer_id: str, identity_hint: str = "") -> str:
    """What a refused volunteer reads: what is wrong and exactly what to do.

    Args:
        admission: the refusal (``ok`` False).
        run_id: the run.
        peer_id: the volunteer's own peer ID.
        identity_hint: how the volunteer keeps this peer ID (e.g. "--identity-path ~/.hivetrain/id.key"); "" = none
            given (then the message says to pass one).
    """
    keep = (
        f"Keep {identity_hint}: the token is valid only for this peer ID."
        if identity_hint
        else "Add --identity-path PATH (a file is created once) so that your peer ID stays the same across restarts: "
        "a token is valid only for one peer ID, and without it every run makes a new one."
    )
    invite = f"`hivetrain coordinator invite {peer_id} --run-id {run_id}`"
    if admission.cause == "not_listed":
        return (
            f"run {run_id!r} admits only the peers on its allowlist, and your peer ID {peer_id} is not on it. Send "
            f"your peer ID to the run's operator, who adds it to [admission] allowlist in the run config and "
            f"restarts the coordinator; then run this command again. {keep}"
        )
    if admission.cause == "no_token":
        return (
            f"run {run_id!r} admits only invited peers; your peer ID is {peer_id}. Ask the run's operator to run "
            f"{invite} and pass the token it prints with --join-token TOKEN (or --join-token @FILE). {keep}"
        )
    if admission.cause == "expired":
        return f"{admission.reason}: ask the run's operator for a new one ({invite}) and pass it with --join-token."
    if admission.cause == "wrong_peer":
        return (
            f"{admission.reason} (your --identity-path). Join with the identity file the token was made for, or ask "
            f"the run's operator for a token for your peer ID: {invite}."
        )
    if admission.cause in ("wrong_run", "wrong_issuer"):
        return f"{admission.reason}. Ask the operator of run {run_id!r} for a token: {invite}."
    if admission.cause == "revoked":
        return (
            f"{admission.reason}. If this is a mistake, ask the run's operator for a new token ({invite}) and pass it "
            "with --join-token."
        )
    if admission.cause == "not_yet_valid":
        return f"{admission.reason}: your clock is far behind; enable NTP (`sudo timedatectl set-ntp true`)."
    return f"{admission.reason}. Copy the token again exactly (one line, no spaces), or ask for a new one: {invite}."


class MemberRoster:
    """The members this process knows of: the policy's static members plus the peers whose records carry a valid
    token (learned from the swarm view's records, which the record guard already filtered), less the tokens the
    issuer revoked (``PeerRecord.revoked`` of the issuer's own record in the same records: a revoked token stops
    admitting its peer at the first read that carries the list, i.e. within one record refresh). Thread-safe.

    Args:
        policy: the run's admission policy.
        clock: unix time, seconds (tests inject one).
        max_learned: tokens remembered at most (the oldest learned are forgotten first).
    """

    def __init__(self, policy: AdmissionPolicy, clock: Callable[[], float] = time.time, max_learned: int = 65536):
        self.policy, self.clock, self.max_learned = policy, clock, max_learned
        self._tokens: dict[str, tuple[str, float, float]] = {}  # peer id -> (token, issued_at, expires_at), unix s
        self._revoked: dict[str, float] = {}  # the issuer's list: peer id -> revoked at, unix seconds
        self._revoked_as_of = float("-inf")  # ``updated_at`` of the issuer record it came from
        self._source: Callable[[], Iterable] | None = None
        self._pulled_at = float("-inf")
        self._lock = threading.Lock()

    def follow(self, records: Callable[[], Iterable]) -> None:
        """Learn from ``records()`` (objects with ``peer_id``, ``join_token`` and, for the issuer's, ``revoked``,
        e.g. ``SwarmView.records``) when asked about a peer (at most every 0.5 s; must not block)."""
        self._source = records

    def observe(self, records: Iterable) -> None:
        """Learn the tokens of ``records`` that admit their peer now (others are ignored), and the issuer's newest
        revocation list among them."""
        if self.policy.mode != "token":
            return
        now = self.clock()
        for record in records:
            if record.peer_id == self.policy.issuer:
                self._note_revocations(record)
                continue
            token = getattr(record, "join_token", "")
            with self._lock:
                known = self._tokens.get(record.peer_id)
            if not token or (known is not None and known[0] == token):
                continue  # nothing to learn (a token is parsed and its signature checked once)
            admission = decide_membership(record.peer_id, token, self.policy, now)
            if admission.expires_at is not None and admission.issued_at is not None:
                with self._lock:
                    self._tokens.pop(record.peer_id, None)
                    self._tokens[record.peer_id] = (token, admission.issued_at, admission.expires_at)
                    while len(self._tokens) > self.max_learned:
                        del self._tokens[next(iter(self._tokens))]

    def _note_revocations(self, record) -> None:
        as_of = getattr(record, "updated_at", 0.0)
        revoked = revocation_list(getattr(record, "revoked", ()))
        with self._lock:
            if as_of >= self._revoked_as_of:  # an older copy of the issuer's record never undoes a revocation
                self._revoked, self._revoked_as_of = revoked, as_of

    def revoked(self) -> dict[str, float]:
        """The issuer's revocation list as last read: peer ID -> revoked at (unix seconds)."""
        with self._lock:
            return dict(self._revoked)

    def check(self, peer_id: str) -> Admission:
        """The admission of ``peer_id`` now, from what this roster knows (a token not seen yet counts as none)."""
        now = self.clock()
        static = decide_membership(peer_id, "", self.policy, now)
        if static.ok or self.policy.mode != "token":
            return static
        with self._lock:  # read the records again at most every 0.5 s: a new peer's token, a new revocation list
            pull = self._source is not None and now - self._pulled_at >= 0.5
            if pull:
                self._pulled_at = now
        if pull:
            self.observe(self._source())
        with self._lock:
            known = self._tokens.get(peer_id)
        if known is None:
            return static
        _, issued_at, expires_at = known
        if now > expires_at:
            return Admission(False, "expired", f"{peer_id}'s join token expired at {_utc(expires_at)}")
        with self._lock:
            refusal = _revocation(peer_id, issued_at, self._revoked)
        if refusal is not None:
            return refusal
        return Admission(True, "token", "invited", expires_at=expires_at, issued_at=issued_at)

    def admits(self, peer_id: str) -> bool:
        """Whether ``peer_id`` is a member now (``check(peer_id).ok``)."""
        return self.check(peer_id).ok


class NotAdmitted(RuntimeError):
    """This peer is not a member of the run it tries to join; the message says why and what to do."""


def run_policy(run_id: str, mode: Mode, allowlist: Iterable[str], issuer: str, coordinator_id: str) -> AdmissionPolicy:
    """The admission policy of a run from its ``[admission]`` table: the issuer is ``issuer`` if set, else the run's
    coordinator (``coordinator_id``: the signer of the run config we trust, or the coordinator itself; "" = unknown).

    Raises:
        ValueError: "token" mode with neither an issuer nor a known coordinator (the message says what to do).
    """
    return AdmissionPolicy(run_id, mode, frozenset(allowlist), issuer or coordinator_id)


def admit_self(policy: AdmissionPolicy, peer_id: str, token: str, now: float, identity_hint: str = "") -> Admission:
    """Check, before joining, that our own peer ID (with ``token``) is a member.

    Returns:
        The admission (``expires_at`` says until when a token admits us).

    Raises:
        NotAdmitted: we are not a member; the message names the cause and the fix (``refusal_message``).
    """
    admission = decide_membership(peer_id, token, policy, now)
    if not admission.ok:
        raise NotAdmitted(refusal_message(admission, policy.run_id, peer_id, identity_hint))
    return admission
