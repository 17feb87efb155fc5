"""The training data's settings (a table ``[data]`` of the run's TOML file; read by ``hivetrain.data``)."""

from __future__ import annotations

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

_STRICT = ConfigDict(extra="forbid")


@dataclass(frozen=True, config=_STRICT)
class DataConfig:
    """Training data and batching.

    Args:
        paths: text files, .jsonl/.json/.parquet/.arrow record files, directories (searched recursively for text
            files and .jsonl/.parquet/.arrow) or globs; empty = this machine's Python standard library sources
            (real text every machine has). Read as streams: a corpus may be far bigger than memory.
        text_field: the field of a record (in .jsonl/.json/.parquet/.arrow files) that holds its text.
        tokenizer: path of a local ``transformers`` tokenizer directory; empty = bytes (vocabulary 256).
        seq_len: tokens per training window.
        batch_size: windows per inner step (samples per inner step).
        num_eval_windows: held-out windows every peer evaluates on (the same windows on every peer).
        eval_fraction: fraction of the corpus's documents held out for evaluation, chosen by a hash of their content
            (the same documents on every peer; ``hivetrain.data.stream``).
        max_corpus_bytes: use at most about this many bytes of files, the first in sorted order (0 = no limit;
            memory does not depend on it).
        shuffle_windows: windows in each peer's shuffle buffer (memory: this x (seq_len + 1) tokens).
    """

    paths: tuple[str, ...] = ()
    text_field: str = Field(default="text", min_length=1, max_length=256)
    tokenizer: str = ""
    seq_len: int = Field(default=128, ge=8, le=65536)
    batch_size: int = Field(default=8, ge=1, le=4096)
    num_eval_windows: int = Field(default=32, ge=1, le=100_000)
    eval_fraction: float = Field(default=0.02, gt=0.0, lt=0.5)
    max_corpus_bytes: int = Field(default=0, ge=0)
    shuffle_windows: int = Field(default=512, ge=1, le=1_000_000)
