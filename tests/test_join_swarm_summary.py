"""join-swarm writes its summary, with why it ended, on every exit path, and announces that it leaves (no processes:
the node, data, model, averager and trainer are stand-ins; the exit paths and the summary are the real ones)."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import hivetrain.averaging
import hivetrain.model
import hivetrain.peers.loop
from hivetrain.cli import join_swarm
from hivetrain.cli.common import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, Interrupted
from hivetrain.config import load_run_config
from hivetrain.diloco import builder
from hivetrain.diloco import trainer as trainer_module
from hivetrain.diloco.duty import DutyCycle
from hivetrain.diloco.swarm_view import DhtLost
from hivetrain.faults import FaultInjector

DHT_LOST = "lost the DHT: could not read the swarm for 72s (did the p2pd daemon die?)"


class FakeTrainer:
    """Stands in for DilocoTrainer: ``run()`` does what the test says; records what it was told."""

    outcome: BaseException | None = None

    def __init__(self, *args, **kwargs):
        self.state = SimpleNamespace(epoch=3)
        self.model = torch.nn.Linear(4, 2)  # 10 parameters
        self.stats = SimpleNamespace(
            state_hashes={0: "h0", 3: "h3"},
            param_sketches={},
            bytes_sent=5,
            bytes_received=6,
            state_bytes_downloaded=0,
            state_downloads=1,
            rounds_committed=3,
            rounds_failed=2,
            samples_total=240,
            samples_computed=320,
            samples_discarded=80,
            compute_s=12.5,
            last_eval_loss=3.2,
        )
        self.left_reasons: list[str] = []
        self.stopped = False
        FakeTrainer.last = self

    def run(self):
        if self.outcome is not None:
            raise self.outcome
        return self.stats

    def stop(self):
        self.stopped = True

    def announce_leaving(self, reason: str) -> None:
        self.left_reasons.append(reason)


class Stub:
    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


@pytest.fixture
def train(monkeypatch, tmp_path):
    """Runs join_swarm._train with everything but the exit paths stubbed (the builder runs, building stand-ins);
    returns (code, summary, trainer)."""
    config = load_run_config(None, {})
    monkeypatch.setattr(join_swarm, "resolve_config", lambda args, node: config)
    monkeypatch.setattr(builder, "refuse_other_models", lambda *a: None)
    monkeypatch.setattr(builder, "load_corpus", lambda data, **kw: SimpleNamespace(vocab_size=16))
    monkeypatch.setattr(builder, "build_phases", lambda *a, **k: None)
    shape = SimpleNamespace(hidden_size=4, num_hidden_layers=1, vocab_size=16)  # the memory preflight reads these
    monkeypatch.setattr(hivetrain.model, "describe_run_model", lambda *a, **k: (shape, 10))
    monkeypatch.setattr(hivetrain.model, "build_run_model", lambda *a, **k: (None, torch.nn.Linear(4, 2), "f" * 64))
    monkeypatch.setattr(hivetrain.averaging, "GroupAverager", Stub)
    monkeypatch.setattr(hivetrain.peers.loop, "LoopThread", Stub)
    monkeypatch.setattr(trainer_module, "DilocoTrainer", FakeTrainer)
    node = SimpleNamespace(peer_id="QmPeer", visible_maddrs=lambda: [], guard_run=lambda run_id: None, dht=None)
    path = tmp_path / "peer.json"

    def run(outcome: BaseException | None):
        FakeTrainer.outcome = outcome
        args = join_swarm.build_parser().parse_args(["--summary-file", str(path), "--config", "x.toml"])
        ending = join_swarm._Ending(str(path))
        ending.node = node
        try:
            code = join_swarm._train(args, node, torch.device("cpu"), FaultInjector(), DutyCycle(1.0), ending)
        except Interrupted:
            code = ending.leave(EXIT_INTERRUPTED, "interrupted")  # what main() does
        return code, json.loads(path.read_text()), FakeTrainer.last

    return run


def test_a_lost_dht_leaves_a_summary_and_a_last_record_saying_why(train):
    code, summary, trainer = train(DhtLost(DHT_LOST))
    assert code == EXIT_FAILED
    assert summary["exit_code"] == EXIT_FAILED and summary["exit_reason"] == DHT_LOST
    assert trainer.left_reasons == [DHT_LOST] and trainer.stopped
    assert summary["epoch"] == 3 and summary["state_hashes"] == {"0": "h0", "3": "h3"}
    assert summary["samples_computed"] == 320 and summary["samples_discarded"] == 80 and summary["num_parameters"] == 10
    assert summary["written_at"] >= summary["started_at"] > 0


def test_an_unexpected_exception_leaves_a_summary_naming_it(train):
    code, summary, trainer = train(RuntimeError("CUDA out of memory"))
    assert code == EXIT_FAILED
    assert summary["exit_reason"] == "training failed: RuntimeError: CUDA out of memory"
    assert trainer.left_reasons == [summary["exit_reason"]]


def test_ctrl_c_announces_interrupted(train):
    code, summary, trainer = train(Interrupted("SIGINT"))
    assert code == EXIT_INTERRUPTED and summary["exit_reason"] == "interrupted" and summary["interrupted"] is True
    assert trainer.left_reasons == ["interrupted"]


def test_a_finished_peer_says_finished(train):
    code, summary, trainer = train(None)
    assert code == EXIT_OK and summary["exit_code"] == 0 and summary["exit_reason"] == "finished"
    assert trainer.left_reasons == ["finished"]


def test_bad_input_before_the_node_starts_still_writes_a_summary(monkeypatch, tmp_path):
    monkeypatch.setattr(join_swarm, "install_signal_handlers", lambda: None)
    path = tmp_path / "peer.json"
    code = join_swarm.main(["--summary-file", str(path), "--public-name", "x" * 65, "--config", "run.toml"])
    summary = json.loads(path.read_text())
    assert code == EXIT_BAD_INPUT == summary["exit_code"]
    assert summary["exit_reason"] == "--public-name must be at most 64 characters"
    assert summary["peer_id"] == "" and summary["epoch"] == 0 and summary["state_hashes"] == {}


def test_announcing_waits_a_bounded_time_on_a_dht_that_does_not_answer():
    release = threading.Event()
    trainer = FakeTrainer()
    trainer.announce_leaving = lambda reason: release.wait(30)  # a store that never returns
    started = time.monotonic()
    join_swarm._announce_leaving(trainer, "lost the DHT", timeout_s=0.2)
    assert time.monotonic() - started < 5 and trainer.stopped
    release.set()
