"""A training state kept on disk: θ, outer momentum and epoch in one safetensors file, read and written in bounded
pieces, for a process that follows a model larger than its memory (the coordinator's follower, issue 24: a 7B run's
state is 56 GB, a small VPS has 2).

Layout: a standard safetensors file (``safetensors.torch.load_file`` reads it) whose tensors are those of
``TrainingState.to_flat_dict()`` (θ, then outer momentum under ``outer_momentum.``), fp32 little-endian, stored
contiguously in that order, so the data section *is* the state-download wire layout (``state_wire``): byte ``i`` of
the flat state is byte ``data_offset + i`` of the file. The header's metadata holds ``format`` and ``epoch``; the
header is padded with spaces to a width that fits any epoch, so a file can be written before its epoch is known
(a download) and its header rewritten in place at the end.

Memory: every operation holds a piece (``PIECE_BYTES``) of the state at a time, two for a step between two states,
never the state (``StateFile.to_state`` excepted: for states that fit); the page cache
holds what the kernel likes, and gives it back under pressure (reads and writes are ``pread``/``pwrite``, not a
mapping, so none of it counts in this process's RSS).

A ``StateFile`` exists only for bytes that were checked: written by us from a finite ``TrainingState``, or finished
by a ``StateFileWriter`` or made by ``copy_state_file`` after a pass that hashed every byte and found every value
finite. Files are never modified after that; a ``StateFile`` keeps its file descriptor open, so the bytes stay
readable when the follower unlinks the path of a state it no longer needs (the state server may still be serving it)
and the disk space comes back when the last reference is dropped.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from hivetrain.diloco.state import MOMENTUM_PREFIX, TrainingState

PIECE_BYTES = 8 * 2**20
"""Bytes read or written at a time: the most of a state any operation here holds in memory (plus one piece more)."""
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
_EPOCH_DIGITS = 20  # the widest epoch a header leaves room for
STATE_FORMAT = "hivetrain-state"


class StateFileInvalid(ValueError):
    """A state file is not a state of our model: unparsable header, a short file, a value that is not finite
    (corrupt), or a valid state of another model (``other_model``: other names or shapes). ``reason`` says which."""

    def __init__(self, reason: str, other_model: bool = False):
        super().__init__(reason)
        self.reason, self.other_model = reason, other_model


def meta_reference(source: torch.nn.Module | TrainingState) -> TrainingState:
    """A state with the parameter names and shapes of ``source`` (a model, itself possibly on the meta device, or a
    state) on the meta device: what every size and name is checked against, holding no memory."""
    named = source.params.items() if isinstance(source, TrainingState) else source.named_parameters()
    params = {n: torch.empty(p.shape, dtype=torch.float32, device="meta") for n, p in named}
    return TrainingState(0, params, {n: torch.empty_like(t) for n, t in params.items()})


def _spans(reference: TrainingState) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(flat name, shape, start, end) of every tensor in the flat layout, bytes relative to the data section."""
    spans, offset = [], 0
    for name, tensor in reference.to_flat_dict().items():
        size = tensor.numel() * 4
        spans.append((name, tuple(tensor.shape), offset, offset + size))
        offset += size
    return spans


def _header(reference: TrainingState, epoch: int) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": STATE_FORMAT, "epoch": str(epoch)}}
    for name, shape, start, end in _spans(reference):
        entries[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [start, end]}
    return json.dumps(entries, separators=(",", ":")).encode()


def header_width(reference: TrainingState) -> int:
    """Bytes of the JSON header (padded to a multiple of 8) of ``reference``'s state files, whatever the epoch."""
    return math.ceil(len(_header(reference, 10 ** (_EPOCH_DIGITS - 1))) / 8) * 8


def _framed_header(reference: TrainingState, epoch: int) -> bytes:
    width = header_width(reference)
    raw = _header(reference, epoch)
    return struct.pack("<Q", width) + raw + b" " * (width - len(raw))


def _pread(fd: int, start: int, size: int) -> bytes:
    parts, done = [], 0
    while done < size:
        part = os.pread(fd, size - done, start + done)
        if not part:
            raise StateFileInvalid(f"file ends at byte {start + done}, {size - done} bytes short")
        parts.append(part)
        done += len(part)
    return b"".join(parts)


def _pwrite(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class StateFile:
    """One checked state on disk (module docstring); the same reads as a ``TrainingState`` without its memory.

    Attributes:
        path: the file (may be unlinked while this object lives: reads go through the open descriptor).
        epoch: committed outer steps of the state.
        reference: names and shapes of the model (a ``meta_reference`` holds no memory).
        data_offset: byte offset of the flat state in the file.
    """

    def __init__(self, path: Path, epoch: int, reference: TrainingState, state_hash: str):
        self.path, self.epoch, self.reference = Path(path), epoch, reference
        self._hash = state_hash
        self.data_offset = 8 + header_width(reference)
        self._num_bytes = _spans(reference)[-1][3] if reference.params else 0
        self._fd = os.open(self.path, os.O_RDONLY)
        self._closer = weakref.finalize(self, os.close, self._fd)
        stat = os.fstat(self._fd)
        self.inode = (stat.st_dev, stat.st_ino)  # tells whether ``path`` still names these bytes

    def header_bytes(self) -> bytes:
        """The file's first ``data_offset`` bytes (length and JSON header)."""
        return _pread(self._fd, 0, self.data_offset)

    def state_hash(self) -> str:
        """``TrainingState.state_hash()`` of these bytes (computed when they were checked)."""
        return self._hash

    def num_bytes(self) -> int:
        """Size of θ plus momentum in bytes (the flat state; the file adds its header)."""
        return self._num_bytes

    def read_range(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the flat state (the state-download layout).

        Raises:
            ValueError: the range is outside the state.
            StateFileInvalid: the file was truncated under us.
        """
        if not 0 <= start <= end <= self._num_bytes:
            raise ValueError(f"range [{start}, {end}) outside the state's {self._num_bytes} bytes")
        return _pread(self._fd, self.data_offset + start, end - start)

    def pieces(self, start: int, end: int, piece_bytes: int | None = None) -> Iterator[bytes]:
        """Bytes ``[start, end)`` of the flat state in pieces of at most ``piece_bytes`` (None: ``PIECE_BYTES``)."""
        piece_bytes = piece_bytes or PIECE_BYTES
        for offset in range(start, end, piece_bytes):
            yield self.read_range(offset, min(offset + piece_bytes, end))

    def to_state(self) -> TrainingState:
        """The whole state in memory (fp32 CPU tensors): for states that fit, and tests.

        Raises:
            ValueError: the bytes do not form a state of ``reference``'s model.
        """
        from hivetrain.diloco.state_wire import unflatten

        return unflatten(bytearray(self.read_range(0, self._num_bytes)), self.epoch, self.reference)

    def close(self) -> None:
        """Close the descriptor now (otherwise when the object is collected); reads fail afterwards."""
        self._closer()


def write_state_file(state: TrainingState, path: Path, reference: TrainingState | None = None) -> StateFile:
    """Write ``state`` (in memory, finite) to ``path`` in the state-file layout, one tensor piece at a time.

    Raises:
        ValueError: a tensor holds NaN or Inf.
        OSError: the write failed (the partial file is removed).
    """
    reference = reference or state
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _pwrite(fd, _framed_header(reference, state.epoch), 0)
        offset = 8 + header_width(reference)
        for name, tensor in state.to_flat_dict().items():
            flat = tensor.contiguous().view(-1).view(torch.uint8).numpy()
            for start in range(0, len(flat), PIECE_BYTES):
                piece = flat[start : start + PIECE_BYTES]
                if not np.isfinite(piece.view("<f4")).all():
                    raise ValueError(f"{name} contains NaN or Inf")
                _pwrite(fd, piece, offset)
                offset += len(piece)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return StateFile(path, state.epoch, reference, state.state_hash())


class StateFileWriter:
    """Receives the bytes of a flat state in any order (``writer[start:end] = data``, as into a ``bytearray``), then
    checks them into a ``StateFile`` (``finish``). A state download writes into one instead of memory.

    Args:
        path: the file to create (truncated if it exists).
        reference: names and shapes of the model; the file is sized from them, never from a donor's claim.

    Raises:
        OSError: the file cannot be created or sized (a full disk shows here, before any byte is downloaded).
    """

    def __init__(self, path: Path, reference: TrainingState):
        self.path, self.reference = Path(path), reference
        self.data_offset = 8 + header_width(reference)
        self.num_bytes = _spans(reference)[-1][3] if reference.params else 0
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.posix_fallocate(self._fd, 0, self.data_offset + self.num_bytes)
        except OSError:
            self.abandon()
            raise

    def __len__(self) -> int:
        return self.num_bytes

    def __setitem__(self, where: slice, data: bytes | bytearray | memoryview) -> None:
        start, end = where.start or 0, where.stop if where.stop is not None else self.num_bytes
        if not 0 <= start <= end <= self.num_bytes or end - start != len(data):
            raise ValueError(f"write of {len(data)} bytes at [{start}, {end}) outside the state's {self.num_bytes}")
        _pwrite(self._fd, data, self.data_offset + start)

    def finish(self, epoch: int, expected_hash: str | None) -> StateFile | None:
        """Stamp ``epoch`` in the header, hash every byte and check it is finite: the ``StateFile`` if every value is
        finite and the hash is ``expected_hash`` (None: any hash), else None (the file stays open for the next
        attempt: most of its chunks may still be right)."""
        _pwrite(self._fd, _framed_header(self.reference, epoch), 0)
        digest, finite = _hash_flat(self._read, self.reference, epoch)
        if not finite or expected_hash not in (None, digest):
            return None
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        return StateFile(self.path, epoch, self.reference, digest)

    def _read(self, start: int, end: int) -> bytes:
        return _pread(self._fd, self.data_offset + start, end - start)

    def abandon(self) -> None:
        """Close and remove the file (a download that failed)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.path.unlink(missing_ok=True)


def _hash_flat(read, reference: TrainingState, epoch: int) -> tuple[str, bool]:
    """(``TrainingState.state_hash()``, every value finite) of a flat state read as ``read(start, end)``, one piece
    at a time."""
    spans = {name: (shape, start, end) for name, shape, start, end in _spans(reference)}
    return _hash_spans(read, list(reference.params), spans, epoch)


def _hash_spans(
    read, names: list[str], spans: dict[str, tuple[tuple[int, ...], int, int]], epoch: int
) -> tuple[str, bool]:
    """``TrainingState.state_hash()`` (the same bytes in the same order) and whether every value is finite, of the
    parameters ``names`` and their momentum whose bytes lie at ``spans`` (flat name -> (shape, start, end)), read as
    ``read(start, end)`` one piece at a time."""
    digest = hashlib.sha256(f"epoch={epoch}".encode())
    finite = True
    for group, prefix in (("param", ""), ("momentum", MOMENTUM_PREFIX)):
        for name in names:
            shape, start, end = spans[prefix + name]
            digest.update(f"{group}:{name}:{shape}".encode())
            for offset in range(start, end, PIECE_BYTES):
                piece = read(offset, min(offset + PIECE_BYTES, end))
                digest.update(piece)
                finite = finite and bool(np.isfinite(np.frombuffer(piece, dtype="<f4")).all())
    return digest.hexdigest(), finite


def read_safetensors_header(fd: int, file_bytes: int) -> tuple[int, dict[str, tuple[tuple[int, ...], int, int]]]:
    """(absolute offset of the data section, name -> (shape, start, end) in bytes relative to it) of a safetensors
    file of fp32 tensors, every claim bounded: the header's size, each tensor's size against its shape, the ranges
    inside the file and tiling the data section without gap or overlap.

    Raises:
        StateFileInvalid: the header does not parse, or breaks a bound.
    """
    if file_bytes < 8:
        raise StateFileInvalid(f"{file_bytes} bytes: no safetensors header")
    (size,) = struct.unpack("<Q", _pread(fd, 0, 8))
    if size > min(MAX_HEADER_BYTES, file_bytes - 8):
        raise StateFileInvalid(f"header of {size} bytes in a file of {file_bytes}")
    try:
        raw = json.loads(_pread(fd, 8, size))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StateFileInvalid(f"header does not parse: {exc}") from None
    if not isinstance(raw, dict):
        raise StateFileInvalid("header is not a map")
    data_offset, data_bytes = 8 + size, file_bytes - 8 - size
    entries: dict[str, tuple[tuple[int, ...], int, int]] = {}
    for name, entry in raw.items():
        if name == "__metadata__":
            continue
        try:
            shape, (start, end) = tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
            ok = entry["dtype"] == "F32" and isinstance(start, int) and isinstance(end, int)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok or any(d < 0 for d in shape) or end - start != math.prod(shape) * 4 or not 0 <= start <= end:
            raise StateFileInvalid(f"tensor {str(name)[:80]!r}: not an fp32 tensor its shape fits")
        entries[name] = (shape, start, end)
    covered = 0
    for _, start, end in sorted(entries.values(), key=lambda e: (e[1], e[2])):
        if start != covered:
            raise StateFileInvalid(f"tensor data overlaps or leaves a gap at byte {start}")
        covered = end
    if covered != data_bytes:
        raise StateFileInvalid(f"tensors cover {covered} bytes of a data section of {data_bytes}")
    return data_offset, entries


def copy_state_file(src: Path, reference: TrainingState, epoch: int, dst: Path) -> StateFile:
    """Any safetensors file holding a state of ``reference``'s model (tensors in any order, e.g. a checkpoint written
    by ``safetensors.torch.save_file``) copied into the state-file layout at ``dst``, one piece at a time, hashed and
    checked finite on the way. A file already in that layout (a checkpoint of a follower's state file) is hard-linked
    at ``dst`` instead when it can be (same file system), and only read: a restart of a 7B run's coordinator hashes
    56 GB once instead of also copying them.

    Raises:
        StateFileInvalid: the file is not a state of this model (names, shapes, a non-finite value, a short file).
        OSError: reading or writing failed (``dst`` is removed).
    """
    spans = _spans(reference)
    fd = os.open(src, os.O_RDONLY)
    try:
        data_offset, entries = read_safetensors_header(fd, os.fstat(fd).st_size)
        if set(entries) != {name for name, *_ in spans}:
            missing = sorted({name for name, *_ in spans} - set(entries))
            extra = sorted(set(entries) - {name for name, *_ in spans})
            raise StateFileInvalid(
                f"tensors differ from the model's: missing {missing[:3]}, unexpected {extra[:3]}", other_model=True
            )
        for name, shape, _, _ in spans:
            if entries[name][0] != shape:
                raise StateFileInvalid(f"{name}: shape {entries[name][0]}, the model's is {shape}", other_model=True)
        in_layout = data_offset == 8 + header_width(reference) and all(
            entries[name][1:] == (start, end) for name, _, start, end in spans
        )
        if in_layout and _link(src, dst):
            digest, finite = _hash_flat(lambda s, e: _pread(fd, data_offset + s, e - s), reference, epoch)
            if not finite:
                dst.unlink(missing_ok=True)
                raise StateFileInvalid("a tensor holds NaN or Inf")
            return StateFile(dst, epoch, reference, digest)
        writer = StateFileWriter(dst, reference)
        try:
            for name, _, start, end in spans:
                src_start = entries[name][1]
                for offset in range(0, end - start, PIECE_BYTES):
                    size = min(PIECE_BYTES, end - start - offset)
                    writer[start + offset : start + offset + size] = _pread(fd, data_offset + src_start + offset, size)
            done = writer.finish(epoch, None)
            if done is None:
                raise StateFileInvalid("a tensor holds NaN or Inf")
            return done
        except BaseException:
            writer.abandon()
            raise
    finally:
        os.close(fd)


def _link(src: Path, dst: Path) -> bool:
    """Hard-link ``src`` at ``dst`` (replacing it); False where the file system will not (then copy)."""
    try:
        Path(dst).unlink(missing_ok=True)
        os.link(src, dst)
        return True
    except OSError:
        return False


def state_hash_of_file(src: Path, reference_names: list[str], epoch: int) -> tuple[str, bool]:
    """(``TrainingState.state_hash()``, every value finite) of the state in any safetensors file of fp32 tensors
    named as ``to_flat_dict`` names them, for parameters ``reference_names`` in that order; one piece at a time.

    Raises:
        StateFileInvalid: the header breaks a bound, or a tensor is missing or extra.
    """
    fd = os.open(src, os.O_RDONLY)
    try:
        data_offset, entries = read_safetensors_header(fd, os.fstat(fd).st_size)
        wanted = set(reference_names) | {MOMENTUM_PREFIX + n for n in reference_names}
        if set(entries) != wanted:
            raise StateFileInvalid("tensors do not form a training state of the listed parameters")
        for name in reference_names:
            if entries[MOMENTUM_PREFIX + name][0] != entries[name][0]:
                momentum, param = entries[MOMENTUM_PREFIX + name][0], entries[name][0]
                raise StateFileInvalid(f"{name}: momentum shape {momentum} != parameter shape {param}")
        return _hash_spans(lambda s, e: _pread(fd, data_offset + s, e - s), reference_names, entries, epoch)
    finally:
        os.close(fd)


def theta_pieces(state: TrainingState | StateFile, piece_bytes: int | None = None) -> Iterator[np.ndarray]:
    """θ (the first half of the flat state) as fp32 arrays of at most ``piece_bytes`` (None: ``PIECE_BYTES``), in
    flat order: two states of one model give aligned pieces."""
    piece_bytes = piece_bytes or PIECE_BYTES
    if isinstance(state, StateFile):
        for piece in state.pieces(0, state.num_bytes() // 2, piece_bytes):
            yield np.frombuffer(piece, dtype="<f4")
        return
    from hivetrain.diloco.state_wire import read_range

    segments = [memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()) for t in state.params.values()]
    total = sum(len(s) for s in segments)
    for offset in range(0, total, piece_bytes):
        yield np.frombuffer(read_range(segments, offset, min(offset + piece_bytes, total)), dtype="<f4")
