"""Signed, expiring peer records and the signed run config, as stored in the DHT.

Every peer stores one ``PeerRecord`` under the key ``"{run_id}.peers"`` with its owner marker as the subkey, so
hivemind's ``RSASignatureValidator`` signs it and every DHT node rejects records not signed by the subkey's key.
Readers additionally check that the record's ``peer_id`` is the one derived from that key, so a peer cannot speak
for another. Records expire (``ttl_s``); peers refresh theirs every few seconds.

The coordinator stores the run config under the fixed key ``RUN_CONFIG_KEY`` the same way; a joiner accepts only a
config signed by a peer ID it trusts (the IDs in the bootstrap multiaddrs it was given).

Values are msgpack-serialised plain dicts (hivemind's MSGPackSerializer), validated with pydantic on read;
nothing is unpickled.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from typing import Annotated, Any, Literal

import hivemind
from hivemind.utils import get_dht_time
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hivetrain import __version__
from hivetrain.peers.identity import peer_id_of_owner
from hivetrain.peers.membership import MAX_REVOKED

logger = logging.getLogger(__name__)

RUN_CONFIG_KEY = "hivetrain.run_config"
MAX_SHARD_BITS = 10  # peers/record_shards.py: at most 2^10 shard keys per level
MAX_WITNESSED = 8  # entries of ``PeerRecord.witnessed`` (diloco/credit.py publishes WITNESSES = 3)
Role = Literal["trainer", "coordinator", "stage_server", "pipeline_trainer"]


def peers_key(run_id: str) -> str:
    return f"{run_id}.peers"


class PeerRecord(BaseModel):
    """What a peer tells the swarm about itself. Units: samples/s, seconds (unix time), samples."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    peer_id: str = Field(min_length=1, max_length=128)
    role: Role
    version: str = Field(max_length=32)
    run_id: str = Field(max_length=64)
    model_fingerprint: str = Field(max_length=64)
    epoch: int = Field(ge=0)
    throughput: float = Field(ge=0.0, le=1e12, description="samples/s over the last inner phase")
    state_hash: str = Field(default="", max_length=64, description="sha256 of TrainingState at `epoch`")
    param_sketch: str = Field(
        default="", max_length=2732, description="base64 count sketch of θ at `epoch` (2 KiB fp32, diloco/drift.py)"
    )
    samples_total: int = Field(default=0, ge=0, description="samples this peer has contributed to committed steps")
    witnessed: tuple[tuple[Annotated[str, Field(min_length=1, max_length=128)], Annotated[int, Field(ge=0)]], ...] = (
        Field(
            default=(),
            max_length=MAX_WITNESSED,
            description="(peer id, samples) of the members of our last committed round we witness (diloco/credit.py)",
        )
    )
    witnessed_epoch: int = Field(default=0, ge=0, description="the epoch that round committed into (0: none yet)")
    compute_s: float = Field(default=0.0, ge=0.0, description="seconds spent in inner steps")
    public_name: str = Field(default="", max_length=64)
    maddrs: tuple[str, ...] = Field(default=(), max_length=16)
    reachable: bool = True
    stage: int | None = Field(default=None, ge=0, le=1024)
    loss: float | None = Field(default=None, description="mean training loss of the last inner phase, nats")
    eval_loss: float | None = Field(default=None, description="held-out loss at `epoch`, nats")
    rounds_committed: int = Field(default=0, ge=0)
    rounds_failed: int = Field(default=0, ge=0)
    last_round_s: float | None = Field(default=None, ge=0.0, description="duration of the last committed round")
    last_group_size: int = Field(default=0, ge=0)
    last_failure: str = Field(default="", max_length=200, description="reason of the last failed round")
    phase_epoch: int = Field(default=0, ge=0, description="epoch (round key) the inner phase in progress is for")
    phase_samples: int = Field(default=0, ge=0, description="samples computed so far for `phase_epoch`")
    done_epoch: int = Field(default=0, ge=0, description="epoch (round key) of the last inner phase that ended")
    done_samples: int = Field(default=0, ge=0, description="samples of that phase (0: no phase ended yet)")
    left_reason: str = Field(default="", max_length=200, description="set in the last record of a peer that left")
    paused: bool = Field(default=False, description="the volunteer paused training (it stays in the swarm)")
    join_token: str = Field(
        default="", max_length=2048, description="join token of an invite-only run (peers/membership.py); '' = none"
    )
    record_shard_bits: int = Field(
        default=0,
        ge=0,
        le=MAX_SHARD_BITS,
        description="the coordinator's: the level trainers store their records at (peers/record_shards.py); "
        "0 = one key",
    )
    revoked: tuple[tuple[Annotated[str, Field(max_length=128)], float], ...] = Field(
        default=(),
        max_length=MAX_REVOKED,
        description="the token issuer's revocation list (its own record only): (peer id, unix s), that peer's join "
        "tokens issued at or before are void (peers/membership.py)",
    )
    updated_at: float = Field(ge=0.0)


def live_records(
    records: Iterable[PeerRecord],
    now: float | None,
    ttl_s: float | None,
    *,
    role: Role | None = "trainer",
    banned: Collection[str] = frozenset(),
    exclude: Collection[str] = (),
    paused: bool = True,
    departed: bool = False,
) -> list[PeerRecord]:
    """The records that count as live peers: the one home of "which records count" for every decision that reads them.

    A record counts when it is no older than ``ttl_s`` seconds at ``now`` (DHT time; either None: no age limit), has
    ``role`` (None: any role), its peer is not in ``banned`` nor ``exclude`` (e.g. our own ID), and, unless asked for,
    is not a departed peer's last record (``departed=True`` keeps them: what a peer did before leaving still counts,
    e.g. that it committed a round) and counts paused volunteers (``paused=False`` drops them: they will not average
    until they resume). Each caller states its choice of the two; the defaults are what most rules want. Pure; the
    order of ``records`` is kept."""
    return [
        r
        for r in records
        if (role is None or r.role == role)
        and (departed or not r.left_reason)
        and (paused or not r.paused)
        and r.peer_id not in banned
        and r.peer_id not in exclude
        and (now is None or ttl_s is None or now - r.updated_at <= ttl_s)
    ]


class RunConfigRecord(BaseModel):
    """The run config as the coordinator publishes it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_config: dict[str, Any]
    version: str = Field(max_length=32)
    coordinator_id: str = Field(max_length=128)
    published_at: float
    run_started_at: float | None = Field(
        default=None, ge=0.0, description="DHT time of the run's epoch 0 (the run-age bound); None = unknown"
    )


def versions_compatible(local: str, remote: str) -> tuple[bool, str]:
    """Peers interoperate when their hivetrain major.minor versions are equal. Returns (ok, reason)."""
    try:
        a, b = Version(local), Version(remote)
    except InvalidVersion:
        return False, f"unparseable version {remote!r}"
    if (a.major, a.minor) != (b.major, b.minor):
        return False, f"hivetrain {remote} is incompatible with {local} (major.minor must match)"
    return True, "compatible"


def check_compatible(record: PeerRecord, run_id: str, model_fingerprint: str) -> tuple[bool, str]:
    """Whether ``record``'s peer can take part in our run. Returns (ok, reason)."""
    if record.run_id != run_id:
        return False, f"peer {record.peer_id} belongs to run {record.run_id!r}, not {run_id!r}"
    ok, reason = versions_compatible(__version__, record.version)
    if not ok:
        return False, f"peer {record.peer_id}: {reason}"
    if record.model_fingerprint != model_fingerprint:
        return False, (
            f"peer {record.peer_id} trains a different model (fingerprint {record.model_fingerprint[:12]}, "
            f"ours {model_fingerprint[:12]})"
        )
    return True, "compatible"


class IncompatibleRun(RuntimeError):
    """This peer cannot take part in the run: another model, another run id or an incompatible hivetrain version
    (the message names the difference and the fix)."""


def refuse_other_models(dht: hivemind.DHT, run_id: str, own_peer_id: str, fingerprint: str, model_name: str) -> None:
    """Refuse to train a model other than the run's: our ``fingerprint`` (sha256 of θ₀'s tensors) against the
    coordinator's record, or every live peer's when no coordinator publishes one.

    Raises:
        IncompatibleRun: a record of the run disagrees (its message names the peer, both fingerprints and the fix).
    """
    records = [r for r in fetch_records(dht, run_id) if r.peer_id != own_peer_id]
    authority = [r for r in records if r.role == "coordinator"] or records
    for record in authority:
        ok, reason = check_compatible(record, run_id, fingerprint)
        if not ok:
            raise IncompatibleRun(
                f"refusing to join run {run_id!r}: {reason}. "
                f"This peer's model: {model_name!r}, fingerprint {fingerprint[:12]} (a pretrained start needs "
                "the same weights: sha256 of the tensors)."
            )


def publish_record(
    dht: hivemind.DHT, owner_marker: bytes, record: PeerRecord, ttl_s: float, key: str | None = None
) -> bool:
    """Store (or refresh) our signed record for ``ttl_s`` seconds under ``key`` (default: the run's level-0 peers
    key; a shard key from ``peers/record_shards.py`` otherwise). Returns whether any DHT node accepted it."""
    expiration = get_dht_time() + ttl_s
    value = record.model_dump(mode="json")
    return bool(dht.store(key or peers_key(record.run_id), value, expiration, subkey=owner_marker))


def fetch_records_at(
    dht: hivemind.DHT, keys: Sequence[str], run_id: str, timeout_s: float = 30.0
) -> dict[str, list[PeerRecord] | None]:
    """The valid records under each of ``keys`` (shard keys of one run), read in parallel.

    Returns key -> its records (sorted by peer ID), or None for a key whose read failed or took longer than
    ``timeout_s`` seconds (the caller keeps what it read before). Never raises for a failed read."""
    if len(keys) == 1:  # the common case (level 0): no futures
        try:
            return {keys[0]: fetch_signed_records(dht, keys[0], PeerRecord, run_id)}
        except Exception as exc:  # noqa: BLE001 - reported as a failed read
            logger.warning("could not read %s: %r", keys[0], exc)
            return {keys[0]: None}
    futures: dict[str, Any] = {}
    for key in keys:
        try:
            futures[key] = dht.get(key, latest=True, return_future=True)
        except Exception as exc:  # noqa: BLE001 - reported as a failed read
            logger.warning("could not read %s: %r", key, exc)
            futures[key] = None
    out: dict[str, list[PeerRecord] | None] = {}
    for key, future in futures.items():
        try:
            if future is None:
                raise RuntimeError("the read could not start")
            found = future.result(timeout=timeout_s)
            out[key] = _parse_records(found, PeerRecord, run_id)
        except Exception as exc:  # noqa: BLE001 - a timeout or DHT error: this key is not read this time
            logger.warning("could not read %s: %r", key, exc)
            out[key] = None
    return out


def fetch_records(dht: hivemind.DHT, run_id: str, latest: bool = True) -> list[PeerRecord]:
    """All valid, unexpired records of the run. Records whose payload is malformed or whose peer_id does not
    match the signing key are dropped (and logged at debug level)."""
    return fetch_signed_records(dht, peers_key(run_id), PeerRecord, run_id, latest=latest)


def fetch_signed_records(
    dht: hivemind.DHT, key: str, schema: type[BaseModel], run_id: str, latest: bool = True
) -> list[Any]:
    """Every valid, unexpired record under ``key`` (one per signer subkey) whose ``peer_id`` is its signer's and
    whose ``run_id`` is ``run_id``, sorted by peer ID. Malformed and forged records are dropped."""
    return _parse_records(dht.get(key, latest=latest), schema, run_id)


def _parse_records(found: Any, schema: type[BaseModel], run_id: str) -> list[Any]:
    if found is None or not isinstance(found.value, dict):
        return []
    records = []
    for subkey, item in found.value.items():
        record = parse_signed(subkey, item.value, schema, id_field="peer_id")
        if record is not None and record.run_id == run_id:
            records.append(record)
    return sorted(records, key=lambda r: r.peer_id)


def publish_run_config(dht: hivemind.DHT, owner_marker: bytes, record: RunConfigRecord, ttl_s: float) -> bool:
    """Store the signed run config for ``ttl_s`` seconds."""
    expiration = get_dht_time() + ttl_s
    return bool(dht.store(RUN_CONFIG_KEY, record.model_dump(mode="json"), expiration, subkey=owner_marker))


def fetch_run_config(dht: hivemind.DHT, trusted_ids: set[str]) -> RunConfigRecord | None:
    """The newest run config signed by one of ``trusted_ids`` (base58 peer IDs), or None if none is stored."""
    found = dht.get(RUN_CONFIG_KEY, latest=True)
    if found is None or not isinstance(found.value, dict):
        return None
    best = None
    for subkey, item in found.value.items():
        record = parse_signed(subkey, item.value, RunConfigRecord, id_field="coordinator_id")
        if record is None or record.coordinator_id not in trusted_ids:
            continue
        if best is None or record.published_at > best.published_at:
            best = record
    return best


def parse_signed(subkey: Any, value: Any, schema: type[BaseModel], id_field: str) -> Any:
    """Validate a DHT value against ``schema`` and check that ``value[id_field]`` is the peer ID of the subkey's
    signing key. Returns the parsed record, or None (logged) for anything malformed or forged."""
    if not isinstance(subkey, bytes) or not isinstance(value, dict):
        return None
    try:
        record = schema.model_validate(value)
        signer = peer_id_of_owner(subkey)
    except (ValidationError, ValueError) as exc:
        logger.debug("dropping malformed %s: %s", schema.__name__, exc)
        return None
    if getattr(record, id_field) != signer:
        logger.warning("dropping %s: claims %s but is signed by %s", schema.__name__, getattr(record, id_field), signer)
        return None
    return record
