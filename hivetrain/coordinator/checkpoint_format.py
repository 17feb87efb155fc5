"""The on-disk format of a checkpoint and its verification (pure reads): the manifest schema, the sha256 of every
file, the safetensors load (no pickle) and the recomputed ``state_hash``; plus the fsync helpers the writer uses.
``checkpoint.CheckpointStore`` writes, lists and prunes directories in this format.

Layout of one ``epoch-N`` directory::

    state.safetensors   TrainingState.to_flat_dict() (θ and outer momentum, fp32)
    manifest.json       format, epoch, state_hash, param_names, created_at, run config, model fingerprint, and
                        {"files": {"state.safetensors": {"sha256", "num_bytes"}}}
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors

from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_file import StateFile, StateFileInvalid, copy_state_file, state_hash_of_file

STATE_FILE = "state.safetensors"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "hivetrain-checkpoint/1"
_HASH_CHUNK_BYTES = 8 * 2**20

Status = Literal["ok", "torn", "tampered", "incompatible"]


class CheckpointInvalid(Exception):
    """A checkpoint directory failed verification.

    Attributes:
        status: "torn" (incomplete: missing/short file, missing or unparsable manifest), "tampered" (complete but
            its bytes or hashes disagree), or "incompatible" (valid but for another model).
        reason: human-readable cause.
    """

    def __init__(self, status: Status, reason: str):
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason


def verify_checkpoint(path: Path, expected_epoch: int | None = None) -> dict[str, Any]:
    """Fully check one checkpoint directory without a reference model, one piece of the state at a time (a 7B run's
    checkpoint is 56 GB: the dashboard lists them on a small machine); returns its manifest.

    Raises:
        CheckpointInvalid: with status "torn" or "tampered" and the reason.
    """
    manifest = read_manifest(path, expected_epoch, check_sizes=True)
    _check_file_sha256(path, manifest)
    try:
        actual, finite = state_hash_of_file(path / STATE_FILE, manifest["param_names"], manifest["epoch"])
    except StateFileInvalid as exc:
        raise CheckpointInvalid("tampered", f"tensors do not form a training state: {exc.reason}") from None
    except OSError as exc:
        raise CheckpointInvalid("torn", f"cannot read {STATE_FILE}: {exc.strerror or exc}") from None
    if not finite:
        raise CheckpointInvalid("tampered", f"{STATE_FILE} holds NaN or Inf")
    if actual != manifest["state_hash"]:
        raise CheckpointInvalid("tampered", f"state_hash {actual[:12]}… != manifest {manifest['state_hash'][:12]}…")
    return manifest


def load_checkpoint_file(
    path: Path, reference: TrainingState, dst: Path, expected_epoch: int | None = None
) -> tuple[StateFile, dict[str, Any]]:
    """Load and fully check one checkpoint directory into a state file at ``dst`` (``state_file``), never holding
    more than a piece of the state in memory: ``load_checkpoint`` for a state larger than memory.

    Args:
        path: an ``epoch-N`` directory.
        reference: names and shapes of the current model (``state_file.meta_reference``: no memory).
        dst: the state file to write (removed again if the checkpoint fails a check).
        expected_epoch: the epoch the directory name promises, if any.

    Returns:
        (state file, manifest).

    Raises:
        CheckpointInvalid: "torn", "tampered" or "incompatible" with the reason.
        OSError: ``dst`` could not be written (a full disk).
    """
    manifest = read_manifest(path, expected_epoch, check_sizes=True)
    if manifest["param_names"] != list(reference.params):
        raise CheckpointInvalid("incompatible", "parameter names differ from the current model")
    _check_file_sha256(path, manifest)
    try:
        state = copy_state_file(path / STATE_FILE, reference, manifest["epoch"], dst)
    except StateFileInvalid as exc:
        raise CheckpointInvalid("incompatible" if exc.other_model else "tampered", exc.reason) from None
    if state.state_hash() != manifest["state_hash"]:
        state.close()
        dst.unlink(missing_ok=True)
        actual = state.state_hash()
        raise CheckpointInvalid("tampered", f"state_hash {actual[:12]}… != manifest {manifest['state_hash'][:12]}…")
    return state, manifest


def _check_file_sha256(path: Path, manifest: dict[str, Any]) -> None:
    expected = manifest["files"][STATE_FILE]["sha256"]
    actual = sha256_file(path / STATE_FILE)
    if actual != expected:
        raise CheckpointInvalid("tampered", f"{STATE_FILE} sha256 {actual[:12]}… != manifest {expected[:12]}…")


def load_checkpoint(
    path: Path, reference: TrainingState, expected_epoch: int | None = None
) -> tuple[TrainingState, dict[str, Any]]:
    """Load and fully check one checkpoint directory against the current model.

    Args:
        path: an ``epoch-N`` directory.
        reference: a state of the current model (names, shapes, dtypes are compared; values unused).
        expected_epoch: the epoch the directory name promises, if any.

    Returns:
        (state, manifest); state tensors are fp32, contiguous, on the CPU.

    Raises:
        CheckpointInvalid: "torn", "tampered" or "incompatible" with the reason.
    """
    manifest = read_manifest(path, expected_epoch, check_sizes=True)
    flat = _load_verified_tensors(path, manifest)
    if manifest["param_names"] != list(reference.params):
        raise CheckpointInvalid("incompatible", "parameter names differ from the current model")
    try:
        state = TrainingState.from_flat_dict(flat, epoch=manifest["epoch"], reference=reference)
    except ValueError as exc:
        raise CheckpointInvalid("incompatible", str(exc)) from None
    _check_hash(state, manifest)
    return state, manifest


def read_manifest(path: Path, expected_epoch: int | None, check_sizes: bool) -> dict[str, Any]:
    manifest_path = path / MANIFEST_FILE
    try:
        raw = manifest_path.read_bytes()
    except FileNotFoundError:
        raise CheckpointInvalid("torn", "no manifest.json (write never finished)") from None
    except OSError as exc:
        raise CheckpointInvalid("torn", f"cannot read manifest.json: {exc}") from None
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointInvalid("torn", f"manifest.json does not parse: {exc}") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise CheckpointInvalid("tampered", f"manifest.json: {problem}")
    if expected_epoch is not None and manifest["epoch"] != expected_epoch:
        raise CheckpointInvalid("tampered", f"manifest epoch {manifest['epoch']} != directory epoch {expected_epoch}")
    if check_sizes:
        for name, entry in manifest["files"].items():
            try:
                size = (path / name).stat().st_size
            except FileNotFoundError:
                raise CheckpointInvalid("torn", f"{name} is missing") from None
            if size < entry["num_bytes"]:
                raise CheckpointInvalid("torn", f"{name} is truncated: {size} of {entry['num_bytes']} bytes")
            if size > entry["num_bytes"]:
                raise CheckpointInvalid("tampered", f"{name} has {size} bytes, manifest says {entry['num_bytes']}")
    return manifest


def _manifest_problem(manifest: Any) -> str:
    """What is wrong with a parsed manifest's structure ("" if nothing)."""
    if not isinstance(manifest, dict):
        return "not an object"
    if manifest.get("format") != MANIFEST_FORMAT:
        return f"unknown format {manifest.get('format')!r}"
    epoch = manifest.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        return f"bad epoch {epoch!r}"
    if not isinstance(manifest.get("state_hash"), str) or not re.fullmatch(r"[0-9a-f]{64}", manifest["state_hash"]):
        return "bad state_hash"
    names = manifest.get("param_names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        return "bad param_names"
    if not isinstance(manifest.get("created_at"), (int, float)):
        return "bad created_at"
    files = manifest.get("files")
    if not isinstance(files, dict) or set(files) != {STATE_FILE}:
        return f"files must list exactly {STATE_FILE}"
    entry = files[STATE_FILE]
    if not (
        isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and isinstance(entry.get("num_bytes"), int)
    ):
        return f"bad entry for {STATE_FILE}"
    return ""


def _load_verified_tensors(path: Path, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The state file's tensors, hashed and parsed from one in-memory read.

    Reading once into memory (not ``safetensors.load_file``, which maps the file) means the bytes that are hashed
    are the bytes that are parsed, and a file truncated or rewritten later cannot crash this process (SIGBUS on a
    mapped page) or change the loaded tensors. Peak memory is twice the state size.
    """
    entry = manifest["files"][STATE_FILE]
    try:
        data = (path / STATE_FILE).read_bytes()
    except FileNotFoundError:
        raise CheckpointInvalid("torn", f"{STATE_FILE} is missing") from None
    if len(data) != entry["num_bytes"]:
        status: Status = "torn" if len(data) < entry["num_bytes"] else "tampered"
        raise CheckpointInvalid(status, f"{STATE_FILE} has {len(data)} bytes, manifest says {entry['num_bytes']}")
    actual = hashlib.sha256(data).hexdigest()
    if actual != entry["sha256"]:
        raise CheckpointInvalid("tampered", f"{STATE_FILE} sha256 {actual[:12]}… != manifest {entry['sha256'][:12]}…")
    try:
        return load_tensors(data)
    except (SafetensorError, ValueError) as exc:
        raise CheckpointInvalid("tampered", f"{STATE_FILE} does not load: {exc}") from None


def _check_hash(state: TrainingState, manifest: dict[str, Any]) -> None:
    actual = state.state_hash()
    if actual != manifest["state_hash"]:
        raise CheckpointInvalid("tampered", f"state_hash {actual[:12]}… != manifest {manifest['state_hash'][:12]}…")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK_BYTES):
                digest.update(chunk)
    except FileNotFoundError:
        raise CheckpointInvalid("torn", f"{path.name} is missing") from None
    return digest.hexdigest()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
