"""Where training text comes from: the files a run's ``data.paths`` name, cut into shards, read as documents.

A *shard* is one file (a text file, or a .jsonl/.json/.parquet/.arrow file of records). A *document* is the unit the
held-out split and the packing work on: a record's text field (``data.text_field``) for structured files, a block of
whole lines of at most ``TEXT_BLOCK_BYTES`` for text files. Documents are read as a stream: a file is never read
whole into memory (structured files through the ``datasets`` library in streaming mode, local files only; text files
in blocks), so memory does not grow with the corpus.

The default corpus (no ``paths``) is the Python standard library's source files of the machine the peer runs on:
real text every machine with Python has (``site-packages`` excluded).
"""

from __future__ import annotations

import glob
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

TEXT_SUFFIXES = {".txt", ".py", ".md", ".rst", ".toml", ".c", ".h", ".js", ".html", ".csv", ".tex", ".xml"}
RECORD_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
WALKED_RECORD_SUFFIXES = {".jsonl", ".parquet", ".arrow"}  # .json in a directory is more often a config than data
TEXT_BLOCK_BYTES = 4096  # documents of a text file: blocks of whole lines up to this size (longer lines are cut)
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git", ".venv", "node_modules"}

ShardKind = Literal["text", "json", "parquet", "arrow"]


@dataclass(frozen=True)
class Shard:
    """One file of the corpus.

    Attributes:
        path: the file.
        kind: "text" (read in line blocks) or the ``datasets`` builder of a record file.
        size_bytes: the file's size when the corpus was listed.
        limit_bytes: read at most this many bytes of a text file (0 = all; set on the last shard under
            ``data.max_corpus_bytes``).
    """

    path: Path
    kind: ShardKind
    size_bytes: int
    limit_bytes: int = 0


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
    """Expand files, directories (recursively: text-like suffixes and .jsonl/.parquet/.arrow) and globs into a sorted
    file list; no paths = ``default_corpus_files()``.

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
                wanted = TEXT_SUFFIXES | WALKED_RECORD_SUFFIXES
                children = [p for p in _walk(path) if p.suffix.lower() in wanted]
                files.extend(children)
                found = found or bool(children)
            elif path.is_file():
                files.append(path)
                found = True
        if not found:
            raise FileNotFoundError(f"data path {spec!r} matches no readable text or record file")
    return sorted(dict.fromkeys(files))


def list_shards(files: list[Path], max_bytes: int = 0) -> list[Shard]:
    """The shards of ``files`` in their (sorted) order, up to about ``max_bytes`` of file size (0 = all).

    Under a cap, whole files are taken while they fit; a text file that crosses the cap is read up to it, a record
    file that crosses it is left out unless it is the first (a record file is never cut: its bytes are not text).

    Raises:
        FileNotFoundError: no file is left (all unreadable).
    """
    shards: list[Shard] = []
    total = 0
    for path in files:
        try:
            size = path.stat().st_size
        except OSError:
            continue
        kind: ShardKind = RECORD_SUFFIXES.get(path.suffix.lower(), "text")  # type: ignore[assignment]
        if max_bytes and total + size > max_bytes:
            room = max_bytes - total
            if kind == "text" and room > 0:
                shards.append(Shard(path, kind, size, limit_bytes=room))
            elif not shards:
                shards.append(Shard(path, kind, size))
            break
        shards.append(Shard(path, kind, size))
        total += size
    if not shards:
        raise FileNotFoundError(f"none of the {len(files)} data file(s) could be read")
    return shards


def iter_documents(shard: Shard, text_field: str = "text", start: int = 0) -> Iterator[tuple[int, bytes]]:
    """The documents of ``shard`` from document index ``start`` on: (index, UTF-8 bytes), streamed.

    Raises:
        ValueError: a record file's record has no string field ``text_field`` (the message names file, record and
            the fields it has), or the file is not valid JSON Lines / Parquet / Arrow.
        OSError: the file cannot be read.
    """
    if shard.kind == "text":
        yield from _text_blocks(shard, start)
    else:
        yield from _records(shard, text_field, start)


def _text_blocks(shard: Shard, start: int) -> Iterator[tuple[int, bytes]]:
    limit = shard.limit_bytes or shard.size_bytes or (1 << 62)
    index, pending, read = 0, b"", 0
    with open(shard.path, "rb") as f:
        while read < limit:
            chunk = f.read(min(1 << 16, limit - read))
            if not chunk:
                break
            read += len(chunk)
            pending += chunk
            while len(pending) >= TEXT_BLOCK_BYTES:
                cut = pending.rfind(b"\n", 0, TEXT_BLOCK_BYTES) + 1 or TEXT_BLOCK_BYTES
                if index >= start:
                    yield index, pending[:cut]
                index, pending = index + 1, pending[cut:]
    if pending and index >= start:
        yield index, pending


class MissingTextField(ValueError):
    """A record has no string field ``data.text_field``."""


def _records(shard: Shard, text_field: str, start: int) -> Iterator[tuple[int, bytes]]:
    from datasets import load_dataset  # lazy: pyarrow and pandas cost ~1 s to import

    def failed(exc: Exception) -> ValueError:
        return ValueError(f"{shard.path}: cannot read it as {shard.kind}: {type(exc).__name__}: {exc}")

    try:
        stream = load_dataset(shard.kind, data_files=[str(shard.path)], split="train", streaming=True)
        rows = iter(stream.skip(start) if start else stream)
    except Exception as exc:  # noqa: BLE001 - pyarrow/datasets raise many types for a malformed file
        raise failed(exc) from None
    index = start
    while True:
        try:  # only the read is guarded: nothing is caught around the yield
            row = next(rows)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001
            raise failed(exc) from None
        value = row.get(text_field)
        if not isinstance(value, str):
            raise ValueError(
                f"{shard.path}: record {index} has no string field {text_field!r} (fields: {sorted(row)[:10]}); "
                "set data.text_field to the field that holds the text"
            )
        yield index, value.encode("utf-8")
        index += 1
