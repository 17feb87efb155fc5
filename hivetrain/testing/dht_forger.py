"""An attacker's DHT node without the record guard, and a guard-less probe of what honest nodes hold (chaos harness).

Issue 12, finding 2: one signed peer record claiming epoch 10^9, with a made-up state hash and an expiration of
now + 10^9 s, stored by an attacker who then left, froze a run for good. ``forge`` replays that attack: it starts a
client-mode hivemind DHT node (its own fresh identity; only hivemind's signature validator, so it signs what it
stores and has no ``RecordGuard`` of its own to refuse its forgery), stores the record under the run's peers key on
the nodes nearest to it, prints what the store returned, and leaves. ``probe`` starts another such node and reads the
key: what it prints is what the honest nodes hold, unfiltered by any guard of ours.

Usage (one JSON line on stdout, exit 0; exit 2 when the DHT could not be joined):

    python -m hivetrain.testing.dht_forger forge INITIAL_PEER RUN_ID [--epoch N] [--expires-in-s S]
    python -m hivetrain.testing.dht_forger probe INITIAL_PEER RUN_ID

Output of ``forge``: {"stored": bool (some node accepted it), "peer_id", "epoch", "expires_in_s"}. Output of
``probe``: {"ok": true, "records": [{"peer_id", "epoch", "expires_in_s"}, ...]} (expires_in_s: seconds after the
read), or {"ok": false, "error": ...}.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time

from hivetrain import __version__
from hivetrain.peers.identity import peer_id_of_owner
from hivetrain.peers.records import PeerRecord, peers_key

STARTUP_TIMEOUT_S = 30.0


def _start(initial_peer: str) -> tuple[hivemind.DHT, RSASignatureValidator]:
    validator = RSASignatureValidator()  # a fresh identity: a valid signer like any volunteer's
    dht = hivemind.DHT(
        initial_peers=[initial_peer],
        start=True,
        client_mode=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=[validator],
        startup_timeout=STARTUP_TIMEOUT_S,
    )
    return dht, validator


def _entries(dht: hivemind.DHT, run_id: str) -> list[tuple[dict, float]]:
    """(value, expiration) of every record under the run's peers key, as the nodes return them."""
    found = dht.get(peers_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    return [(item.value, item.expiration_time) for item in found.value.values() if isinstance(item.value, dict)]


def forge(initial_peer: str, run_id: str, epoch: int, expires_in_s: float) -> dict:
    """Store one forged, validly signed peer record (see the module docstring); returns what to print."""
    dht, validator = _start(initial_peer)
    try:
        marker = validator.local_public_key
        honest = [value for value, _ in _entries(dht, run_id) if value.get("role") == "trainer"]
        template = honest[0] if honest else {}
        now = get_dht_time()
        record = PeerRecord(
            peer_id=peer_id_of_owner(marker),
            role="trainer",
            version=str(template.get("version", __version__)),
            run_id=run_id,
            model_fingerprint=str(template.get("model_fingerprint", "")),
            epoch=epoch,
            throughput=1.0,
            state_hash=secrets.token_hex(32),
            updated_at=now,
        )
        stored = dht.store(peers_key(run_id), record.model_dump(mode="json"), now + expires_in_s, subkey=marker)
        return {"stored": bool(stored), "peer_id": record.peer_id, "epoch": epoch, "expires_in_s": expires_in_s}
    finally:
        dht.shutdown()


def probe(initial_peer: str, run_id: str) -> dict:
    """Read the run's peer records from the honest nodes, without a guard; returns what to print."""
    dht, _ = _start(initial_peer)
    try:
        now = get_dht_time()
        records = [
            {"peer_id": str(value.get("peer_id", "")), "epoch": value.get("epoch", 0), "expires_in_s": exp - now}
            for value, exp in _entries(dht, run_id)
        ]
        return {"ok": True, "records": records}
    finally:
        dht.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("forge", "probe"))
    parser.add_argument("initial_peer", help="multiaddr of a node of the run, with /p2p/<peer id>")
    parser.add_argument("run_id")
    parser.add_argument("--epoch", type=int, default=10**9, help="epoch the forged record claims")
    parser.add_argument("--expires-in-s", type=float, default=1e9, help="its expiration, seconds from now")
    args = parser.parse_args(argv)
    try:
        if args.action == "forge":
            out = forge(args.initial_peer, args.run_id, args.epoch, args.expires_in_s)
        else:
            out = probe(args.initial_peer, args.run_id)
    except Exception as exc:  # noqa: BLE001 - the harness reads the reason from the JSON line
        print(json.dumps({"ok": False, "stored": False, "error": f"{type(exc).__name__}: {exc}"[:300]}), flush=True)
        return 2
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
