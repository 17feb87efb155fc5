"""Bad input to join-swarm: a clear message, a non-zero exit code, bounded time, and nobody else disturbed."""

import time

import pytest

from hivetrain.localswarm.forkserver import run as run_cli
from hivetrain.localswarm.summary import read_events
from tests.e2e.conftest import wait_for_event, write_config

JOIN = ["hivetrain.cli.join_swarm"]  # forked from the pre-imported fork server: the same process, ~6 s of CPU less
BOGUS = "/ip4/127.0.0.1/tcp/9/p2p/QmZaPV7t8Ru4TUBX6qryUsdLzF6JuQCx8oH3c9xuuuBkGm"


def run(args, timeout_s=60):
    started = time.monotonic()
    proc = run_cli([*JOIN, *args, "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], timeout_s)
    return proc, time.monotonic() - started


@pytest.mark.slow
def test_unreachable_bootstrap_exits_nonzero_quickly_naming_the_address():
    proc, elapsed = run([BOGUS, "--bootstrap-timeout", "10"])
    assert proc.returncode == 2
    assert BOGUS in proc.stderr and "could not reach any initial peer" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert elapsed < 30


@pytest.mark.slow
def test_invalid_config_value_is_refused_naming_the_field(tmp_path):
    config = write_config(tmp_path / "bad.toml", **{"diloco.inner_steps": -5})
    proc, _ = run(["--config", str(config)])
    assert proc.returncode == 2 and "diloco.inner_steps" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_missing_data_path_is_refused(tmp_path):
    config = write_config(tmp_path / "run.toml", **{"data.paths": [str(tmp_path / "missing.txt")]})
    proc, _ = run(["--config", str(config)])
    assert proc.returncode == 2 and "missing.txt" in proc.stderr


def _small_vocab_model(tmp_path):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    config.save_pretrained(tmp_path / "model")
    return str(tmp_path / "model" / "config.json")


@pytest.mark.slow
def test_an_empty_corpus_is_refused_in_one_line_naming_it(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    config = write_config(tmp_path / "run.toml", **{"data.paths": [str(tmp_path / "empty.txt")]})
    proc, _ = run(["--config", str(config)], timeout_s=240)  # importing torch takes a minute on a busy machine
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"no text in {tmp_path / 'empty.txt'}" in proc.stderr


@pytest.mark.slow
def test_a_model_whose_vocabulary_is_smaller_than_the_tokenizers_is_refused_by_peer_and_coordinator(tmp_path):
    config = write_config(tmp_path / "run.toml", model=_small_vocab_model(tmp_path))
    proc, _ = run(["--config", str(config)], timeout_s=240)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "vocab_size 100 does not cover the tokenizer's 256 ids" in proc.stderr
    coordinator = run_cli(
        ["hivetrain.cli.main", "coordinator", "--config", str(config), "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
         "--checkpoint-dir", str(tmp_path / "ckpt")],
        240,
    )  # fmt: skip
    assert coordinator.returncode == 2 and "Traceback" not in coordinator.stderr, coordinator.stderr[-2000:]
    errors = [line for line in coordinator.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "does not cover the tokenizer's 256 ids" in errors[0]
    assert "DHT node" not in coordinator.stderr  # refused before anything started


@pytest.mark.slow
def test_peer_with_different_model_is_refused_and_others_keep_training(local_swarm, tmp_path):
    swarm = local_swarm(**{"diloco.outer_steps": 3, "diloco.inner_steps": 20})
    honest = swarm.add_peer()
    wait_for_event(honest, lambda e: e["event"] == "start", timeout_s=90)
    other = write_config(tmp_path / "other.toml", model="small")
    proc, _ = run([swarm.address, "--config", str(other)], timeout_s=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "different model" in proc.stderr
    assert swarm.wait_peers(timeout_s=180)
    assert honest.popen.returncode == 0
    assert [e["epoch"] for e in read_events(honest.metrics_path) if e["event"] == "outer_step"] == [1, 2, 3]
