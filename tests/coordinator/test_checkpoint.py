"""CheckpointStore: bit-exact round trip, torn/tampered detection with fallback, crash safety, pruning."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from hivetrain.coordinator.checkpoint import MANIFEST_FILE, STATE_FILE, CheckpointStore
from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_file import meta_reference
from hivetrain.faults import Fault, FaultInjected, FaultInjector

RUN_CONFIG = {"run_id": "ckpt-test", "model": "tiny", "seed": 3, "diloco": {"inner_steps": 5}}


def make_state(epoch: int, seed: int = 0) -> TrainingState:
    """A small state with distinct random θ and momentum (same shapes as a toy two-layer model)."""
    gen = torch.Generator().manual_seed(1000 * seed + epoch)
    shapes = {"embed.weight": (64, 16), "layer.0.weight": (16, 16), "layer.0.bias": (16,), "head.weight": (64, 16)}
    params = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    momentum = {n: torch.randn(s, generator=gen) * 0.01 for n, s in shapes.items()}
    return TrainingState(epoch=epoch, params=params, momentum=momentum)


def assert_bit_identical(a: TrainingState, b: TrainingState) -> None:
    assert a.epoch == b.epoch
    assert a.state_hash() == b.state_hash()
    assert list(a.params) == list(b.params)
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), name
        assert torch.equal(a.momentum[name], b.momentum[name]), name


def test_round_trip_is_bit_identical(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=3)
    state = make_state(7)
    path = store.save(state, RUN_CONFIG, {"model_fingerprint": "ab" * 32, "tokens": 123})

    assert path == tmp_path / "epoch-000007"
    assert sorted(p.name for p in path.iterdir()) == [MANIFEST_FILE, STATE_FILE]
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    assert manifest["epoch"] == 7 and manifest["state_hash"] == state.state_hash()
    assert manifest["run_config"] == RUN_CONFIG and manifest["model_fingerprint"] == "ab" * 32
    assert manifest["extra"] == {"tokens": 123}
    assert manifest["files"][STATE_FILE]["num_bytes"] == (path / STATE_FILE).stat().st_size
    assert abs(manifest["created_at"] - time.time()) < 60

    loaded = store.load_latest(make_state(0, seed=9))
    assert loaded is not None
    assert_bit_identical(loaded[0], state)
    assert loaded[1]["state_hash"] == state.state_hash()
    assert [(c.epoch, c.status) for c in store.list()] == [(7, "ok")]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]

    # the loaded tensors are private memory, not a map of the file: damaging the file later changes nothing
    # (with a mapped file this would SIGBUS the process)
    with open(path / STATE_FILE, "r+b") as f:
        f.truncate(64)
    assert_bit_identical(loaded[0], state)


def _flip_byte(path: Path, offset_from_end: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(ckpt: Path) -> None:
    state = ckpt / STATE_FILE
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])


def _flip(ckpt: Path) -> None:
    _flip_byte(ckpt / STATE_FILE)


def _remove_manifest(ckpt: Path) -> None:
    (ckpt / MANIFEST_FILE).unlink()


def _half_manifest(ckpt: Path) -> None:
    text = (ckpt / MANIFEST_FILE).read_text()
    (ckpt / MANIFEST_FILE).write_text(text[: len(text) // 2])


def _wrong_state_hash(ckpt: Path) -> None:
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    manifest["state_hash"] = "0" * 64
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))


def _flip_and_reforge_file_hash(ckpt: Path) -> None:
    """A tamperer who flips a weight and updates the file sha256, but cannot forge the state hash peers agreed on."""
    import hashlib

    _flip_byte(ckpt / STATE_FILE)
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    manifest["files"][STATE_FILE]["sha256"] = hashlib.sha256((ckpt / STATE_FILE).read_bytes()).hexdigest()
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "corrupt, status, reason_part",
    [
        (_truncate, "torn", "truncated"),
        (_flip, "tampered", "sha256"),
        (_remove_manifest, "torn", "no manifest"),
        (_half_manifest, "torn", "does not parse"),
        (_wrong_state_hash, "tampered", "state_hash"),
        (_flip_and_reforge_file_hash, "tampered", "state_hash"),
    ],
)
def test_damaged_newest_checkpoint_falls_back_to_previous(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, corrupt, status: str, reason_part: str
) -> None:
    store = CheckpointStore(tmp_path, keep_last=3)
    store.save(make_state(1), RUN_CONFIG, {})
    newest = store.save(make_state(2), RUN_CONFIG, {})
    corrupt(newest)

    listed = {c.epoch: c for c in store.list()}
    assert listed[2].status == status and reason_part in listed[2].reason
    assert listed[1].status == "ok"

    with caplog.at_level(logging.WARNING, logger="hivetrain.coordinator.checkpoint"):
        loaded = store.load_latest(make_state(0))
    assert loaded is not None
    assert_bit_identical(loaded[0], make_state(1))
    assert any("epoch-000002" in r.getMessage() and reason_part in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "corrupt, reason_part",
    [
        (_truncate, "truncated"),
        (_flip, "sha256"),
        (_remove_manifest, "no manifest"),
        (_wrong_state_hash, "state_hash"),
        (_flip_and_reforge_file_hash, "state_hash"),
    ],
)
def test_a_damaged_checkpoint_loaded_onto_disk_falls_back_to_the_previous(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, corrupt, reason_part: str
) -> None:
    """The follower of a model larger than memory restores through ``load_latest_file``: the same checks, the same
    fallback, and the state file of a refused checkpoint is not left behind."""
    store = CheckpointStore(tmp_path / "ck", keep_last=3)
    store.save(make_state(1), RUN_CONFIG, {})
    corrupt(store.save(make_state(2), RUN_CONFIG, {}))
    with caplog.at_level(logging.WARNING, logger="hivetrain.coordinator.checkpoint"):
        loaded = store.load_latest_file(meta_reference(make_state(0)), tmp_path / "state.safetensors")
    assert loaded is not None
    assert_bit_identical(loaded[0].to_state(), make_state(1))
    assert any("epoch-000002" in r.getMessage() and reason_part in r.getMessage() for r in caplog.records)


def test_a_state_on_disk_is_checkpointed_as_a_hard_link_and_loads_in_memory_too(tmp_path: Path) -> None:
    from hivetrain.diloco.state_file import write_state_file

    store = CheckpointStore(tmp_path / "ck", keep_last=2)
    state = make_state(6)
    on_disk = write_state_file(state, tmp_path / "s.safetensors", meta_reference(state))
    path = store.save(on_disk, RUN_CONFIG, {})
    assert (path / STATE_FILE).stat().st_ino == (tmp_path / "s.safetensors").stat().st_ino  # no byte copied
    loaded = store.load_latest(make_state(0))  # the in-memory loader reads it as any checkpoint
    assert loaded is not None and loaded[1]["param_names"] == list(state.params)
    assert_bit_identical(loaded[0], state)
    assert store.list()[0].status == "ok"
    restored, _ = store.load_latest_file(
        meta_reference(state), tmp_path / "r.safetensors"
    )  # a restart: linked, only read
    assert (tmp_path / "r.safetensors").stat().st_ino == (path / STATE_FILE).stat().st_ino
    assert restored.state_hash() == state.state_hash()

    (tmp_path / "s.safetensors").unlink()  # the follower dropped the path: the next save copies from the descriptor
    store.save(write_state_file(make_state(7), tmp_path / "t.safetensors", meta_reference(state)), RUN_CONFIG, {})
    unlinked = write_state_file(make_state(8), tmp_path / "u.safetensors", meta_reference(state))
    (tmp_path / "u.safetensors").unlink()
    store.save(unlinked, RUN_CONFIG, {})
    assert_bit_identical(store.load_latest(make_state(0))[0], make_state(8))
    assert [c.status for c in store.list()] == ["ok", "ok"]


def test_a_checkpoint_of_another_model_is_incompatible_on_disk_too(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck", keep_last=2)
    store.save(make_state(4), RUN_CONFIG, {})
    other = TrainingState(epoch=0, params={"w": torch.zeros(3)}, momentum={"w": torch.zeros(3)})
    assert store.load_latest_file(meta_reference(other), tmp_path / "s.safetensors") is None
    assert not (tmp_path / "s.safetensors").exists()


def test_checkpoint_of_another_model_is_incompatible(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2)
    store.save(make_state(4), RUN_CONFIG, {})
    other = TrainingState(epoch=0, params={"w": torch.zeros(3)}, momentum={"w": torch.zeros(3)})
    assert store.load_latest(other) is None
    assert store.list()[0].status == "ok"  # nothing wrong with the checkpoint itself


def test_no_checkpoint_returns_none(tmp_path: Path) -> None:
    assert CheckpointStore(tmp_path / "missing", keep_last=1).load_latest(make_state(0)) is None


def test_keep_last_prunes_old_complete_checkpoints_and_stale_temporaries(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2)
    for epoch in range(1, 5):
        store.save(make_state(epoch), RUN_CONFIG, {})
    assert [c.epoch for c in store.list()] == [4, 3]

    (tmp_path / "epoch-000005").mkdir()  # torn newer directory: kept for inspection, not counted as complete
    stale = tmp_path / ".tmp-epoch-000006-999999-dead"
    stale.mkdir()
    (stale / STATE_FILE).write_bytes(b"partial")
    store.save(make_state(6), RUN_CONFIG, {})

    assert [(c.epoch, c.status) for c in store.list()] == [(6, "ok"), (5, "torn"), (4, "ok")]
    assert not stale.exists()


def test_saving_an_existing_epoch_replaces_it(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2)
    store.save(make_state(3, seed=1), RUN_CONFIG, {})
    store.save(make_state(3, seed=2), RUN_CONFIG, {})
    loaded = store.load_latest(make_state(0))
    assert loaded is not None
    assert_bit_identical(loaded[0], make_state(3, seed=2))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("epoch-")] == ["epoch-000003"]


def test_invalid_input_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointStore(tmp_path, keep_last=0)
    store = CheckpointStore(tmp_path, keep_last=1)
    bad = make_state(1)
    bad.params["layer.0.bias"][0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        store.save(bad, RUN_CONFIG, {})
    with pytest.raises(TypeError, match="JSON"):
        store.save(make_state(1), {"x": object()}, {})
    assert store.list() == []


def test_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    faults = FaultInjector()
    faults.arm(Fault("checkpoint.mid_write", "raise", when={"epoch": 2}))
    store = CheckpointStore(tmp_path, keep_last=2, faults=faults)
    store.save(make_state(1), RUN_CONFIG, {})
    with pytest.raises(FaultInjected):
        store.save(make_state(2), RUN_CONFIG, {})
    assert faults.fired_count("checkpoint.mid_write") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "epoch-000001"]


def _writer_child(root: str, action: str) -> None:
    """Child process: save epoch 1 completely, then die (or stop, to be SIGKILLed) in the middle of epoch 2."""
    faults = FaultInjector()
    faults.arm(Fault("checkpoint.mid_write", action, when={"epoch": 2}))  # type: ignore[arg-type]
    store = CheckpointStore(Path(root), keep_last=3, faults=faults)
    store.save(make_state(1), RUN_CONFIG, {})
    store.save(make_state(2), RUN_CONFIG, {})
    os._exit(3)  # not reached when the fault fires


def _process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.slow
@pytest.mark.parametrize("action", ["stop", "exit"])
def test_writer_killed_mid_write_leaves_last_complete_checkpoint(tmp_path: Path, action: str) -> None:
    """``stop``: the child SIGSTOPs itself at checkpoint.mid_write and we SIGKILL it by PID; ``exit``: it os._exits."""
    proc = mp.get_context("spawn").Process(target=_writer_child, args=(str(tmp_path), action), daemon=True)
    proc.start()
    try:
        if action == "stop":
            deadline = time.monotonic() + 120
            while _process_state(proc.pid) != "T":  # stopped at the hook: the fault fired
                assert proc.is_alive() and time.monotonic() < deadline, "writer never reached checkpoint.mid_write"
                time.sleep(0.02)
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=120)
        assert proc.exitcode == (-signal.SIGKILL if action == "stop" else 137)
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=10)

    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-epoch-000002-")]
    assert len(leftovers) == 1, "the write died somewhere other than mid-write"
    assert (leftovers[0] / STATE_FILE).exists() and not (leftovers[0] / MANIFEST_FILE).exists()
    assert not (tmp_path / "epoch-000002").exists()

    store = CheckpointStore(tmp_path, keep_last=3)
    loaded = store.load_latest(make_state(0))
    assert loaded is not None
    assert_bit_identical(loaded[0], make_state(1))
    store.save(make_state(2), RUN_CONFIG, {})  # the next writer sweeps the dead writer's temporary directory
    assert not leftovers[0].exists()
    assert [(c.epoch, c.status) for c in store.list()] == [(2, "ok"), (1, "ok")]
