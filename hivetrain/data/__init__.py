"""Training text: its settings (``config``), corpus discovery (``sources``), tokenizers (``tokenizers``), the shared
held-out windows and each peer's stream of training windows (``stream``), and opening the run's corpus (``corpus``).

Files, directories and globs name the corpus: text files, and .jsonl/.json/.parquet/.arrow record files read through
the ``datasets`` library (local files only; the text is in ``data.text_field``). Everything is read as a stream, so a
corpus far bigger than memory trains as well as a small one. The default corpus is the Python standard library's
source files of the machine the peer runs on; tokenization is bytes (vocabulary 256) unless a local ``transformers``
tokenizer directory is given. Nothing is ever downloaded.

Everything but ``DataConfig`` is imported lazily (PEP 562), as in ``hivetrain.averaging``: ``hivetrain.config`` needs
``DataConfig`` and must pull in no torch, so that a command's ``--help`` and config errors answer at once.
"""

from typing import Any

from hivetrain.data.config import DataConfig

__all__ = [
    "RECORD_SUFFIXES",
    "TEXT_SUFFIXES",
    "ByteTokenizer",
    "Corpus",
    "DataConfig",
    "LocalTokenizer",
    "Shard",
    "StreamCursor",
    "default_corpus_files",
    "is_held_out",
    "iter_documents",
    "list_shards",
    "load_corpus",
    "make_tokenizer",
    "pack",
    "resolve_files",
    "stream_seed",
    "vocab_size_of",
]

_LAZY = {
    **dict.fromkeys(
        (
            "RECORD_SUFFIXES",
            "TEXT_SUFFIXES",
            "Shard",
            "default_corpus_files",
            "iter_documents",
            "list_shards",
            "resolve_files",
        ),
        "hivetrain.data.sources",
    ),
    **dict.fromkeys(("Corpus", "StreamCursor", "is_held_out", "pack"), "hivetrain.data.stream"),
    **dict.fromkeys(("ByteTokenizer", "LocalTokenizer"), "hivetrain.data.tokenizers"),
    **dict.fromkeys(("load_corpus", "make_tokenizer", "stream_seed", "vocab_size_of"), "hivetrain.data.corpus"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hivetrain.data' has no attribute {name!r}")
