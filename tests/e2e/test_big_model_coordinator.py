"""Issue 24 item 4: a coordinator never needs the model's memory. It follows and checkpoints a state larger than its
peak RSS (a small VPS hosting a big run), and one that cannot hold the state on its disk says so within seconds."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from hivetrain.config import load_run_config
from hivetrain.coordinator.checkpoint import CheckpointStore
from hivetrain.coordinator.checkpoint_format import verify_checkpoint
from hivetrain.coordinator.coordinator import run_fingerprint
from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_sync import StateServer
from hivetrain.localswarm.launcher import LocalSwarm
from hivetrain.model import build_run_model
from hivetrain.peers.loop import LoopThread
from hivetrain.peers.records import PeerRecord, publish_record
from tests.e2e.conftest import write_config

COORDINATOR = [sys.executable, "-m", "hivetrain.cli.main", "coordinator", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]


def _llama(tmp_path, name, hidden, layers, intermediate):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256)  # fmt: skip
    config.save_pretrained(tmp_path / name)
    return str(tmp_path / name / "config.json")


def _rss_bytes(pid: int, field: str) -> int:
    """``VmRSS`` (resident memory now) or ``VmHWM`` (the most it has held) of a live process."""
    for line in open(f"/proc/{pid}/status").read().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


# the export's peak resident memory after its imports and at its end (VmHWM: ru_maxrss would count the forked pytest)
_EXPORT = """
import os, sys
from hivetrain.cli.export import main
hwm = lambda: next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
before = hwm()
rc = main(sys.argv[1:])
print("RSS", before, hwm())
sys.exit(rc)
"""


def _export_within_memory(checkpoints, out, state: TrainingState) -> None:
    """``hivetrain export`` of the checkpoint (θ: 610 MB) holds a small part of it in memory at any time, and the
    exported weights are θ's."""
    done = subprocess.run(
        [sys.executable, "-c", _EXPORT, str(checkpoints), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    before, peak = (int(x) for x in done.stdout.split("RSS ")[-1].split()[:2])
    theta = state.num_bytes() // 2
    figures = f"export: peak RSS {peak / 1e6:.0f} MB ({before / 1e6:.0f} MB after its imports), θ {theta / 1e6:.0f} MB"
    print(figures)
    assert peak - before < theta / 8, figures
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(state.params)
        for name in list(state.params)[:3] + list(state.params)[-2:]:
            assert torch.equal(f.get_tensor(name), state.params[name]), name


@pytest.mark.slow
def test_a_coordinator_follows_and_checkpoints_a_state_larger_than_its_peak_memory(tmp_path, make_node):
    """Two trainers (DHT nodes of this test, serving a 152M-parameter state: 1.2 GB of θ and momentum) publish
    epoch 1; the coordinator downloads it to disk, checks its hash, checkpoints it and serves it, holding a fraction
    of it in memory at any time."""
    model = _llama(tmp_path, "model", hidden=1024, layers=12, intermediate=2752)
    path = write_config(tmp_path / "run.toml", model=model, run_id="big")
    config = load_run_config(str(path), {})
    meta = build_run_model(config, 256, meta=True).model
    gen = torch.Generator().manual_seed(0)
    params = {n: torch.randn(p.shape, generator=gen) * 0.02 for n, p in meta.named_parameters()}
    state = TrainingState(1, params, {n: torch.randn(t.shape, generator=gen) * 1e-3 for n, t in params.items()})
    state_hash, fingerprint = state.state_hash(), run_fingerprint(config)
    assert state.num_bytes() > 1.2e9

    address_file, checkpoints = tmp_path / "coordinator.addr", tmp_path / "ckpt"
    proc = subprocess.Popen(
        [*COORDINATOR, "--config", str(path), "--checkpoint-dir", str(checkpoints), "--address-file", str(address_file),
         "--refresh-interval", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    loop, stop, output = LoopThread(), threading.Event(), []
    threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 240  # importing torch takes a minute on a busy machine
        while not address_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "".join(output)[-3000:]
            time.sleep(0.2)
        started_rss = _rss_bytes(proc.pid, "VmHWM")  # up, serving nothing yet: the interpreter, torch, the DHT
        trainers = [make_node([address_file.read_text().split()[0]], name=f"t{i}") for i in range(2)]
        for node in trainers:
            server = StateServer(lambda: state)
            loop.run(server.register(loop.run(node.dht.replicate_p2p(), 30), "big"), 30)

        def publish():  # the trainers' records, fresh, until the test ends
            from hivemind.utils import get_dht_time

            while not stop.is_set():
                for node in trainers:
                    record = PeerRecord(peer_id=node.peer_id, role="trainer", version="0.1.0", run_id="big",
                                        model_fingerprint=fingerprint, epoch=1, throughput=1.0, state_hash=state_hash,
                                        updated_at=get_dht_time())  # fmt: skip
                    publish_record(node.dht, node.owner_marker, record, 30)
                stop.wait(3)

        threading.Thread(target=publish, daemon=True).start()
        store = CheckpointStore(checkpoints, keep_last=3)
        deadline = time.monotonic() + 300
        while not any(c.epoch == 1 for c in store.list(verify=False)):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(output)[-3000:]
            time.sleep(1)
        peak = _rss_bytes(proc.pid, "VmHWM")
        manifest = verify_checkpoint(checkpoints / "epoch-000001", expected_epoch=1)
        assert manifest["state_hash"] == state_hash and manifest["model_fingerprint"] == fingerprint
        figures = (
            f"peak RSS {peak / 1e6:.0f} MB ({started_rss / 1e6:.0f} MB at start), "
            f"state {state.num_bytes() / 1e6:.0f} MB"
        )
        print(figures)
        assert peak < state.num_bytes() / 2 and peak - started_rss < state.num_bytes() / 8, figures
        log = "".join(output)
        assert "is not built here" in log and "adopting epoch 1 unchecked" in log, log[-3000:]
        _export_within_memory(checkpoints, tmp_path / "exported", state)
    finally:
        stop.set()
        _stop(proc)
        loop.stop()
    assert proc.returncode in (0, 130, -signal.SIGINT), "".join(output)[-3000:]
    assert "Traceback" not in "".join(output)


@pytest.mark.slow
def test_a_coordinator_whose_disk_cannot_hold_the_state_says_so_in_seconds(tmp_path):
    """A 405B-class config.json (9.8 TB: two states served and one downloading, 8 bytes per parameter each; a 7B run
    needs 168 GB): refused before any node starts, naming the need, the free space and the fixes; never "did not
    start"."""
    model = _llama(tmp_path, "huge", hidden=16384, layers=126, intermediate=53248)
    path = write_config(tmp_path / "run.toml", model=model, run_id="huge")
    need = 24 * sum(
        p.numel() for p in build_run_model(load_run_config(str(path), {}), 256, meta=True).model.parameters()
    )
    assert shutil.disk_usage(tmp_path).free < need, "this test needs a disk with less than 9.8 TB free"
    started = time.monotonic()
    proc = subprocess.run([*COORDINATOR, "--config", str(path), "--checkpoint-dir", str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"--checkpoint-dir {tmp_path / 'ckpt'}" in errors[0] and "GB free" in errors[0]
    assert f"needs {need / 1e9:.1f} GB" in errors[0] and "--no-state" in errors[0]
    assert "DHT node" not in proc.stderr  # refused before anything started
    assert time.monotonic() - started < 120
    swarm = LocalSwarm(tmp_path / "swarm", path, threads_per_peer=1)  # local-swarm says the same, not "did not start"
    try:
        with pytest.raises(RuntimeError, match="the coordinator refused to start: .* GB free, .* --no-state"):
            swarm.start_coordinator(timeout_s=240)
    finally:
        swarm.close(grace_s=5)
