"""Opening the run's corpus: its tokenizer, the checked ``Corpus`` that ``data`` names, each peer's stream seed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hivetrain.data.config import DataConfig
from hivetrain.data.sources import list_shards, resolve_files
from hivetrain.data.stream import Corpus
from hivetrain.data.tokenizers import ByteTokenizer, LocalTokenizer


def make_tokenizer(config: DataConfig) -> ByteTokenizer | LocalTokenizer:
    """Bytes, or the local tokenizer directory ``config.tokenizer``. Raises FileNotFoundError if it is missing."""
    return LocalTokenizer(config.tokenizer) if config.tokenizer else ByteTokenizer()


def vocab_size_of(config: DataConfig) -> int:
    """Vocabulary size the run's model needs: 256 for bytes, else the local tokenizer's size."""
    return make_tokenizer(config).vocab_size


def load_corpus(config: DataConfig, cursor_path: str | Path | None = None) -> Corpus:
    """List the corpus that ``config`` names and check that it holds held-out and training windows.

    Reads only what the checks need: the held-out windows (about ``num_eval_windows * (seq_len + 1) /
    eval_fraction`` tokens from the start of the sorted corpus) and the first training window.

    Args:
        config: the run's data config.
        cursor_path: a file where training streams keep their position across restarts (None = none).

    Raises:
        FileNotFoundError: a data path or the tokenizer directory is missing.
        ValueError: the corpus holds no text, is too small for one held-out and one training window, or a record
            file lacks the text field (the message says what to change).
    """
    shards = list_shards(resolve_files(config.paths), config.max_corpus_bytes)
    tokenizer = make_tokenizer(config)
    listing = [(s.path.name, s.size_bytes, s.kind, s.limit_bytes) for s in shards]
    blob = json.dumps(
        {"shards": listing, "tokenizer": tokenizer.name, "text_field": config.text_field, "eval": config.eval_fraction}
    )
    corpus = Corpus(
        shards=shards,
        tokenizer=tokenizer,
        text_field=config.text_field,
        eval_fraction=config.eval_fraction,
        vocab_size=tokenizer.vocab_size,
        digest=hashlib.sha256(blob.encode()).hexdigest(),
        shuffle_windows=config.shuffle_windows,
    )
    if next(iter(corpus.documents(held_out=False)), None) is None and next(iter(corpus.documents(True)), None) is None:
        named = ", ".join(config.paths) if config.paths else "the default corpus"
        raise ValueError(f"no text in {named}: every file is empty; point data.paths at files that hold text")
    corpus.eval_windows(config.seq_len, config.num_eval_windows)  # raises if too small; cached for the trainer
    next(iter(corpus.train_windows(config.seq_len, stream_seed=0)), None)  # raises if no training window
    corpus.cursor_path = Path(cursor_path) if cursor_path is not None else None  # set after the check: it saves none
    return corpus


def stream_seed(run_seed: int, peer_id: str) -> int:
    """Seed of one peer's training stream: distinct per peer, reproducible for a given identity."""
    return int.from_bytes(hashlib.sha256(f"{run_seed}:{peer_id}".encode()).digest()[:8], "little")
