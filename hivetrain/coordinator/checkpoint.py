"""The coordinator's checkpoint store: atomic, verified, pruned snapshots of the shared TrainingState.

Layout under ``root``::

    epoch-000123/state.safetensors   TrainingState.to_flat_dict() (θ and outer momentum, fp32), safetensors format
    epoch-000123/manifest.json       epoch, state_hash, run config, model fingerprint, per-file sha256 and size
    .tmp-epoch-000124-<pid>-<hex>/   a write in progress (or one whose writer died: removed by the next save)
    .lock                            flock held by the one writer

A write is atomic: every file is written under a temporary directory, fsynced, the manifest is written last, the
directory is fsynced and renamed into place, then ``root`` is fsynced. A writer killed at any point (SIGKILL, power
loss) leaves either the complete new checkpoint or none; its temporary directory is swept by the next ``save``.
A directory without a valid manifest is not a checkpoint.

Loading trusts nothing on disk: the newest checkpoint whose manifest parses, whose files match their sha256,
whose safetensors loads (no pickle) and fits the model, and whose recomputed ``state_hash`` equals the manifest's
is returned; every other one is logged with its reason and skipped for the one before it.

Fault hook: ``checkpoint.mid_write`` fires (context ``epoch``, ``path``) after ``state.safetensors`` is written into
the temporary directory and before the manifest exists.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save_file

from hivetrain.diloco.state import MOMENTUM_PREFIX, TrainingState
from hivetrain.faults import NO_FAULTS, FaultInjector

logger = logging.getLogger(__name__)

STATE_FILE = "state.safetensors"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "hivetrain-checkpoint/1"
_DIR_RE = re.compile(r"^epoch-(\d{6,})$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
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


@dataclass(frozen=True)
class CheckpointInfo:
    """One entry of ``CheckpointStore.list()``.

    Attributes:
        epoch: epoch from the directory name.
        path: the checkpoint directory.
        status: "ok", "torn", "tampered" or "incompatible".
        reason: why it is not ok ("" when ok).
        created_at: unix time (s) from the manifest; 0.0 when there is none.
        num_bytes: total size of the files the manifest lists (0 when there is no manifest).
    """

    epoch: int
    path: Path
    status: Status
    reason: str
    created_at: float
    num_bytes: int


class CheckpointStore:
    """Writes and reads verified checkpoints of a TrainingState under one directory.

    One process writes at a time (an flock on ``root/.lock``); any number may read.

    Args:
        root: directory holding the checkpoints; created if missing.
        keep_last: complete checkpoints to keep (>= 1); older ones are deleted after each successful save.
        faults: injector for the ``checkpoint.mid_write`` hook.
        lock_timeout_s: how long ``save`` waits for another writer's lock, seconds.

    Raises:
        ValueError: ``keep_last`` < 1 or ``lock_timeout_s`` <= 0.
    """

    def __init__(
        self,
        root: Path | str,
        keep_last: int,
        faults: FaultInjector = NO_FAULTS,
        lock_timeout_s: float = 30.0,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if lock_timeout_s <= 0:
            raise ValueError(f"lock_timeout_s must be > 0, got {lock_timeout_s}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.faults = faults
        self.lock_timeout_s = lock_timeout_s
        # (dir name, manifest stat, state stat) -> (status, reason): full verification hashes every byte, so
        # list() (polled by the dashboard) reuses it until a file changes.
        self._verified: dict[tuple[Any, ...], tuple[Status, str]] = {}

    # ------------------------------------------------------------------ writing

    def save(self, state: TrainingState, run_config: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
        """Write ``state`` as ``root/epoch-{state.epoch:06d}/`` atomically, then prune.

        Saving an epoch that already has a checkpoint replaces it (the old one is moved aside first, so the
        previous epochs stay loadable throughout).

        Args:
            state: θ and momentum (fp32 CPU) at ``state.epoch``.
            run_config: the run's config as a JSON-serialisable dict (``RunConfig.to_dict()``), stored verbatim.
            extra: JSON-serialisable extras stored in the manifest; ``extra["model_fingerprint"]`` (str) is lifted
                to the manifest's top level.

        Returns:
            The checkpoint directory.

        Raises:
            ValueError: a tensor of ``state`` holds NaN or Inf (a diverged state is not worth resuming from).
            TypeError: ``run_config`` or ``extra`` is not JSON-serialisable.
            TimeoutError: another writer held the lock for ``lock_timeout_s``.
            OSError: the disk write failed (no partial checkpoint becomes visible).
        """
        for name, tensor in state.to_flat_dict().items():
            if not torch.isfinite(tensor).all():
                raise ValueError(f"refusing to checkpoint epoch {state.epoch}: {name} contains NaN or Inf")
        extra = dict(extra or {})
        fingerprint = extra.pop("model_fingerprint", None)
        if fingerprint is not None and not isinstance(fingerprint, str):
            raise TypeError(f"extra['model_fingerprint'] must be a str, got {type(fingerprint).__name__}")
        try:
            json.dumps({"run_config": run_config, "extra": extra}, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"run_config and extra must be JSON-serialisable: {exc}") from None
        self.root.mkdir(parents=True, exist_ok=True)
        with _WriterLock(self.root / ".lock", self.lock_timeout_s):
            self._sweep_temporaries()
            final = self.root / f"epoch-{state.epoch:06d}"
            tmp = self.root / f"{_TMP_PREFIX}{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
            tmp.mkdir()
            try:
                self._write_into(tmp, state, run_config, fingerprint, extra)
                if final.exists():
                    trash = self.root / f"{_TRASH_PREFIX}{final.name}-{secrets.token_hex(4)}"
                    os.rename(final, trash)
                    os.rename(tmp, final)
                    _fsync_dir(self.root)
                    shutil.rmtree(trash, ignore_errors=True)
                else:
                    os.rename(tmp, final)
                    _fsync_dir(self.root)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            self._prune()
        logger.info("checkpoint saved: %s (state_hash %s)", final, state.state_hash()[:16])
        return final

    def _write_into(
        self,
        tmp: Path,
        state: TrainingState,
        run_config: dict[str, Any],
        fingerprint: str | None,
        extra: dict[str, Any],
    ) -> None:
        state_path = tmp / STATE_FILE
        save_file(
            state.to_flat_dict(), str(state_path), metadata={"format": "hivetrain-state", "epoch": str(state.epoch)}
        )
        _fsync_file(state_path)
        self.faults.check("checkpoint.mid_write", epoch=state.epoch, path=str(tmp))
        manifest = {
            "format": MANIFEST_FORMAT,
            "epoch": state.epoch,
            "state_hash": state.state_hash(),
            "param_names": list(state.params),
            "model_fingerprint": fingerprint,
            "run_config": run_config,
            "extra": extra,
            "files": {STATE_FILE: {"sha256": _sha256_file(state_path), "num_bytes": state_path.stat().st_size}},
            "created_at": time.time(),
        }
        manifest_path = tmp / MANIFEST_FILE
        with open(manifest_path, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)

    def _sweep_temporaries(self) -> None:
        """Delete temporary and trash directories. Only called under the writer lock, so none is in use."""
        for entry in self.root.iterdir():
            if entry.is_dir() and entry.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                logger.info("removing stale checkpoint temporary %s", entry)
                shutil.rmtree(entry, ignore_errors=True)

    def _prune(self) -> None:
        """Keep the newest ``keep_last`` complete checkpoints and anything newer; delete the rest."""
        complete = 0
        for epoch, path in self._epoch_dirs():
            if complete >= self.keep_last:
                logger.info("pruning checkpoint %s", path)
                shutil.rmtree(path, ignore_errors=True)
                self._verified = {k: v for k, v in self._verified.items() if k[0] != path.name}
                continue
            try:
                _read_manifest(path, epoch, check_sizes=True)
                complete += 1
            except CheckpointInvalid:
                pass

    # ------------------------------------------------------------------ reading

    def load_latest(self, reference: TrainingState) -> tuple[TrainingState, dict[str, Any]] | None:
        """The newest checkpoint that passes every check, or None when there is none.

        Args:
            reference: a state of the current model (e.g. ``TrainingState.from_model(model)``); names, shapes and
                dtypes of the loaded tensors must match it. Its values are not used.

        Returns:
            (state, manifest) of the newest valid checkpoint; skipped ones are logged at WARNING with the reason.
        """
        for epoch, path in self._epoch_dirs():
            try:
                state, manifest = load_checkpoint(path, reference, expected_epoch=epoch)
            except CheckpointInvalid as exc:
                logger.warning("skipping checkpoint %s: %s", path, exc)
                continue
            return state, manifest
        return None

    def list(self, verify: bool = True) -> list[CheckpointInfo]:
        """Every checkpoint directory, newest first, with its status.

        Args:
            verify: True = full check (sha256 of every file, safetensors parse, recomputed state_hash; cached per
                unchanged files, so polling is cheap); False = manifest and file sizes only (torn detection).
        """
        infos = []
        for epoch, path in self._epoch_dirs():
            created_at, num_bytes = 0.0, 0
            try:
                manifest = _read_manifest(path, epoch, check_sizes=True)
                created_at = float(manifest["created_at"])
                num_bytes = sum(int(f["num_bytes"]) for f in manifest["files"].values())
                status, reason = self._verify_cached(path, epoch) if verify else ("ok", "")
            except CheckpointInvalid as exc:
                status, reason = exc.status, exc.reason
            infos.append(CheckpointInfo(epoch, path, status, reason, created_at, num_bytes))
        return infos

    def _verify_cached(self, path: Path, epoch: int) -> tuple[Status, str]:
        key = (path.name, *(_stat_key(path / name) for name in (MANIFEST_FILE, STATE_FILE)))
        if key not in self._verified:
            try:
                verify_checkpoint(path, expected_epoch=epoch)
                self._verified[key] = ("ok", "")
            except CheckpointInvalid as exc:
                self._verified[key] = (exc.status, exc.reason)
        return self._verified[key]

    def _epoch_dirs(self) -> list[tuple[int, Path]]:
        """(epoch, dir) of every ``epoch-N`` directory, newest first."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _DIR_RE.match(entry.name)
            if match and entry.is_dir():
                found.append((int(match.group(1)), entry))
        return sorted(found, key=lambda item: item[0], reverse=True)


# ---------------------------------------------------------------------- verification (pure reads)


def verify_checkpoint(path: Path, expected_epoch: int | None = None) -> dict[str, Any]:
    """Fully check one checkpoint directory without a reference model; returns its manifest.

    Raises:
        CheckpointInvalid: with status "torn" or "tampered" and the reason.
    """
    manifest = _read_manifest(path, expected_epoch, check_sizes=True)
    flat = _load_verified_tensors(path, manifest)
    names = manifest["param_names"]
    try:
        state = TrainingState(
            epoch=manifest["epoch"],
            params={n: flat.pop(n) for n in names},
            momentum={n: flat.pop(MOMENTUM_PREFIX + n) for n in names},
        )
    except (KeyError, ValueError) as exc:
        raise CheckpointInvalid("tampered", f"tensors do not form a training state: {exc}") from None
    if flat:
        raise CheckpointInvalid("tampered", f"unexpected tensors {sorted(flat)[:3]}")
    _check_hash(state, manifest)
    return manifest


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
    manifest = _read_manifest(path, expected_epoch, check_sizes=True)
    flat = _load_verified_tensors(path, manifest)
    if manifest["param_names"] != list(reference.params):
        raise CheckpointInvalid("incompatible", "parameter names differ from the current model")
    try:
        state = TrainingState.from_flat_dict(flat, epoch=manifest["epoch"], reference=reference)
    except ValueError as exc:
        raise CheckpointInvalid("incompatible", str(exc)) from None
    _check_hash(state, manifest)
    return state, manifest


def _read_manifest(path: Path, expected_epoch: int | None, check_sizes: bool) -> dict[str, Any]:
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


# ---------------------------------------------------------------------- filesystem helpers


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK_BYTES):
                digest.update(chunk)
    except FileNotFoundError:
        raise CheckpointInvalid("torn", f"{path.name} is missing") from None
    return digest.hexdigest()


def _stat_key(path: Path) -> tuple[int, int, int]:
    try:
        st = path.stat()
    except FileNotFoundError:
        return (0, 0, 0)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _WriterLock:
    """An exclusive flock on ``path``, waited for at most ``timeout_s``; released when the holder dies."""

    def __init__(self, path: Path, timeout_s: float, poll_interval_s: float = 0.05) -> None:
        self.path, self.timeout_s, self.poll_interval_s = path, timeout_s, poll_interval_s
        self._fd = -1

    def __enter__(self) -> _WriterLock:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() >= deadline:
                    os.close(self._fd)
                    if exc.errno in (errno.EAGAIN, errno.EACCES):
                        raise TimeoutError(f"checkpoint lock {self.path} held for over {self.timeout_s} s") from None
                    raise
                time.sleep(self.poll_interval_s)

    def __exit__(self, *exc_info: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
