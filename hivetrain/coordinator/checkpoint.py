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

The format and its verification live in ``checkpoint_format`` (re-exported here).

Fault hook: ``checkpoint.mid_write`` fires (context ``epoch``, ``path``) after ``state.safetensors`` is written into
the temporary directory and before the manifest exists.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hivetrain.coordinator.checkpoint_format import (
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    STATE_FILE,
    CheckpointInvalid,
    Status,
    fsync_dir,
    fsync_file,
    load_checkpoint,
    load_checkpoint_file,
    read_manifest,
    sha256_file,
    verify_checkpoint,
)
from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_file import StateFile
from hivetrain.faults import NO_FAULTS, FaultInjector, HookPoint

__all__ = [
    "MANIFEST_FILE",
    "STATE_FILE",
    "CheckpointInfo",
    "CheckpointInvalid",
    "CheckpointStore",
    "load_checkpoint",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)

_DIR_RE = re.compile(r"^epoch-(\d{6,})$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
PROTECT_FILE = "protected.json"  # {"epoch": N, "reason": ..., "at": unix s}: the checkpoint pruning never deletes


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

    def save(
        self, state: TrainingState | StateFile, run_config: dict[str, Any], extra: dict[str, Any] | None = None
    ) -> Path:
        """Write ``state`` as ``root/epoch-{state.epoch:06d}/`` atomically, then prune.

        Saving an epoch that already has a checkpoint replaces it (the old one is moved aside first, so the
        previous epochs stay loadable throughout).

        Args:
            state: θ and momentum (fp32 CPU) at ``state.epoch``, in memory, or on disk (``state_file.StateFile``,
                checked finite when it was made): its file becomes the checkpoint's state file, hard-linked when it
                is on the same file system (no byte copied), else copied a piece at a time.
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
        for name, tensor in state.to_flat_dict().items() if isinstance(state, TrainingState) else ():
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
                    fsync_dir(self.root)
                    shutil.rmtree(trash, ignore_errors=True)
                else:
                    os.rename(tmp, final)
                    fsync_dir(self.root)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            self._prune()
        logger.info("checkpoint saved: %s (state_hash %s)", final, state.state_hash()[:16])
        return final

    def _write_into(
        self,
        tmp: Path,
        state: TrainingState | StateFile,
        run_config: dict[str, Any],
        fingerprint: str | None,
        extra: dict[str, Any],
    ) -> None:
        state_path = tmp / STATE_FILE
        if isinstance(state, StateFile):
            _place_state_file(state, state_path)
            names = list(state.reference.params)
        else:
            save_file(
                state.to_flat_dict(), str(state_path), metadata={"format": "hivetrain-state", "epoch": str(state.epoch)}
            )
            names = list(state.params)
        fsync_file(state_path)
        self.faults.check(HookPoint.CHECKPOINT_MID_WRITE, epoch=state.epoch, path=str(tmp))
        manifest = {
            "format": MANIFEST_FORMAT,
            "epoch": state.epoch,
            "state_hash": state.state_hash(),
            "param_names": names,
            "model_fingerprint": fingerprint,
            "run_config": run_config,
            "extra": extra,
            "files": {STATE_FILE: {"sha256": sha256_file(state_path), "num_bytes": state_path.stat().st_size}},
            "created_at": time.time(),
        }
        manifest_path = tmp / MANIFEST_FILE
        with open(manifest_path, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)

    def protect(self, epoch: int, reason: str) -> None:
        """Keep the checkpoint of ``epoch`` whatever ``keep_last`` says, until another is protected (one at a time):
        the last state from before an adoption the coordinator could not check, so an operator can go back to it
        if that state turns out poisoned (issue 28). Written atomically under the writer lock.

        Raises:
            ValueError: no complete checkpoint of ``epoch``.
            TimeoutError: another writer held the lock for ``lock_timeout_s``.
        """
        path = self.root / f"epoch-{epoch:06d}"
        try:
            read_manifest(path, epoch, check_sizes=True)
        except CheckpointInvalid as exc:
            raise ValueError(f"cannot protect epoch {epoch}: {exc.reason}") from None
        with _WriterLock(self.root / ".lock", self.lock_timeout_s):
            tmp = self.root / f".{PROTECT_FILE}.{secrets.token_hex(4)}"
            tmp.write_text(json.dumps({"epoch": epoch, "reason": reason[:500], "at": time.time()}))
            os.replace(tmp, self.root / PROTECT_FILE)
            fsync_dir(self.root)
        logger.warning("checkpoint of epoch %d is kept until further notice: %s", epoch, reason)

    def protected(self) -> tuple[int, str] | None:
        """(epoch, reason) of the protected checkpoint, or None (none, or an unreadable marker)."""
        try:
            raw = json.loads((self.root / PROTECT_FILE).read_text())
            return int(raw["epoch"]), str(raw.get("reason", ""))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _sweep_temporaries(self) -> None:
        """Delete temporary and trash directories. Only called under the writer lock, so none is in use."""
        for entry in self.root.iterdir():
            if entry.is_dir() and entry.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                logger.info("removing stale checkpoint temporary %s", entry)
                shutil.rmtree(entry, ignore_errors=True)

    def _prune(self) -> None:
        """Keep the newest ``keep_last`` complete checkpoints, anything newer and the ``protect``-ed one; delete the
        rest."""
        complete, kept = 0, self.protected()
        for epoch, path in self._epoch_dirs():
            if kept is not None and epoch == kept[0]:
                continue
            if complete >= self.keep_last:
                logger.info("pruning checkpoint %s", path)
                shutil.rmtree(path, ignore_errors=True)
                self._verified = {k: v for k, v in self._verified.items() if k[0] != path.name}
                continue
            try:
                read_manifest(path, epoch, check_sizes=True)
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

    def load_latest_file(self, reference: TrainingState, dst: Path) -> tuple[StateFile, dict[str, Any]] | None:
        """``load_latest`` into a state file at ``dst`` (``checkpoint_format.load_checkpoint_file``): the newest
        checkpoint that passes every check, never more than a piece of it in memory; None when there is none.

        Raises:
            OSError: ``dst`` could not be written (a full disk).
        """
        for epoch, path in self._epoch_dirs():
            try:
                return load_checkpoint_file(path, reference, dst, expected_epoch=epoch)
            except CheckpointInvalid as exc:
                logger.warning("skipping checkpoint %s: %s", path, exc)
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
                manifest = read_manifest(path, epoch, check_sizes=True)
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


# ---------------------------------------------------------------------- filesystem helpers


def _place_state_file(state: StateFile, dst: Path) -> None:
    """Make ``dst`` hold ``state``'s file: a hard link to it if its path still names the same file on this file
    system, else a copy read through its open descriptor, a piece at a time."""
    try:
        stat = os.stat(state.path)
        if (stat.st_dev, stat.st_ino) == state.inode:
            os.link(state.path, dst)
            return
    except OSError:
        pass  # unlinked, replaced, or another file system: copy
    with open(dst, "wb") as out:
        out.write(state.header_bytes())
        for piece in state.pieces(0, state.num_bytes()):
            out.write(piece)
        out.flush()
        os.fsync(out.fileno())


def _stat_key(path: Path) -> tuple[int, int, int]:
    try:
        st = path.stat()
    except FileNotFoundError:
        return (0, 0, 0)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


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
