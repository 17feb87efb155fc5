"""Stage servers' signed DHT records: which stage they serve, how fast, how loaded, and their gradient windows.

Every server stores one ``StageRecord`` under ``"{run_id}.swarm.servers"`` with its owner marker as the subkey, so
hivemind's ``RSASignatureValidator`` signs it and readers check that the record's ``peer_id`` is the signing key's
(``hivetrain.peers.records.parse_signed``). Records expire after ``SwarmConfig.record_ttl_s``: a server that dies or
stalls disappears from routing and rebalancing within that time, and trainers replay the gradients they had sent it
whose phase had not committed. Values are msgpack plain dicts validated with pydantic; nothing is unpickled.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Literal

import hivemind
from hivemind.utils import get_dht_time
from pydantic import BaseModel, ConfigDict, Field

from hivetrain.peers.records import PeerRecord, fetch_signed_records

logger = logging.getLogger(__name__)

ServerState = Literal["joining", "serving", "syncing", "moving"]


def servers_key(run_id: str) -> str:
    return f"{run_id}.swarm.servers"


class StageRecord(BaseModel):
    """What a stage server tells trainers and other servers. Units: microbatches/s, seconds (unix time).

    Attributes:
        throughput: estimated capacity, microbatches/s (one forward + one backward each), measured on this server.
        queue_len: microbatches waiting or running at the server.
        load: fraction of the last announce interval the server spent computing, in [0, 1].
        epoch: committed outer steps of the stage state this server holds; ``state_hash`` is that state's sha256.
        incarnation: changes when the server restarts or drops its uncommitted gradients.
        open_window: the server's current phase; lower phases are closed (committed unless listed in ``abandoned``).
        phase_microbatches: microbatches accumulated in the open phase (the stage's servers end their phase together
            once their sum reaches the stage's target).
        moving_to: while ``status`` is "moving", the stage it is moving to (rebalancing counts it there, so that
            other servers do not move to the same bottleneck while it downloads the stage; None otherwise).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    peer_id: str = Field(min_length=1, max_length=128)
    run_id: str = Field(max_length=64)
    model_fingerprint: str = Field(max_length=64)
    stage: int = Field(ge=0, le=1024)
    num_stages: int = Field(ge=1, le=1024)
    status: ServerState = "serving"
    throughput: float = Field(ge=0.0, le=1e9)
    queue_len: int = Field(default=0, ge=0, le=10**9)
    load: float = Field(default=0.0, ge=0.0, le=1.0)
    epoch: int = Field(default=0, ge=0)
    state_hash: str = Field(default="", max_length=64)
    incarnation: str = Field(default="", max_length=64)
    open_window: int = Field(default=0, ge=0)
    phase_microbatches: int = Field(default=0, ge=0)
    abandoned: tuple[int, ...] = Field(default=(), max_length=256)
    moving_to: int | None = Field(default=None, ge=0, le=1024)
    served_total: int = Field(default=0, ge=0)
    rebalances: int = Field(default=0, ge=0)
    updated_at: float = Field(ge=0.0)

    def as_peer_record(self, version: str, microbatch_size: int) -> PeerRecord:
        """The generic peer record (role "stage_server") that the coordinator's dashboard lists."""
        return PeerRecord(
            peer_id=self.peer_id,
            role="stage_server",
            version=version,
            run_id=self.run_id,
            model_fingerprint=self.model_fingerprint,
            epoch=self.epoch,
            throughput=self.throughput * microbatch_size,
            state_hash=self.state_hash,
            stage=self.stage,
            updated_at=self.updated_at,
        )


def publish_stage_record(dht: hivemind.DHT, owner_marker: bytes, record: StageRecord, ttl_s: float) -> bool:
    """Store (or refresh) our signed record for ``ttl_s`` seconds. Returns whether any DHT node accepted it."""
    expiration = get_dht_time() + ttl_s
    return bool(dht.store(servers_key(record.run_id), record.model_dump(mode="json"), expiration, subkey=owner_marker))


def fetch_stage_records(dht: hivemind.DHT, run_id: str) -> list[StageRecord]:
    """All valid, unexpired stage records of the run, sorted by peer ID (malformed or forged ones dropped)."""
    return fetch_signed_records(dht, servers_key(run_id), StageRecord, run_id)


def live_records(
    records: Iterable[StageRecord], now: float, max_age_s: float, fingerprint: str | None = None
) -> list[StageRecord]:
    """Records updated within ``max_age_s`` of ``now`` (and, if given, of the same model fingerprint)."""
    return [
        r
        for r in records
        if now - r.updated_at <= max_age_s and (fingerprint is None or r.model_fingerprint == fingerprint)
    ]
