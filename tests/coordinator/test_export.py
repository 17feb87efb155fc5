"""Export: checkpoint -> transformers directory -> from_pretrained gives the trained model's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from hivetrain.cli.export import main as run_export
from hivetrain.coordinator.checkpoint import STATE_FILE, CheckpointStore
from hivetrain.coordinator.export import export_transformers
from hivetrain.diloco.state import TrainingState
from hivetrain.model import build_config, build_model, model_fingerprint

SEQ_LEN = 32
RUN_CONFIG = {"run_id": "export-test", "model": "tiny", "seed": 0, "data": {"seq_len": SEQ_LEN, "tokenizer": ""}}


@pytest.fixture(scope="module")
def trained() -> tuple[TrainingState, str]:
    """A 'trained' tiny state: θ₀ moved off its initialisation, non-zero momentum (must not be exported)."""
    config = build_config("tiny", max_seq_len=SEQ_LEN)
    model = build_model(config, seed=0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    state = TrainingState.from_model(model, epoch=12)
    state.momentum = {n: torch.randn(t.shape, generator=gen) for n, t in state.params.items()}
    return state, model_fingerprint(config, model)


def reference_logits(state: TrainingState, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of the model built from the preset with θ loaded directly (no export)."""
    model = build_model(build_config("tiny", max_seq_len=SEQ_LEN), seed=123)
    model.load_state_dict(state.params, strict=True)
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits


INPUT_IDS = torch.tensor([list(b"def main():\n    return 0\n")])


def test_cli_export_from_store_loads_with_same_logits(
    tmp_path: Path, trained: tuple[TrainingState, str], capsys
) -> None:
    state, fingerprint = trained
    store = CheckpointStore(tmp_path / "ckpt", keep_last=2)
    store.save(state, RUN_CONFIG, {"model_fingerprint": fingerprint})
    out = tmp_path / "export"

    assert run_export([str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    assert f"exported epoch {state.epoch} ({state.state_hash()[:16]})" in capsys.readouterr().out  # it says which

    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in out.iterdir()}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(state.params)  # θ only, no outer momentum
    readme = (out / "README.md").read_text()
    assert "vocabulary 256" in readme and "Byte-level" in readme and state.state_hash() in readme
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == SEQ_LEN

    loaded = AutoModelForCausalLM.from_pretrained(out)
    loaded.eval()
    with torch.no_grad():
        logits = loaded(input_ids=INPUT_IDS).logits
    torch.testing.assert_close(logits, reference_logits(state, INPUT_IDS), atol=1e-6, rtol=0)


def test_export_training_state_directly(tmp_path: Path, trained: tuple[TrainingState, str]) -> None:
    state, _ = trained
    out = export_transformers(state, "tiny", tmp_path / "direct", max_seq_len=SEQ_LEN)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    loaded.eval()
    with torch.no_grad():
        logits = loaded(input_ids=INPUT_IDS).logits
    torch.testing.assert_close(logits, reference_logits(state, INPUT_IDS), atol=1e-6, rtol=0)
    with pytest.raises(FileExistsError):
        export_transformers(state, "tiny", out)
    with pytest.raises(ValueError, match="does not fit"):
        export_transformers(state, "small", tmp_path / "wrong", overwrite=True)


def test_cli_rejects_bad_input(
    tmp_path: Path, trained: tuple[TrainingState, str], capsys: pytest.CaptureFixture[str]
) -> None:
    state, fingerprint = trained
    ckpt = CheckpointStore(tmp_path / "ckpt", keep_last=1).save(state, RUN_CONFIG, {"model_fingerprint": fingerprint})

    assert run_export([str(ckpt)]) == 2  # --out missing
    assert run_export([str(ckpt), "--out", str(tmp_path / "x"), "--max-seq-len", "-3"]) == 2
    # a different sequence length changes the architecture fingerprint the run agreed on
    assert run_export([str(ckpt), "--out", str(tmp_path / "x"), "--max-seq-len", "64"]) == 1
    assert "fingerprint" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()

    (ckpt / STATE_FILE).write_bytes((ckpt / STATE_FILE).read_bytes()[:-10])  # torn checkpoint
    assert run_export([str(ckpt), "--out", str(tmp_path / "y")]) == 1
    assert "truncated" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()
    assert run_export([str(tmp_path / "nothing"), "--out", str(tmp_path / "z")]) == 1


def test_exported_files_are_readable_like_any_file_we_write(tmp_path: Path, trained: tuple[TrainingState, str]) -> None:
    import os

    umask = os.umask(0)
    os.umask(umask)
    out = export_transformers(trained[0], "tiny", tmp_path / "perm", max_seq_len=SEQ_LEN)
    for name in ("model.safetensors", "config.json"):
        assert (out / name).stat().st_mode & 0o777 == 0o666 & ~umask, name  # safetensors alone wrote 0600


def test_generate_stops_at_the_models_positions_and_refuses_a_prompt_that_fills_them(
    tmp_path: Path, trained: tuple[TrainingState, str], caplog: pytest.LogCaptureFixture
) -> None:
    from hivetrain.cli.generate import generate

    out = export_transformers(trained[0], "tiny", tmp_path / "gen", max_seq_len=SEQ_LEN)
    prompt = "abcdefghij"  # 10 byte tokens of the 32 positions
    text = generate(out, prompt, max_new_tokens=100)  # past position 32 the model has no embedding
    assert text.startswith(prompt) and "generating 22 tokens, not 100" in caplog.text
    with pytest.raises(ValueError, match=f"reads at most {SEQ_LEN}"):
        generate(out, "x" * SEQ_LEN, max_new_tokens=1)


def test_a_checkpoint_streamed_piece_by_piece_exports_what_save_pretrained_writes(
    tmp_path: Path, trained: tuple[TrainingState, str]
) -> None:
    state, fingerprint = trained
    ckpt = CheckpointStore(tmp_path / "ckpt", keep_last=1).save(state, RUN_CONFIG, {"model_fingerprint": fingerprint})
    streamed = export_transformers(ckpt, None, tmp_path / "streamed")  # a piece at a time from the state file
    in_memory = export_transformers(state, "tiny", tmp_path / "in-memory", max_seq_len=SEQ_LEN)  # save_pretrained
    assert sorted(p.name for p in streamed.iterdir()) == sorted(p.name for p in in_memory.iterdir())
    for name in ("config.json", "generation_config.json"):
        assert json.loads((streamed / name).read_text()) == json.loads((in_memory / name).read_text()), name
    with safe_open(str(streamed / "model.safetensors"), framework="pt") as a:
        with safe_open(str(in_memory / "model.safetensors"), framework="pt") as b:
            assert a.metadata() == b.metadata() == {"format": "pt"}
            assert set(a.keys()) == set(b.keys()) == set(state.params)  # θ only
            for key in b.keys():
                assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key
    readme = (streamed / "README.md").read_text()
    n = sum(t.numel() for t in state.params.values())
    assert f"epoch {state.epoch}" in readme and state.state_hash() in readme and fingerprint in readme
    assert (
        f"({n:,} parameters, fp32)" in readme and f"({n:,} parameters, fp32)" in (in_memory / "README.md").read_text()
    )


def test_a_state_file_replaced_after_verification_is_not_exported(
    tmp_path: Path, trained: tuple[TrainingState, str], monkeypatch
) -> None:
    import hivetrain.coordinator.export as export

    state, fingerprint = trained
    ckpt = CheckpointStore(tmp_path / "ckpt", keep_last=1).save(state, RUN_CONFIG, {"model_fingerprint": fingerprint})
    verified = export._verified_checkpoint

    def then_rewritten(path):  # the coordinator saves the epoch again between the check and the copy
        found = verified(path)
        data = (ckpt / STATE_FILE).read_bytes()
        (ckpt / STATE_FILE).unlink()
        (ckpt / STATE_FILE).write_bytes(data)
        return found

    monkeypatch.setattr(export, "_verified_checkpoint", then_rewritten)
    with pytest.raises(export.CheckpointInvalid, match="changed after it was verified"):
        export_transformers(ckpt, None, tmp_path / "out")
    assert not (tmp_path / "out").exists()
