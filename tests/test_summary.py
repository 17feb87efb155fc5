"""local-swarm's run summary, built from fake peer files (no processes): who left and why, hash agreement counted
against the peers that were running, DDP-equivalent bytes from the inner steps run, per-peer compute, exit code."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from hivetrain.cli.common import EXIT_FAILED
from hivetrain.cli.local_swarm import _print_summary, run_exit_code
from hivetrain.localswarm.agreement import EpochAgreement, PeerSpan, describe_agreement, epoch_agreement
from hivetrain.localswarm.summary import PeerFiles, build_summary, ddp_equivalent_bytes, last_error_line

T0 = 1_000_000.0  # the swarm starts
P = 1000  # parameters
DHT_LOST = "lost the DHT: could not read the swarm for 72s (did the p2pd daemon die?)"


def write_peer(
    tmp: Path,
    name: str,
    *,
    epochs: range,
    hashes: dict[int, str] | None = None,
    exit_code: int = 0,
    exited_at: float | None = None,
    summary: dict | None = None,
    write_summary: bool = True,
    log: str = "",
    steps: int | None = 10,
    samples: int | None = 80,
) -> PeerFiles:
    """A peer's files: a start event, then one inner phase and one committed outer step per epoch in ``epochs``."""
    hashes = hashes if hashes is not None else {e: f"h{e}" for e in [0, *[e + 1 for e in epochs]]}
    events = [{"event": "start", "time": T0 + 1, "peer": f"id-{name}", "epoch": 0, "state_hash": "h0", "eval_loss": 5}]
    for e in epochs:
        phase = {"event": "inner_phase", "time": T0 + 10 * e + 8, "peer": f"id-{name}", "epoch": e}
        phase.update({k: v for k, v in (("steps", steps), ("samples", samples)) if v is not None})
        phase["compute_s"] = 6.0
        events.append(phase)
        events.append(
            {"event": "outer_step", "time": T0 + 10 * e + 10, "peer": f"id-{name}", "epoch": e + 1, "samples": 80}
        )
    (tmp / f"{name}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if write_summary:
        body = {
            "peer_id": f"id-{name}",
            "epoch": max(hashes),
            "state_hashes": {str(k): v for k, v in hashes.items()},
            "bytes_sent": 100,
            "state_bytes_downloaded": 0,
            "num_parameters": P,
            "rounds_failed": 0,
            "state_downloads": 0,
            "final_eval_loss": 3.0,
            **(summary or {}),
        }
        (tmp / f"{name}.json").write_text(json.dumps(body))
    (tmp / f"{name}.log").write_text(log)
    return PeerFiles(
        name, tmp / f"{name}.log", tmp / f"{name}.jsonl", tmp / f"{name}.json", exit_code, exited_at or T0 + 200
    )


def summarize(peers: list[PeerFiles], **kw) -> dict:
    return build_summary(peers, inner_steps=10, wall_s=200.0, batch_size=8, started_at=T0, **kw)


def test_peers_that_left_are_named_with_when_and_why(tmp_path):
    log = "12:00:01 INFO hivetrain.join_swarm: joined\n12:01:13 ERROR hivetrain.join_swarm: disk full; leaving\n"
    peers = [
        write_peer(tmp_path, "peer0", epochs=range(10)),
        write_peer(
            tmp_path,
            "peer1",
            epochs=range(1),
            exit_code=4,
            exited_at=T0 + 72.4,
            summary={"exit_reason": DHT_LOST, "exit_code": 4},
        ),
        write_peer(tmp_path, "peer2", epochs=range(2), exit_code=4, exited_at=T0 + 90, write_summary=False, log=log),
        write_peer(tmp_path, "peer3", epochs=range(0), exit_code=1, exited_at=T0 + 5, write_summary=False),
    ]
    left = summarize(peers)["peers_left"]
    assert [p["name"] for p in left] == ["peer1", "peer2", "peer3"]
    assert left[0] == {
        "name": "peer1",
        "peer_id": "id-peer1",
        "exit_code": 4,
        "epoch": 1,
        "at_s": 72.4,
        "reason": DHT_LOST,
    }
    assert left[1]["reason"] == "disk full; leaving" and left[1]["epoch"] == 2, "no summary: the log's last ERROR"
    assert left[1]["peer_id"] == "id-peer2", "no summary: the peer id from its events"
    assert left[2]["reason"] == "exit code 1" and left[2]["epoch"] == 0


def test_a_peer_stopped_at_the_deadline_is_listed_as_stopped(tmp_path):
    stuck = write_peer(tmp_path, "peer1", epochs=range(2), exit_code=130, write_summary=False)
    peers = [write_peer(tmp_path, "peer0", epochs=range(5)), PeerFiles(**{**stuck.__dict__, "stopped": True})]
    (left,) = summarize(peers)["peers_left"]
    assert left["name"] == "peer1" and left["reason"].startswith("still running at the deadline")


def test_last_error_line_adds_the_exception_of_a_traceback():
    log = (
        "10:00:00 ERROR hivetrain.join_swarm: first\n10:00:01 ERROR hivetrain.join_swarm: training failed\n"
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\nRuntimeError: boom\n'
    )
    assert last_error_line(log) == "training failed: RuntimeError: boom"
    assert last_error_line("error: --peers must be >= 1\n") == "--peers must be >= 1"
    assert last_error_line("Nov 25 12:00:00.1 [ERROR] [hivemind.p2p.p2p:42] daemon died\n") == "daemon died"
    assert last_error_line("12:00 INFO x: fine\n") == ""


def test_hashes_agree_is_not_yes_when_only_one_peer_is_left_to_agree(tmp_path):
    """The issue's demo: peers 0 and 2 committed epoch 1 with peer 1, then left; peer 1 trained alone to epoch 10."""
    peers = [
        write_peer(tmp_path, "peer0", epochs=range(1), exit_code=4, exited_at=T0 + 15, summary={"exit_reason": "x"}),
        write_peer(tmp_path, "peer1", epochs=range(10)),
        write_peer(tmp_path, "peer2", epochs=range(1), exit_code=4, exited_at=T0 + 16, summary={"exit_reason": "x"}),
    ]
    agreement = summarize(peers)["hash_agreement"]
    assert agreement["verdict"] == "partial"
    assert agreement["text"] == "only 1 of 3 peers at epochs 2-10 (2 left); 3 of 3 at epochs 0-1"
    assert agreement["epochs"]["5"] == {"hashes": 1, "reported": 1, "running": 1, "peers": 3}
    assert "yes" not in agreement["text"]


def test_hashes_agree_yes_names_how_many_peers_and_epochs(tmp_path):
    peers = [write_peer(tmp_path, f"peer{i}", epochs=range(10)) for i in range(3)]
    agreement = summarize(peers)["hash_agreement"]
    assert agreement == {**agreement, "verdict": "yes", "text": "yes (3 of 3 peers at each of 11 epochs)"}


def test_a_fork_says_no_with_the_epoch(tmp_path):
    forked = {e: ("X" if e == 4 else f"h{e}") for e in range(11)}
    peers = [write_peer(tmp_path, "peer0", epochs=range(10), hashes=forked)]
    peers += [write_peer(tmp_path, f"peer{i}", epochs=range(10)) for i in (1, 2)]
    summary = summarize(peers)
    assert summary["hash_agreement"]["text"] == "NO: epoch 4: 2 hashes among 3 peers"
    assert run_exit_code({**summary, "timed_out": False, "exit_codes": {"peer0": 0}}) == EXIT_FAILED


def test_moshpit_keeps_na(tmp_path):
    peers = [write_peer(tmp_path, "peer0", epochs=range(2), hashes={0: "a", 1: "b", 2: "c"})]
    peers.append(write_peer(tmp_path, "peer1", epochs=range(2), hashes={0: "a", 1: "d", 2: "e"}))
    agreement = summarize(peers, exact_average=False)["hash_agreement"]
    assert agreement["verdict"] == "n/a" and agreement["text"].startswith("n/a")


def test_a_running_peer_that_skipped_an_epoch_counts_against_agreement():
    """Peer b discarded its round at epoch 1 and downloaded epoch 2: it was running, without that state."""
    spans = [PeerSpan("a", {0: "h0", 1: "h1", 2: "h2"}, last_epoch=2), PeerSpan("b", {0: "h0", 2: "h2"}, last_epoch=2)]
    rows = epoch_agreement(spans, reached_at={1: 10.0, 2: 20.0})
    assert rows[1] == EpochAgreement(epoch=1, num_hashes=1, num_reported=1, num_running=2, num_peers=2)
    assert describe_agreement(rows) == (
        "only 1 of 2 peers at epoch 1 (1 running without that state); 2 of 2 at the other 2 epochs"
    )


def test_a_peer_that_left_while_lagging_was_running_when_the_swarm_moved_on():
    """b stayed at epoch 1 while a committed 2 and 3 at t=20, 30; b left at t=25: it was running at epoch 2 only."""
    spans = [
        PeerSpan("a", {0: "h0", 1: "h1", 2: "h2", 3: "h3"}, last_epoch=3),
        PeerSpan("b", {0: "h0", 1: "h1"}, last_epoch=1, left=True, left_at=25.0),
    ]
    rows = epoch_agreement(spans, reached_at={1: 10.0, 2: 20.0, 3: 30.0})
    assert [(r.epoch, r.num_running, r.num_left, r.num_skipped) for r in rows] == [
        (0, 2, 0, 0),
        (1, 2, 0, 0),
        (2, 2, 0, 1),
        (3, 1, 1, 0),
    ]


def test_ddp_equivalent_bytes_count_the_steps_run_and_the_peers_that_ran_them(tmp_path):
    """3 peers ran epoch 0 (steps from the events: 12, 80 samples // 8 = 10, and H = 10 without either field);
    then peer1 trained alone: those epochs add nothing (a one-worker DDP sends nothing), the total is not 0."""
    peers = [
        write_peer(tmp_path, "peer0", epochs=range(1), steps=12, exit_code=4, summary={"exit_reason": "x"}),
        write_peer(tmp_path, "peer1", epochs=range(10), steps=None),
        write_peer(tmp_path, "peer2", epochs=range(1), steps=None, samples=None, exit_code=4),
    ]
    summary = summarize(peers)
    assert summary["inner_steps_total"] == 12 + 10 * 10 + 10
    assert summary["bytes_ddp_equivalent"] == int((12 + 10 + 10) * 2 * 2 / 3 * 4 * P)
    assert ddp_equivalent_bytes(P, {0: {"a": 10}, 1: {"a": 10}}) == 0, "one worker alone sends nothing"
    assert ddp_equivalent_bytes(P, {0: {"a": 10, "b": 10}, 1: {"a": 10}}) == 20 * 1 * 4 * P


def test_overlapped_phases_count_for_the_epoch_they_go_to(tmp_path):
    """An inner phase with ``round_key`` is counted for that epoch (overlap runs phase t+1 during round t)."""
    phases = [{"event": "inner_phase", "time": T0, "epoch": 0, "round_key": 1, "steps": 5}]
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(phases[0]) + "\n")
    files = [PeerFiles(n, None, tmp_path / f"{n}.jsonl", None, 0, T0) for n in ("a", "b")]
    summary = build_summary(files, inner_steps=99, wall_s=1.0, batch_size=8, started_at=T0)
    assert summary["inner_steps_total"] == 10


def test_ratio_is_printed_only_when_both_byte_counts_are_positive(tmp_path):
    def printed(summary: dict) -> str:
        console = Console(file=io.StringIO(), width=200)
        _print_summary(console, summary, tmp_path)
        return console.file.getvalue()

    peers = [write_peer(tmp_path, f"peer{i}", epochs=range(2)) for i in range(2)]
    summary = summarize(peers)
    assert summary["bytes_ddp_equivalent"] > 0 and "DDP bytes / DiLoCo bytes" in printed(summary)
    assert "DDP bytes / DiLoCo bytes" not in printed({**summary, "bytes_ddp_equivalent": 0})
    assert "DDP bytes / DiLoCo bytes" not in printed({**summary, "bytes_sent_total": 0})


def test_the_table_names_peers_that_left(tmp_path):
    peers = [
        write_peer(tmp_path, "peer0", epochs=range(3)),
        write_peer(tmp_path, "peer1", epochs=range(1), exit_code=4, summary={"exit_reason": DHT_LOST}),
    ]
    peers[1] = PeerFiles(**{**peers[1].__dict__, "exited_at": T0 + 12})  # after epoch 1, before epoch 2 (T0 + 20)
    console = Console(file=io.StringIO(), width=250)
    _print_summary(console, summarize(peers), tmp_path)
    text = console.file.getvalue()
    assert "peers that left" in text and "peer1" in text and "lost the DHT" in text
    assert "only 1 of 2 peers at epochs 2-3 (1 left)" in text


def test_per_peer_compute_figures_from_summaries_or_events(tmp_path):
    fields = {"samples_computed": 400, "samples_total": 320, "samples_discarded": 80, "compute_s": 30.0}
    fields["written_at"] = T0 + 61  # start event at T0 + 1: 60 s of wall time
    peers = [
        write_peer(tmp_path, "peer0", epochs=range(5), summary=fields),
        write_peer(tmp_path, "peer1", epochs=range(5), write_summary=False, exited_at=T0 + 121),
    ]
    per_peer = summarize(peers)["per_peer"]
    assert per_peer["peer0"] == {
        "peer_id": "id-peer0",
        "samples_computed": 400,
        "samples_committed": 320,
        "samples_discarded": 80,
        "compute_s": 30.0,
        "wall_s": 60.0,
        "compute_utilization": 0.5,
    }
    # no summary: 5 inner phases of 80 samples and 6 s, 5 committed outer steps of 80 samples, 120 s of wall time
    assert per_peer["peer1"]["samples_computed"] == 400 and per_peer["peer1"]["samples_committed"] == 400
    assert per_peer["peer1"]["compute_s"] == 30.0 and per_peer["peer1"]["compute_utilization"] == 0.25


def test_local_swarm_fails_when_a_peer_leaves_with_an_error(tmp_path):
    ok = summarize([write_peer(tmp_path, f"peer{i}", epochs=range(3)) for i in range(2)])
    ok.update(timed_out=False, exit_codes={"peer0": 0, "peer1": 0})
    assert run_exit_code(ok) == 0
    assert run_exit_code({**ok, "exit_codes": {"peer0": 0, "peer1": 4}}) == EXIT_FAILED
    assert run_exit_code({**ok, "peers_left": [{"name": "peer1"}]}) == EXIT_FAILED
    assert run_exit_code({**ok, "timed_out": True}) == EXIT_FAILED
