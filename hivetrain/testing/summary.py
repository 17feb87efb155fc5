"""Read the files a local swarm wrote (peer summaries, JSON-lines metrics) into one run summary."""

from __future__ import annotations

import json
from pathlib import Path

from hivetrain.diloco.drift import drift_by_epoch, sketch_from_text
from hivetrain.testing.launcher import PeerProcess


def read_events(path: Path | None) -> list[dict]:
    """JSON-lines events of one peer (a torn last line, from a killed peer, is skipped)."""
    if path is None or not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def read_peer_summary(peer: PeerProcess) -> dict | None:
    if peer.summary_path is None or not peer.summary_path.exists():
        return None
    try:
        return json.loads(peer.summary_path.read_text())
    except json.JSONDecodeError:
        return None


def ddp_equivalent_bytes(num_parameters: int, num_workers: int, total_inner_steps: int) -> int:
    """Bytes an fp32 ring all-reduce of the gradients after every inner step would send, all workers together.

    A ring all-reduce has every worker send 2·(N−1)/N of the gradient per step (Patarasuk & Yuan 2009).
    """
    if num_workers < 2:
        return 0
    per_worker_step = 2 * (num_workers - 1) / num_workers * num_parameters * 4
    return int(per_worker_step * total_inner_steps)


def build_summary(peers: list[PeerProcess], inner_steps: int, wall_s: float) -> dict:
    """The run summary ``local-swarm`` writes to summary.json (see README for the fields)."""
    summaries = {p.name: read_peer_summary(p) for p in peers}
    events = {p.name: read_events(p.metrics_path) for p in peers}
    state_hashes: dict[str, dict[str, str]] = {}
    sketches: dict[int, dict[str, bytes]] = {}
    initial, final, outer_steps, bytes_sent, total_inner = [], [], [], 0, 0
    num_parameters = 0
    peer_ids = []
    for name, summary in summaries.items():
        starts = [e for e in events[name] if e["event"] == "start"]
        if starts:
            initial.append(starts[0]["eval_loss"])
        if summary is None:
            continue
        peer_ids.append(summary["peer_id"])
        num_parameters = summary["num_parameters"]
        for epoch, digest in summary["state_hashes"].items():
            state_hashes.setdefault(epoch, {})[summary["peer_id"]] = digest
        for epoch, text in summary.get("param_sketches", {}).items():
            try:
                sketches.setdefault(int(epoch), {})[summary["peer_id"]] = sketch_from_text(text)
            except ValueError:
                continue
        if summary.get("final_eval_loss") is not None:
            final.append(summary["final_eval_loss"])
        outer_steps.append(summary["epoch"])
        bytes_sent += summary["bytes_sent"] + summary["state_bytes_downloaded"]
        total_inner += sum(1 for e in events[name] if e["event"] == "inner_phase") * inner_steps
    return {
        "peers": peer_ids,
        "outer_steps": min(outer_steps) if outer_steps else 0,
        "initial_eval_loss": initial[0] if initial else None,
        "final_eval_loss": sum(final) / len(final) if final else None,
        "final_eval_loss_per_peer": final,
        "state_hashes": dict(sorted(state_hashes.items(), key=lambda kv: int(kv[0]))),
        "param_drift": {str(epoch): value for epoch, (value, _) in drift_by_epoch(sketches).items()},
        "wall_s": wall_s,
        "bytes_sent_total": bytes_sent,
        "bytes_ddp_equivalent": ddp_equivalent_bytes(num_parameters, len(peer_ids), total_inner),
        "num_parameters": num_parameters,
        "rounds_failed": sum(s["rounds_failed"] for s in summaries.values() if s),
        "state_downloads": sum(s["state_downloads"] for s in summaries.values() if s),
    }
