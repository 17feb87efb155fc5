"""DHT hygiene: every honest node refuses hivetrain records that are malformed, oversized, far-future or out of bounds.

hivemind calls a node's record validators when another node asks it to store a record, when a node returns records
to our reads, and on our own stores (``hivemind/dht/protocol.py``, ``node.py``). ``RecordGuard`` is one such
validator. A record it refuses is neither stored nor read by an honest node, so a hostile record can live only on the
hostile node itself, and every dictionary that node returns is dropped whole by honest readers (hivemind validates a
dictionary's every subkey). What a record must satisfy (``check_record``, a pure function of the record and ``now``):

- size: the serialized value is at most ``RecordBounds.max_*_bytes`` for its kind;
- one record per peer per key: the subkey is the signer's ``[owner:...]`` marker (``|ready``/``|group``/``|chunk``
  appended for matchmaking), so hivemind's ``RSASignatureValidator`` checked the signature, and the record's id field
  is the signer's peer ID (a peer can neither speak for another nor hold two records under one key);
- schema: the kind's pydantic model (``PeerRecord``, ``StageRecord``, ``RunConfigRecord``, ``ReadyEntry``,
  ``GroupDeclaration`` or its ``DeclarationRef`` and ``DeclarationChunk``, the pipeline's ``TrainerReport`` and
  ``RebalanceReport``) accepts the value, and a run-scoped record names the run of its key;
- time: the record's own timestamp (``updated_at``, ``published_at``, ``announced_at``, ``declared_at``) is at most
  ``max_clock_skew_s`` ahead of ``now``, its expiration at most the kind's TTL cap (plus the skew) ahead of ``now``,
  and at most that far after its timestamp (a record cannot claim to be older than its lifetime allows);
- epochs (``epoch``, ``phase_epoch``, ``done_epoch``) at most ``max_epoch``: a hard sanity cap; refusing a plausible
  but false epoch is the quorum rule's job (``hivetrain.diloco``);
- membership, for a run that requires it (``RecordGuard(admission=...)``, ``peers/membership.py``): a peer record's
  signer is a member, judged at the record's own ``updated_at`` (never at ``now``, so the verdict never changes),
  and a record admitted by a join token expires at most ``max_clock_skew_s`` after the token does. Stage records
  and matchmaking records are not checked here (their keys do not name the run's policy, and they carry no token):
  the matchmaker drops non-members' entries itself (``MemberRoster``).

Every rule is monotone in time where a record is alive: a record valid when stored stays valid until it expires, so
honest nodes never drop each other's dictionaries because time passed. Clocks differ between nodes, though, and
hivemind drops the whole dictionary a node returns if one of its records fails: a reader whose clock is behind a
storer's by more than a record's margin to the bounds drops that storer's answer for that key until its clock has
caught up (the rules are monotone in time: at most the clock difference). The allowance (``max_clock_skew_s``, 60 s)
is therefore far above the clock differences hivemind admits (3 s at bootstrap), so honest records, stamped with
their writer's ``now``, sit far inside the bounds; only a record aimed at the edge of one storer's clock can cause
such a drop, for readers behind that storer, for that long.

The TTL cap bounds how long an attacker's record outlives the attacker (the issue-12 freeze: one record with expiration
now + 10^9 s, kept forever, which also shadowed the owner's later refresh since a DHT node keeps the copy that
expires last).

Which records: DHT keys reach validators hashed (``DHTID``), so the guard knows a key only if told its name: the run
config key always, ``{run_id}.peers`` and its shard keys ``{run_id}.peers.b{bits}.{shard}`` (a record
there must be its signer's shard: ``check_shard``), ``{run_id}.swarm.servers``, ``{run_id}.swarm.trainer_reports`` and
``{run_id}.swarm.rebalances`` for each run given (``RecordGuard(run_ids=...)`` or ``PeerNode.guard_run``). A node on
older code does not know the last two keys and lets their records pass (signature checked by hivemind only): that is
what lets newer peers add them without older ones dropping anything (``swarm/reports.py``). Matchmaking keys
(``{prefix}.{round_key}.mm``, and a large declaration's chunk keys) change every round, so matchmaking records are
recognised by their subkey (``[owner:...]|ready``, ``|group`` or ``|chunk``) under any key. Anything else passes
unchanged (other hivemind users of the same DHT).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time
from pydantic import BaseModel

from hivetrain.averaging.decl_store import CHUNK_BYTES, INLINE_BYTES, DeclarationChunk, group_record_model
from hivetrain.averaging.group_records import GroupDeclaration, ReadyEntry
from hivetrain.peers.identity import peer_id_of_owner
from hivetrain.peers.membership import AdmissionPolicy, decide_membership
from hivetrain.peers.record_shards import all_shard_keys, shard_of
from hivetrain.peers.records import RUN_CONFIG_KEY, PeerRecord, RunConfigRecord, peers_key
from hivetrain.swarm.announce import StageRecord, servers_key
from hivetrain.swarm.reports import RebalanceReport, TrainerReport, rebalances_key, trainer_reports_key

logger = logging.getLogger(__name__)

RecordKind = Literal["peer", "stage", "run_config", "ready", "group", "chunk", "trainer_report", "rebalance_report"]
_RUN_SCOPED: tuple[RecordKind, ...] = ("peer", "stage", "trainer_report", "rebalance_report")

_OWNER_RE = re.compile(rb"^\[owner:(.+)\](?:\|(ready|group|chunk))?$", re.DOTALL)
_MATCHMAKING_TAILS = (b"]|ready", b"]|group", b"]|chunk")


@dataclass(frozen=True)
class RecordBounds:
    """What an honest node accepts in a hivetrain DHT record. Units: seconds of DHT (unix) time, bytes.

    The TTL caps sit well above the lifetimes the code uses, and at the config fields' own upper bounds:

    Args:
        max_record_ttl_s: cap on a peer, stage or pipeline report record's remaining lifetime (peers publish theirs
            for ``TrainerOptions.record_ttl_s`` / ``CoordinatorOptions.record_ttl_s``, 30 s by default, stage
            servers and pipeline trainers for ``swarm.record_ttl_s``, 5 s by default, a trainer's last report for
            60 s). Must be >= every record TTL of the run.
        max_round_ttl_s: cap for matchmaking entries and declarations (stored for ``averaging.round_timeout_s``,
            60 s by default, at most 3600 s).
        max_config_ttl_s: cap for the signed run config (``CoordinatorOptions.config_ttl_s``, 3600 s by default).
        max_clock_skew_s: how far a record's timestamp may be ahead of our clock (hivemind itself refuses to
            bootstrap a node whose clock is more than 3 s off its initial peers', so this is slack for drift).
        max_epoch: hard cap on any epoch a record claims.
        max_record_bytes: serialized size cap of a peer or stage record, and of a pipeline report.
        max_config_bytes: serialized size cap of the run config record.
        max_entry_bytes: serialized size cap of a matchmaking ready entry.
        max_declaration_bytes: serialized size cap of a group declaration stored inline, or of its reference (a
            declaration larger than ``decl_store.INLINE_BYTES``, ~200 members, is stored in chunks).
        max_chunk_bytes: serialized size cap of one chunk of a declaration (``decl_store.CHUNK_BYTES`` of data).

    Raises:
        ValueError: a bound is not positive.
    """

    max_record_ttl_s: float = 600.0
    max_round_ttl_s: float = 3600.0
    max_config_ttl_s: float = 7200.0
    max_clock_skew_s: float = 60.0
    max_epoch: int = 10**6
    max_record_bytes: int = 16 * 1024
    max_config_bytes: int = 64 * 1024
    max_entry_bytes: int = 8 * 1024
    max_declaration_bytes: int = INLINE_BYTES + 16 * 1024
    max_chunk_bytes: int = CHUNK_BYTES + 16 * 1024

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"RecordBounds.{name} must be > 0, got {value}")

    def ttl_cap_s(self, kind: RecordKind) -> float:
        if kind in _RUN_SCOPED:
            return self.max_record_ttl_s
        return self.max_config_ttl_s if kind == "run_config" else self.max_round_ttl_s

    def size_cap_bytes(self, kind: RecordKind) -> int:
        if kind in _RUN_SCOPED:
            return self.max_record_bytes
        return {
            "run_config": self.max_config_bytes,
            "ready": self.max_entry_bytes,
            "group": self.max_declaration_bytes,
            "chunk": self.max_chunk_bytes,
        }[kind]


@dataclass(frozen=True)
class Verdict:
    """Whether a record is accepted; ``reason`` is for people (logs), ``rule`` names the rule that refused it."""

    ok: bool
    rule: Literal["", "size", "subkey", "schema", "signer", "run", "time", "expiration", "epoch", "member"]
    reason: str


_ACCEPT = Verdict(True, "", "accepted")
_SCHEMAS: dict[RecordKind, tuple[type[BaseModel], str, str]] = {  # kind -> (model, id field, timestamp field)
    "peer": (PeerRecord, "peer_id", "updated_at"),
    "stage": (StageRecord, "peer_id", "updated_at"),
    "run_config": (RunConfigRecord, "coordinator_id", "published_at"),
    "ready": (ReadyEntry, "peer_id", "announced_at"),
    "group": (GroupDeclaration, "leader", "declared_at"),  # or its ``DeclarationRef`` (``group_record_model``)
    "chunk": (DeclarationChunk, "leader", "declared_at"),
    "trainer_report": (TrainerReport, "peer_id", "updated_at"),
    "rebalance_report": (RebalanceReport, "peer_id", "updated_at"),
}
_EPOCH_FIELDS: dict[RecordKind, tuple[str, ...]] = {"peer": ("epoch", "phase_epoch", "done_epoch"), "stage": ("epoch",)}


@functools.lru_cache(maxsize=4096)
def _signer_of(marker: bytes) -> str:
    return peer_id_of_owner(marker)


def check_record(
    kind: RecordKind,
    run_id: str,
    subkey: Any,
    value_bytes: bytes,
    expiration_time: float,
    now: float,
    bounds: RecordBounds,
    admission: AdmissionPolicy | None = None,
) -> Verdict:
    """Whether an honest node accepts one hivetrain record (the rules are in the module docstring).

    Args:
        kind: which record the key (or, for matchmaking, the subkey) says this is.
        run_id: the run of the key (``{run_id}.peers``, ``{run_id}.swarm.servers``, ...); ignored for other kinds.
        subkey: the deserialized subkey (bytes for every hivetrain record).
        value_bytes: the msgpack-serialized value, its hivemind signature already stripped.
        expiration_time: the record's DHT expiration, seconds of DHT time.
        now: our DHT time, seconds.
        bounds: the caps.
        admission: the run's admission policy for a peer record (None or open: no membership check).

    Returns:
        The verdict; never raises (any malformed input is a refusal).
    """
    cap = bounds.size_cap_bytes(kind)
    if len(value_bytes) > cap:
        return Verdict(False, "size", f"{kind} record of {len(value_bytes)} bytes exceeds {cap} bytes")
    match = _OWNER_RE.match(subkey) if isinstance(subkey, bytes) else None
    expected_tail = kind.encode() if kind in ("ready", "group", "chunk") else None
    if match is None or match.group(2) != expected_tail:
        return Verdict(False, "subkey", f"{kind} record's subkey is not its signer's owner marker")
    model, id_field, stamp_field = _SCHEMAS[kind]
    try:
        signer = _signer_of(b"[owner:" + match.group(1) + b"]")
        value = MSGPackSerializer.loads(value_bytes)
        model = group_record_model(value) if kind == "group" else model  # inline, or a large one's reference
        record = model.model_validate(value)
    except Exception as exc:  # noqa: BLE001 - msgpack, the marker parse and pydantic raise several types
        return Verdict(False, "schema", f"malformed {kind} record: {type(exc).__name__}: {str(exc)[:200]}")
    if getattr(record, id_field) != signer:
        return Verdict(False, "signer", f"{kind} record claims {getattr(record, id_field)} but is signed by {signer}")
    if kind in _RUN_SCOPED and record.run_id != run_id:
        return Verdict(False, "run", f"{kind} record of run {record.run_id!r} stored under run {run_id!r}")
    stamp, ttl_cap, skew = getattr(record, stamp_field), bounds.ttl_cap_s(kind), bounds.max_clock_skew_s
    if stamp > now + skew:
        return Verdict(
            False, "time", f"{stamp_field} is {stamp - now:.1f}s ahead of our clock (allowed {skew:g}s): clock skew?"
        )
    if expiration_time > now + ttl_cap + skew:
        return Verdict(
            False,
            "expiration",
            f"expires {expiration_time - now:.0f}s from now (cap {ttl_cap:g}s + {skew:g}s clock skew)",
        )
    if expiration_time - stamp > ttl_cap + skew:
        return Verdict(
            False,
            "time",
            f"expires {expiration_time - stamp:.0f}s after its {stamp_field} (cap {ttl_cap:g}s + {skew:g}s)",
        )
    if kind == "ready" and record.deadline > stamp + ttl_cap:
        return Verdict(False, "time", f"deadline {record.deadline - stamp:.0f}s after announced_at (cap {ttl_cap:g}s)")
    if kind == "ready" and record.window_closes_at > max(record.deadline, stamp):
        return Verdict(False, "time", "window_closes_at is after the entry's deadline")
    if isinstance(record, GroupDeclaration) and any(m.round_key != record.round_key for m in record.members):
        return Verdict(False, "schema", "a member's entry is for another round key than the declaration")
    for name in _EPOCH_FIELDS.get(kind, ()):
        if getattr(record, name) > bounds.max_epoch:
            return Verdict(False, "epoch", f"{name} {getattr(record, name)} exceeds the cap {bounds.max_epoch}")
    if kind == "peer" and admission is not None and admission.closed:
        return check_member(record, expiration_time, admission, skew)
    return _ACCEPT


def check_member(record: PeerRecord, expiration_time: float, admission: AdmissionPolicy, skew_s: float) -> Verdict:
    """Whether a peer record's signer is a member (judged at its ``updated_at``) and the record does not outlive
    its join token by more than ``skew_s`` seconds."""
    verdict = decide_membership(record.peer_id, record.join_token, admission, now=record.updated_at)
    if not verdict.ok:
        return Verdict(False, "member", f"not a member of run {admission.run_id!r}: {verdict.reason}")
    if verdict.expires_at is not None and expiration_time > verdict.expires_at + skew_s:
        return Verdict(False, "member", f"record expires {expiration_time - verdict.expires_at:.0f}s after its token")
    return _ACCEPT


def check_shard(subkey: bytes, bits: int, shard: int) -> Verdict:
    """Whether a peer record stored under shard ``shard`` of level ``bits`` belongs there: its signer's peer ID
    hashes to that shard (``record_shards.shard_of``), so no peer can fill shards other than its own. ``subkey`` is
    the owner marker ``check_record`` already accepted."""
    match = _OWNER_RE.match(subkey)
    try:
        signer = _signer_of(b"[owner:" + match.group(1) + b"]") if match else ""
    except Exception:  # noqa: BLE001 - check_record accepted the marker; anything else is a refusal
        signer = ""
    if not signer or shard_of(signer, bits) != shard:
        return Verdict(False, "shard", f"peer record stored in shard {shard} of level {bits}, not its signer's")
    return _ACCEPT


def key_id(key: str) -> bytes:
    """The bytes a validator sees as ``DHTRecord.key`` for the raw DHT key ``key``."""
    return DHTID.generate(source=key).to_bytes()


@functools.lru_cache(maxsize=64)
def shard_keys(run_id: str) -> dict[bytes, tuple[int, int]]:
    """Hashed shard keys of a run's peer records (``peers/record_shards.py``) -> (bits, shard)."""
    return {key_id(key): where for key, where in all_shard_keys(run_id).items()}


def run_keys(run_id: str) -> dict[bytes, tuple[RecordKind, str]]:
    """Hashed keys of a run's records -> (kind, run id); the peer-record shard keys are ``shard_keys``."""
    return {
        key_id(peers_key(run_id)): ("peer", run_id),
        key_id(servers_key(run_id)): ("stage", run_id),
        key_id(trainer_reports_key(run_id)): ("trainer_report", run_id),
        key_id(rebalances_key(run_id)): ("rebalance_report", run_id),
    }


class RecordGuard(RecordValidatorBase):
    """hivemind record validator applying ``check_record`` to the hivetrain records it recognises.

    Runs after ``RSASignatureValidator`` on validation (lower ``priority``), so it sees values whose signature was
    checked and stripped; it neither signs nor strips. Two guards merge into one (the run keys of both; the first
    one's bounds), so ``DHT.add_validators([RecordGuard(run_ids=(run,))])`` adds a run to a running node.

    Args:
        bounds: the caps.
        run_ids: runs whose peer and stage record keys are checked.
        clock: DHT time, seconds (default ``hivemind.utils.get_dht_time``); for tests. Must be picklable to be
            passed to ``DHT.add_validators``.
        admission: admission policies of runs that require membership (their runs are checked too); a policy
            merged in later replaces an earlier one of the same run.
    """

    def __init__(
        self,
        bounds: RecordBounds = RecordBounds(),
        run_ids: Iterable[str] = (),
        clock: Callable[[], float] | None = None,
        admission: Iterable[AdmissionPolicy] = (),
    ):
        self.bounds, self._clock = bounds, clock
        self._keys: dict[bytes, tuple[RecordKind, str]] = {key_id(RUN_CONFIG_KEY): ("run_config", "")}
        self._shard_runs: set[str] = set()  # runs whose shard keys we know (built lazily in the DHT process: the
        self._shards: dict[bytes, tuple[str, int, int]] | None = None  # guard crosses hivemind's pipe pickled)
        self._policies: dict[str, AdmissionPolicy] = {p.run_id: p for p in admission}
        for run_id in (*run_ids, *self._policies):
            self._keys.update(run_keys(run_id))
            self._shard_runs.add(run_id)
        self.num_refused = 0
        self._told: set[str] = set()

    def kind_of(self, record: DHTRecord) -> tuple[RecordKind, str] | None:
        """What the guard checks ``record`` as: (kind, run id), or None for records it leaves alone."""
        known = self._keys.get(record.key)
        if known is not None:
            return known
        shard = self._shard_map().get(record.key)
        if shard is not None:
            return "peer", shard[0]
        if record.subkey.endswith(_MATCHMAKING_TAILS) and b"[owner:" in record.subkey:
            return {b"y": "ready", b"p": "group", b"k": "chunk"}[record.subkey[-1:]], ""
        return None

    def check(self, record: DHTRecord) -> Verdict | None:
        """The verdict on ``record`` (signature already stripped), or None for a record the guard leaves alone."""
        known = self.kind_of(record)
        if known is None:
            return None
        kind, run_id = known
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:  # noqa: BLE001 - a subkey that does not deserialize is malformed
            subkey = None
        now = self._clock() if self._clock is not None else get_dht_time()
        policy = self._policies.get(run_id) if kind == "peer" else None
        verdict = check_record(kind, run_id, subkey, record.value, record.expiration_time, now, self.bounds, policy)
        shard = self._shard_map().get(record.key)
        if verdict.ok and shard is not None:
            verdict = check_shard(subkey, shard[1], shard[2])
        return verdict

    def _shard_map(self) -> dict[bytes, tuple[str, int, int]]:
        """Hashed shard key -> (run id, bits, shard) of every run we guard (``shard_keys``), built on first use."""
        if self._shards is None:
            self._shards = {k: (run, *where) for run in self._shard_runs for k, where in shard_keys(run).items()}
        return self._shards

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_shards"] = None  # thousands of hashed keys: rebuilt where the guard runs
        return state

    def validate(self, record: DHTRecord) -> bool:
        verdict = self.check(record)
        if verdict is not None and not verdict.ok:
            self.num_refused += 1
            if verdict.rule == "member" and verdict.reason not in self._told and len(self._told) < 1024:
                self._told.add(verdict.reason)  # once per cause: a non-member republishes every few seconds
                logger.info("refusing a peer record: %s", verdict.reason)
            else:
                logger.debug("refusing a record: %s", verdict.reason)
        return verdict is None or verdict.ok

    @property
    def priority(self) -> int:
        return 0  # below RSASignatureValidator's 10: validated after the signature is checked and stripped

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, RecordGuard):
            return False
        self._keys.update(other._keys)
        self._shard_runs |= other._shard_runs
        self._shards = None
        self._policies.update(other._policies)
        return True
