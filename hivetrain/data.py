"""Training text: corpus discovery, tokenization, per-peer training streams and shared held-out windows.

The default corpus is the Python standard library's source files of the machine the peer runs on (real text every
machine with Python has; ``site-packages`` excluded). Tokenization is byte-level (vocabulary 256) unless a local
``transformers`` tokenizer directory is given, so nothing is ever downloaded.

The corpus is split once: its last ``eval_fraction`` is held out. Every peer evaluates on the same evenly spaced
held-out windows; each peer samples training windows from the rest with its own random stream.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hivetrain.config import DataConfig

TEXT_SUFFIXES = {".txt", ".py", ".md", ".rst", ".json", ".toml", ".c", ".h", ".js", ".html", ".csv", ".tex", ".xml"}
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git", ".venv", "node_modules"}


def default_corpus_files() -> list[Path]:
    """This machine's standard-library ``*.py`` files, sorted (site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in _walk(root) if p.suffix == ".py")


def _walk(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            yield Path(dirpath) / name


def resolve_files(paths: tuple[str, ...] | list[str]) -> list[Path]:
    """Expand files, directories (recursively, text-like suffixes only) and globs into a sorted file list.

    Raises:
        FileNotFoundError: a path or glob matches nothing, or no text file is found at all.
    """
    if not paths:
        files = default_corpus_files()
        if not files:
            raise FileNotFoundError(f"no Python standard-library sources found under {sysconfig.get_paths()['stdlib']}")
        return files
    files: list[Path] = []
    for spec in paths:
        spec = os.path.expanduser(spec)
        matches = sorted(glob.glob(spec, recursive=True)) if glob.has_magic(spec) else [spec]
        found = False
        for match in matches:
            path = Path(match)
            if path.is_dir():
                children = [p for p in _walk(path) if p.suffix.lower() in TEXT_SUFFIXES]
                files.extend(children)
                found = found or bool(children)
            elif path.is_file():
                files.append(path)
                found = True
        if not found:
            raise FileNotFoundError(f"data path {spec!r} matches no readable text file")
    return sorted(dict.fromkeys(files))


def read_corpus(files: list[Path], max_bytes: int) -> bytes:
    """Concatenate files (each followed by a blank line) up to ``max_bytes`` bytes (0 = all)."""
    chunks, total = [], 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if max_bytes and total + len(data) > max_bytes:
            data = data[: max_bytes - total]
        chunks.append(data + b"\n\n")
        total += len(data) + 2
        if max_bytes and total >= max_bytes:
            break
    return b"".join(chunks)


class ByteTokenizer:
    """Bytes as tokens: vocabulary 256, no download, lossless."""

    vocab_size = 256

    def encode(self, text: bytes) -> np.ndarray:
        return np.frombuffer(text, dtype=np.uint8)

    def decode(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")


class LocalTokenizer:
    """A ``transformers`` tokenizer read from a local directory (never downloaded)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        if not Path(path).is_dir():
            raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self._tok)

    def encode(self, text: bytes) -> np.ndarray:
        ids = self._tok(text.decode("utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
        return np.asarray(ids, dtype=np.int32)

    def decode(self, tokens: list[int]) -> str:
        return self._tok.decode(tokens)


@dataclass
class Corpus:
    """A tokenized corpus split into a training region and a held-out region.

    Attributes:
        tokens: (num_tokens,) uint8 (bytes) or int32 (tokenizer ids).
        split: index of the first held-out token.
        vocab_size: size of the tokenizer's vocabulary.
        digest: sha256 of the tokens, equal on peers that read the same corpus.
    """

    tokens: np.ndarray
    split: int
    vocab_size: int
    digest: str

    def eval_windows(self, seq_len: int, num_windows: int) -> torch.Tensor:
        """(num_windows, seq_len + 1) int64: evenly spaced held-out windows, the same on every peer."""
        held_out = len(self.tokens) - self.split
        if held_out < seq_len + 1:
            raise ValueError(f"held-out text ({held_out} tokens) is shorter than one window ({seq_len + 1})")
        last_start = len(self.tokens) - (seq_len + 1)
        starts = np.linspace(self.split, last_start, num=num_windows).astype(np.int64)
        return torch.from_numpy(np.stack([self.tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64))

    def train_batches(self, seq_len: int, batch_size: int, stream_seed: int) -> Iterator[torch.Tensor]:
        """Endless (batch_size, seq_len + 1) int64 batches of random training windows for one peer."""
        last_start = self.split - (seq_len + 1)
        if last_start <= 0:
            raise ValueError(f"training text ({self.split} tokens) is shorter than one window ({seq_len + 1})")
        rng = np.random.default_rng(stream_seed)
        while True:
            starts = rng.integers(0, last_start, size=batch_size)
            yield torch.from_numpy(np.stack([self.tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64))


def vocab_size_of(config: DataConfig) -> int:
    """Vocabulary size the run's model needs: 256 for bytes, else the local tokenizer's size."""
    return LocalTokenizer(config.tokenizer).vocab_size if config.tokenizer else ByteTokenizer.vocab_size


def load_corpus(config: DataConfig) -> Corpus:
    """Read, tokenize and split the corpus that ``config`` names.

    Raises:
        FileNotFoundError: a data path or the tokenizer directory is missing.
        ValueError: the corpus is too short for one training window and one held-out window.
    """
    files = resolve_files(config.paths)
    text = read_corpus(files, config.max_corpus_bytes)
    tokenizer = LocalTokenizer(config.tokenizer) if config.tokenizer else ByteTokenizer()
    tokens = tokenizer.encode(text)
    split = int(len(tokens) * (1.0 - config.eval_fraction))
    needed = 2 * (config.seq_len + 1)
    if split < needed or len(tokens) - split < config.seq_len + 1:
        raise ValueError(
            f"corpus too small: {len(tokens)} tokens from {len(files)} file(s); need at least "
            f"{int(needed / config.eval_fraction)} for seq_len={config.seq_len} and "
            f"eval_fraction={config.eval_fraction}"
        )
    digest = hashlib.sha256(tokens.tobytes()).hexdigest()
    return Corpus(tokens=tokens, split=split, vocab_size=tokenizer.vocab_size, digest=digest)


def stream_seed(run_seed: int, peer_id: str) -> int:
    """Seed of one peer's training stream: distinct per peer, reproducible for a given identity."""
    return int.from_bytes(hashlib.sha256(f"{run_seed}:{peer_id}".encode()).digest()[:8], "little")
