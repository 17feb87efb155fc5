"""Tokenizers of the training text: bytes (vocabulary 256, the default) or a local ``transformers`` tokenizer
directory (``data.tokenizer``). Nothing is ever downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np


class ByteTokenizer:
    """Bytes as tokens: vocabulary 256, no download, lossless."""

    vocab_size = 256
    name = "bytes"

    def encode(self, text: bytes) -> np.ndarray:
        """(n,) uint8 token ids of ``text`` (UTF-8 bytes)."""
        return np.frombuffer(text, dtype=np.uint8)

    def decode(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")

    def separator(self) -> np.ndarray:
        """Tokens put between two documents when they are packed into windows: a blank line."""
        return np.frombuffer(b"\n\n", dtype=np.uint8)


class LocalTokenizer:
    """A ``transformers`` tokenizer read from a local directory (never downloaded).

    Raises:
        FileNotFoundError: the directory does not exist.
    """

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        if not Path(path).is_dir():
            raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self._tok)
        self.name = f"{Path(path).name}:{self.vocab_size}"

    def encode(self, text: bytes) -> np.ndarray:
        """(n,) int32 token ids of ``text`` (UTF-8 bytes; invalid sequences replaced), without special tokens."""
        ids = self._tok(text.decode("utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
        return np.asarray(ids, dtype=np.int32)

    def decode(self, tokens: list[int]) -> str:
        return self._tok.decode(tokens)

    def separator(self) -> np.ndarray:
        """The end-of-sequence token between documents if the tokenizer has one, else the tokens of a blank line."""
        eos = self._tok.eos_token_id
        return np.asarray([eos], dtype=np.int32) if eos is not None else self.encode(b"\n\n")
