"""Tokenizers end to end: a BPE tokenizer dir through load_corpus, export and pipeline; the byte tokenizer; generate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GPTNeoXConfig, PreTrainedTokenizerFast, pipeline

from hivetrain.cli.export import main as run_export
from hivetrain.cli.generate import main as generate_main
from hivetrain.config import RunConfig
from hivetrain.coordinator.checkpoint import CheckpointStore
from hivetrain.coordinator.export import byte_tokenizer, export_transformers
from hivetrain.data import load_corpus
from hivetrain.data.config import DataConfig
from hivetrain.diloco.state import TrainingState
from hivetrain.model import build_run_model

SEQ_LEN = 32
TEXT = (
    "First Citizen: Before we proceed any further, hear me speak.\n"
    "All: Speak, speak.\n"
    "First Citizen: You are all resolved rather to die than to famish?\n"
    "All: Resolved. resolved. Café, naïve, 日本語 and 🤖 too.\n"
) * 4


def save_checkpoint(tmp_path: Path, run: RunConfig, vocab_size: int) -> Path:
    """A checkpoint store holding θ₀ of ``run``'s model, as the coordinator writes it."""
    built = build_run_model(run, vocab_size)
    store = CheckpointStore(tmp_path / "ckpt", keep_last=1)
    store.save(TrainingState.from_model(built.model, epoch=3), run.to_dict(), {"model_fingerprint": built.fingerprint})
    return tmp_path / "ckpt"


def test_bpe_tokenizer_dir_runs_through_corpus_export_and_pipeline(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    for i in range(20):  # documents: the held-out set is chosen per document
        (corpus_dir / f"doc{i:02d}.txt").write_text(f"Document {i}.\n" + TEXT[: 600 + 10 * i])
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    files = [str(p) for p in sorted(corpus_dir.iterdir())]
    bpe.train(files, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<eos>"]))
    tok_dir = tmp_path / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="<eos>").save_pretrained(tok_dir)

    data = DataConfig(
        paths=(str(corpus_dir),), tokenizer=str(tok_dir), seq_len=SEQ_LEN, num_eval_windows=2, eval_fraction=0.3
    )
    corpus = load_corpus(data)
    assert 60 < corpus.vocab_size <= 120
    assert int(corpus.eval_windows(SEQ_LEN, 2).max()) < corpus.vocab_size
    run = RunConfig(run_id="bpe", model="tiny", data=data)
    out = tmp_path / "export"
    assert run_export([str(save_checkpoint(tmp_path, run, corpus.vocab_size)), "--out", str(out)]) == 0
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}

    generate = pipeline("text-generation", model=str(out))
    assert len(generate.tokenizer) == corpus.vocab_size
    text = generate("First Citizen", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith("First Citizen") and len(text) > len("First Citizen")

    with pytest.raises(FileNotFoundError, match="--tokenizer"):  # the run's tokenizer is not on this machine
        export_transformers(tmp_path / "ckpt", None, tmp_path / "x", tokenizer=tmp_path / "gone")


def test_byte_tokenizer_maps_ids_to_bytes_both_ways() -> None:
    tok = byte_tokenizer()
    assert len(tok) == 256
    for text in ["hello world\n  x", " naïve café 日本語 🤖", "<0x41> Ġ\t\r\n"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
    stray = [104, 0xFF, 105, 0xC3]  # invalid UTF-8 stays local, as bytes(...).decode(errors="replace")
    assert tok.decode(stray) == bytes(stray).decode("utf-8", errors="replace") == "h\ufffdi\ufffd"


def _save_neox_config(directory: Path, num_layers: int) -> None:
    """A tiny GPT-NeoX ``config.json`` over byte tokens (vocabulary 256) in ``directory``."""
    GPTNeoXConfig(vocab_size=256, hidden_size=32, num_hidden_layers=num_layers, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64).save_pretrained(directory)  # fmt: skip


def test_byte_run_of_another_architecture_exports_for_pipeline_and_generate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save_neox_config(tmp_path / "neox", num_layers=2)
    run = RunConfig(run_id="neox", model=str(tmp_path / "neox"), data=DataConfig(seq_len=SEQ_LEN))
    out = tmp_path / "export"
    assert run_export([str(save_checkpoint(tmp_path, run, 256)), "--out", str(out)]) == 0
    assert "gpt_neox causal LM" in (out / "README.md").read_text()

    generate = pipeline("text-generation", model=str(out))
    prompt = "Café 🤖"
    ids = generate.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ids == list(prompt.encode("utf-8"))
    expected_ids = generate.model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0].tolist()
    text = generate(prompt, max_new_tokens=6, do_sample=False)[0]["generated_text"]
    assert text == bytes(expected_ids).decode("utf-8", errors="replace")

    capsys.readouterr()
    assert generate_main([str(out), "--prompt", prompt, "--max-new-tokens", "6", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == text + "\n"
    assert generate_main([str(tmp_path / "nothing"), "--prompt", "x"]) == 1


def test_pretrained_run_exports_from_a_copy_of_its_model_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save_neox_config(tmp_path / "cfg", num_layers=1)
    fresh = build_run_model(RunConfig(model=str(tmp_path / "cfg"), data=DataConfig(seq_len=SEQ_LEN)), 256).model
    fresh.save_pretrained(tmp_path / "pre", safe_serialization=True)
    run = RunConfig(run_id="pre", model=str(tmp_path / "pre"), data=DataConfig(seq_len=SEQ_LEN))
    ckpt = save_checkpoint(tmp_path, run, 256)
    (tmp_path / "pre").rename(tmp_path / "moved")  # the exporting machine keeps the files elsewhere

    assert run_export([str(ckpt), "--out", str(tmp_path / "x")]) == 1  # the run's path is gone: says so
    assert "does not exist" in capsys.readouterr().err
    assert run_export([str(ckpt), "--out", str(tmp_path / "out"), "--model", str(tmp_path / "moved")]) == 0
    text = pipeline("text-generation", model=str(tmp_path / "out"))("ab", max_new_tokens=3)[0]["generated_text"]
    assert text.startswith("ab")

    with torch.no_grad():  # same shapes, other weights: refused
        next(fresh.parameters()).add_(1.0)
    fresh.save_pretrained(tmp_path / "other", safe_serialization=True)
    assert run_export([str(ckpt), "--out", str(tmp_path / "y"), "--model", str(tmp_path / "other")]) == 1
    assert "fingerprint differs" in capsys.readouterr().err
