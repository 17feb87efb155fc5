"""Records for the tests: one builder each, the fields a test does not name at neutral values."""

import os

from hivetrain.averaging.group_records import ReadyEntry
from hivetrain.peers.records import PeerRecord


def peer_record(peer_id: str, epoch: int = 0, updated_at: float = 100.0, **fields) -> PeerRecord:
    """A trainer's record of run "r" (model fingerprint "f", throughput 1 sample/s) with ``fields`` overriding."""
    defaults = dict(role="trainer", version="0.1.0", run_id="r", model_fingerprint="f", throughput=1.0)
    return PeerRecord(peer_id=peer_id, epoch=epoch, updated_at=updated_at, **{**defaults, **fields})


def ready_entry(key, peer_id: str, announced_at: float, **fields) -> ReadyEntry:
    """An unsigned matchmaking entry of ``peer_id`` (``key``: its hivemind RSAPrivateKey, whose public key the entry
    carries), announced at ``announced_at`` for 5 s in round "7", with ``fields`` overriding."""
    values = dict(
        peer_id=peer_id,
        round_key="7",
        session=os.urandom(16),
        host="127.0.0.1",
        port=4000,
        kx_public=os.urandom(32),
        announced_at=announced_at,
        deadline=announced_at + 5,
        public_key=key.get_public_key().to_bytes(),
    )
    return ReadyEntry(**{**values, **fields})
