"""Read the files a local swarm wrote (peer summaries, JSON-lines metrics, logs) into one run summary.

Everything here reads with defaults: a peer killed before it wrote its summary, or written by an older hivetrain
without the newer fields, still counts with what its metrics events say. Times are unix seconds unless the name
ends in ``_s`` after a start (``at_s``: seconds after the swarm started).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from hivetrain.diloco.drift import drift_by_epoch, sketch_from_text
from hivetrain.localswarm.agreement import PeerSpan, describe_agreement, epoch_agreement, verdict
from hivetrain.localswarm.launcher import PeerProcess

_ERROR_LINES = (  # the message of an error line, as our loggers, hivemind's and ``cli.common.fail`` write them
    re.compile(r"(?:^|\s)(?:ERROR|CRITICAL) \S+: (?P<msg>.*)$"),  # "12:00:01 ERROR hivetrain.join_swarm: ..."
    re.compile(r"\[(?:ERROR|CRITICAL)\] (?:\[[^\]]*\] )?(?P<msg>.*)$"),  # "... [ERROR] [hivemind.dht:12] ..."
    re.compile(r"^error: (?P<msg>.*)$"),  # "error: --peers must be >= 1"
)


@dataclass(frozen=True)
class PeerFiles:
    """What a summary needs of one launched peer: its files and how its process ended.

    Attributes:
        name: "peer0", ...
        log_path, metrics_path, summary_path: its files (any may be missing on disk).
        exit_code: the process's exit status; None = unknown (still running).
        exited_at: unix time (s) its exit was noticed; None = unknown.
        stopped: it was still running when the launcher stopped everything (e.g. at ``--timeout``).
    """

    name: str
    log_path: Path | None = None
    metrics_path: Path | None = None
    summary_path: Path | None = None
    exit_code: int | None = None
    exited_at: float | None = None
    stopped: bool = False

    @classmethod
    def of(cls, proc: PeerProcess, stopped: bool = False) -> PeerFiles:
        return cls(
            proc.name,
            proc.log_path,
            proc.metrics_path,
            proc.summary_path,
            proc.popen.returncode,
            proc.exited_at,
            stopped,
        )


def read_events(path: Path | None) -> list[dict]:
    """JSON-lines events of one peer (a torn last line, from a killed peer, is skipped)."""
    if path is None or not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    return events


def read_peer_summary(peer: PeerProcess | PeerFiles) -> dict | None:
    """The peer's ``--summary-file`` (None if missing or torn)."""
    if peer.summary_path is None or not peer.summary_path.exists():
        return None
    try:
        summary = json.loads(peer.summary_path.read_text())
    except json.JSONDecodeError:
        return None
    return summary if isinstance(summary, dict) else None


def last_error_line(log_text: str) -> str:
    """The message of the last ERROR line of a peer's log ("" if none); a traceback after it adds its last line."""
    lines = log_text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        match = next(filter(None, (pattern.search(lines[i].strip()) for pattern in _ERROR_LINES)), None)
        if match is None:
            continue
        message = match.group("msg").strip()
        tail = lines[i + 1 :]
        if tail and tail[0].startswith("Traceback"):
            exception = next((line for line in reversed(tail) if line and not line[0].isspace()), "")
            message = f"{message}: {exception}" if exception and exception != tail[0] else message
        return message[:300]
    return ""


def exit_reason(summary: dict | None, log_path: Path | None, exit_code: int | None) -> str:
    """Why a peer left: its summary's ``exit_reason``, else the last ERROR line of its log, else "exit code N"."""
    if summary and summary.get("exit_reason"):
        return str(summary["exit_reason"])
    if log_path is not None and log_path.exists():
        found = last_error_line(log_path.read_text(errors="replace"))
        if found:
            return found
    return "still running" if exit_code is None else f"exit code {exit_code}"


def inner_steps_by_epoch(events: list[dict], batch_size: int, inner_steps: int) -> dict[int, int]:
    """Inner steps a peer ran, per epoch its pseudo-gradient was for (``round_key``, else the event's ``epoch``).

    Each ``inner_phase`` event counts its ``steps``; without that field ``samples // batch_size``; without that,
    ``inner_steps`` (H: the fixed phase of older trainers). Discarded phases count too: the steps were run.
    """
    steps: dict[int, int] = {}
    for e in events:
        if e.get("event") != "inner_phase":
            continue
        if e.get("steps") is not None:
            n = int(e["steps"])
        elif e.get("samples") is not None and batch_size > 0:
            n = int(e["samples"]) // batch_size
        else:
            n = inner_steps
        epoch = int(e.get("round_key", e.get("epoch", 0)))
        steps[epoch] = steps.get(epoch, 0) + n
    return steps


def ddp_equivalent_bytes(num_parameters: int, steps_by_epoch: dict[int, dict[str, int]]) -> int:
    """Bytes an fp32 ring all-reduce of the gradients after every inner step actually run would have sent.

    A ring all-reduce has each of N workers send 2·(N−1)/N of the gradient per step (Patarasuk & Yuan 2009). The
    DDP run doing the same work has, at each epoch e, the N_e peers that ran inner steps for e, and their S_e inner
    steps in all (a step of each worker is one of S_e)::

        bytes = Σ_e S_e · 2·(N_e − 1)/N_e · 4 · num_parameters

    An epoch that one peer trained alone (the others had left) adds nothing, as a one-worker DDP sends nothing;
    the epochs before they left still count.

    Args:
        num_parameters: trainable scalars of the model.
        steps_by_epoch: epoch -> peer -> inner steps it ran for that epoch (see ``inner_steps_by_epoch``).
    """
    total = 0.0
    for per_peer in steps_by_epoch.values():
        workers = sum(1 for n in per_peer.values() if n > 0)
        if workers >= 2:
            total += sum(per_peer.values()) * 2 * (workers - 1) / workers * 4 * num_parameters
    return int(total)


def peer_compute(summary: dict | None, events: list[dict], end: float | None) -> dict:
    """Samples and compute seconds of one peer, from its summary (preferred) or its events.

    ``compute_utilization`` = ``compute_s`` / ``wall_s``, the peer's wall time from its ``start`` event to its end
    (its summary's ``written_at``, else ``end``, else its last event); None when unknown.
    """
    summary = summary or {}

    def total(kind: str, field: str) -> float:
        return sum(float(e.get(field) or 0) for e in events if e.get("event") == kind)

    computed = summary.get("samples_computed")
    committed = summary.get("samples_total")
    discarded = summary.get("samples_discarded")
    compute_s = summary.get("compute_s")
    start = next((e["time"] for e in events if e.get("event") == "start" and "time" in e), None)
    stop = summary.get("written_at") or end or (events[-1].get("time") if events else None)
    wall_s = round(stop - start, 3) if start is not None and stop is not None and stop > start else None
    compute_s = float(compute_s if compute_s is not None else total("inner_phase", "compute_s"))
    return {
        "samples_computed": int(computed if computed is not None else total("inner_phase", "samples")),
        "samples_committed": int(committed if committed is not None else total("outer_step", "samples")),
        "samples_discarded": int(discarded if discarded is not None else total("samples_discarded", "samples")),
        "compute_s": round(compute_s, 3),
        "wall_s": wall_s,
        "compute_utilization": round(compute_s / wall_s, 4) if wall_s else None,
    }


def _state_hashes(summary: dict | None, events: list[dict]) -> dict[int, str]:
    """epoch -> state hash: the summary's, else (a peer killed before writing one) what its events carried."""
    if summary and summary.get("state_hashes"):
        return {int(k): v for k, v in summary["state_hashes"].items()}
    kinds = ("start", "outer_step", "state_downloaded")
    return {int(e["epoch"]): e["state_hash"] for e in events if e.get("event") in kinds and e.get("state_hash")}


def _last_epoch(summary: dict | None, events: list[dict]) -> int:
    epochs = [int(e["epoch"]) for e in events if e.get("event") in ("start", "outer_step", "state_downloaded")]
    if summary:
        epochs += [int(summary.get("epoch", 0))] + [int(k) for k in summary.get("state_hashes", {})]
    return max(epochs, default=-1)


def build_summary(
    peers: list[PeerFiles],
    inner_steps: int,
    wall_s: float,
    *,
    batch_size: int = 0,
    started_at: float | None = None,
    exact_average: bool = True,
) -> dict:
    """The run summary ``local-swarm`` writes to summary.json (README, "local-swarm output", lists the fields).

    Args:
        peers: every peer launched, including those that left.
        inner_steps: H, counted per inner phase when events carry neither ``steps`` nor ``samples``.
        wall_s: the run's wall time, seconds.
        batch_size: samples per inner step (0 = unknown).
        started_at: unix time (s) the swarm started (for ``peers_left[].at_s``); None = the earliest start event.
        exact_average: butterfly (peers must hold equal states); False for moshpit/gossip, whose states differ by
            design (``hash_agreement.verdict`` is then "n/a").
    """
    summaries = {p.name: read_peer_summary(p) for p in peers}
    events = {p.name: read_events(p.metrics_path) for p in peers}
    state_hashes: dict[str, dict[str, str]] = {}
    sketches: dict[int, dict[str, bytes]] = {}
    initial, final, outer_steps, bytes_sent = [], [], [], 0
    steps_by_epoch: dict[int, dict[str, int]] = {}
    num_parameters = 0
    peer_ids, spans, peers_left, compute = [], [], [], {}
    reached_at: dict[int, float] = {}
    if started_at is None:
        starts = [e["time"] for evs in events.values() for e in evs if e["event"] == "start" and "time" in e]
        started_at = min(starts, default=None)
    for peer in peers:
        name, summary, evs = peer.name, summaries[peer.name], events[peer.name]
        starts = [e for e in evs if e["event"] == "start"]
        if starts and starts[0].get("eval_loss") is not None:
            initial.append(starts[0]["eval_loss"])
        for e in evs:
            if e["event"] == "outer_step" and "time" in e:
                reached_at[int(e["epoch"])] = min(reached_at.get(int(e["epoch"]), e["time"]), e["time"])
        for epoch, n in inner_steps_by_epoch(evs, batch_size, inner_steps).items():
            steps_by_epoch.setdefault(epoch, {})[name] = n
        peer_id = (summary or {}).get("peer_id") or next((e["peer"] for e in evs if e.get("peer")), "")
        hashes = _state_hashes(summary, evs)
        left = peer.exit_code not in (0, None) or peer.stopped
        end = (summary or {}).get("written_at") or peer.exited_at  # when it decided to leave, else its exit
        spans.append(PeerSpan(name, hashes, 0, _last_epoch(summary, evs), left, end))
        compute[name] = {"peer_id": peer_id, **peer_compute(summary, evs, end)}
        if left:
            reason = exit_reason(summary, peer.log_path, peer.exit_code)
            if peer.stopped and not (summary or {}).get("exit_reason"):
                reason = f"still running at the deadline: stopped by local-swarm ({reason})"
            at = end or (evs[-1].get("time") if evs else None)
            peers_left.append(
                {
                    "name": name,
                    "peer_id": peer_id,
                    "exit_code": peer.exit_code,
                    "epoch": _last_epoch(summary, evs),
                    "at_s": round(at - started_at, 1) if at is not None and started_at is not None else None,
                    "reason": reason,
                }
            )
        if peer_id:
            peer_ids.append(peer_id)
        for epoch, digest in hashes.items():
            state_hashes.setdefault(str(epoch), {})[peer_id or name] = digest
        if summary is None:
            continue
        num_parameters = summary.get("num_parameters", num_parameters)
        for epoch, text in summary.get("param_sketches", {}).items():
            try:
                sketches.setdefault(int(epoch), {})[peer_id or name] = sketch_from_text(text)
            except ValueError:
                continue
        if summary.get("final_eval_loss") is not None:
            final.append(summary["final_eval_loss"])
        outer_steps.append(summary.get("epoch", 0))
        bytes_sent += summary.get("bytes_sent", 0) + summary.get("state_bytes_downloaded", 0)
    rows = epoch_agreement(spans, reached_at)
    return {
        "peers": peer_ids,
        "outer_steps": min(outer_steps) if outer_steps else 0,
        "initial_eval_loss": initial[0] if initial else None,
        "final_eval_loss": sum(final) / len(final) if final else None,
        "final_eval_loss_per_peer": final,
        "state_hashes": dict(sorted(state_hashes.items(), key=lambda kv: int(kv[0]))),
        "hash_agreement": {
            "verdict": verdict(rows) if exact_average else "n/a",
            "text": describe_agreement(rows) if exact_average else "n/a (moshpit/gossip: peers' states differ)",
            "epochs": {
                str(r.epoch): {
                    "hashes": r.num_hashes,
                    "reported": r.num_reported,
                    "running": r.num_running,
                    "peers": r.num_peers,
                }
                for r in rows
            },
        },
        "param_drift": {str(epoch): value for epoch, (value, _) in drift_by_epoch(sketches).items()},
        "wall_s": wall_s,
        "bytes_sent_total": bytes_sent,
        "inner_steps_total": sum(n for per_peer in steps_by_epoch.values() for n in per_peer.values()),
        "bytes_ddp_equivalent": ddp_equivalent_bytes(num_parameters, steps_by_epoch),
        "num_parameters": num_parameters,
        "rounds_failed": sum(s.get("rounds_failed", 0) for s in summaries.values() if s),
        "state_downloads": sum(s.get("state_downloads", 0) for s in summaries.values() if s),
        "peers_left": peers_left,
        "per_peer": compute,
    }
