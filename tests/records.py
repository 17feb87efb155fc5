"""Peer records for the tests of pure decisions: one builder, the fields a test does not name at neutral values."""

from hivetrain.peers.records import PeerRecord


def peer_record(peer_id: str, epoch: int = 0, updated_at: float = 100.0, **fields) -> PeerRecord:
    """A trainer's record of run "r" (model fingerprint "f", throughput 1 sample/s) with ``fields`` overriding."""
    defaults = dict(role="trainer", version="0.1.0", run_id="r", model_fingerprint="f", throughput=1.0)
    return PeerRecord(peer_id=peer_id, epoch=epoch, updated_at=updated_at, **{**defaults, **fields})
