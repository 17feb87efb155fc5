"""When the run began: the anchor of the run-age bound (issue 12, item 1; ``peers.quorum.max_plausible_epoch``).

A run's epochs cannot come faster than one per ``QuorumConfig.min_epoch_s``, so a record claiming an epoch further
ahead than the run's age allows is a lie: no honest peer adopts it and its sender is banned (``sync_policy``). The
coordinator publishes the start in its signed run config record (``RunConfigRecord.run_started_at``) and every
trainer that trusts that coordinator applies the bound.

The start must never move later, or honest epochs would look implausible. So the coordinator takes the earliest of:
the value it saved before (``run_clock.json`` in its checkpoint directory, or next to its identity file), the value
in its own run config record still stored in the DHT (a restart without its files), and now; and it moves the start
earlier whenever the state it follows (quorum-backed) is further ahead than the start allows (a fresh coordinator
joining a running swarm). Without a coordinator, or before its config is read, trainers apply no run-age bound: the
quorum rule alone keeps a lone claim from being adopted.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

RUN_CLOCK_FILE = "run_clock.json"


def earliest_start(candidates: Iterable[float | None], now: float, max_clock_skew_s: float) -> float:
    """The run's start (DHT time, seconds): the earliest plausible candidate, or ``now`` if none is. A candidate is
    plausible when finite, positive and at most ``max_clock_skew_s`` ahead of ``now``."""
    valid = [c for c in candidates if c is not None and math.isfinite(c) and 0 < c <= now + max_clock_skew_s]
    return min([*valid, now])


def start_for_epoch(run_started_at: float, epoch: int, now: float, min_epoch_s: float) -> float:
    """``run_started_at`` moved earlier if needed so that ``epoch`` (a quorum-backed epoch seen at ``now``) is
    within the run-age bound: at most ``now - epoch * min_epoch_s``."""
    return min(run_started_at, now - epoch * min_epoch_s)


def load_start(path: Path, run_id: str) -> float | None:
    """The start saved at ``path`` for ``run_id``; None if there is none, it is another run's, or it is unreadable
    (logged: a corrupt file loses nothing, the DHT copy and now remain)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("ignoring the run clock %s: %s (delete it if it is damaged)", path, exc)
        return None
    if not isinstance(data, dict) or data.get("run_id") != run_id:
        return None
    value = data.get("run_started_at")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def save_start(path: Path, run_id: str, run_started_at: float) -> None:
    """Write the start atomically (temp file, fsync, rename). OSError is logged, not raised: the DHT keeps a copy."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            json.dump({"run_id": run_id, "run_started_at": run_started_at}, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except OSError as exc:
        logger.warning("could not save the run clock to %s: %s", path, exc)
