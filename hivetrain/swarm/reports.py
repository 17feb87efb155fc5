"""What pipeline peers report for the coordinator's dashboard: trainers' counters and servers' rebalances.

Two signed, expiring record types, each under its own DHT key with the owner marker as the subkey (as
``StageRecord``): hivemind's ``RSASignatureValidator`` signs them, readers check that ``peer_id`` is the signer
(``peers.records.parse_signed``), and honest nodes' ``RecordGuard`` bounds their size, schema, timestamps and
expiry (``peers/validators.py``, kinds "trainer_report" and "rebalance_report").

* ``TrainerReport`` under ``"{run_id}.swarm.trainer_reports"``: a pipeline trainer's counters since it started
  (microbatches, reroutes, replays, servers declared dead) and its last failure reasons;
* ``RebalanceReport`` under ``"{run_id}.swarm.rebalances"``: a stage server's moves (from, to, when, why) and the
  reason of its last rebalance decision, moved or not.

Why new keys rather than new fields of ``StageRecord`` / ``PeerRecord``: those schemas forbid unknown fields, so
peers on older code would drop every record carrying a new field, and a mixed-version swarm would lose the new
servers from routing and stall. Older code never reads these keys, and an older node's ``RecordGuard`` leaves keys
it was not told about alone (they pass hivemind's signature check only), so it stores and serves them unchanged.
These two schemas ignore unknown fields (``extra="ignore"``, still size-capped by the guard) so that a later
version can add a field without the same problem. They are display-only: nothing routes or trains on them, and
the coordinator credits their numbers only within bounds (``coordinator/pipeline.py``).

Units: seconds of unix time, counts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Annotated

import hivemind
from hivemind.utils import get_dht_time
from pydantic import BaseModel, ConfigDict, Field

from hivetrain.peers.records import fetch_signed_records

logger = logging.getLogger(__name__)

MAX_REASON_CHARS = 300
MAX_REASONS = 4
MAX_MOVES = 4

Reason = Annotated[str, Field(max_length=MAX_REASON_CHARS)]


def trainer_reports_key(run_id: str) -> str:
    return f"{run_id}.swarm.trainer_reports"


def rebalances_key(run_id: str) -> str:
    return f"{run_id}.swarm.rebalances"


class TrainerReport(BaseModel):
    """A pipeline trainer's counters since ``started_at`` (a restarted trainer starts again from 0).

    Attributes:
        started_at: unix time (s) the trainer started counting; a new value marks a restart.
        steps: trainer steps completed.
        microbatches: microbatches forwarded and backpropagated through every stage.
        reroutes: calls sent again to another server after a failure, an expired reply or a ban.
        replays: gradients sent again because the server that held them lost them (died, phase abandoned).
        deaths: servers this trainer declared dead.
        last_reasons: the newest ban / death reasons, newest last (at most ``MAX_REASONS``).
        left_reason: "" while training; set in the last report of a trainer that stopped ("finished", ...).
        updated_at: unix time (s) of this report.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    peer_id: str = Field(min_length=1, max_length=128)
    run_id: str = Field(max_length=64)
    model_fingerprint: str = Field(max_length=64)
    started_at: float = Field(ge=0.0)
    steps: int = Field(default=0, ge=0)
    microbatches: int = Field(default=0, ge=0)
    reroutes: int = Field(default=0, ge=0)
    replays: int = Field(default=0, ge=0)
    deaths: int = Field(default=0, ge=0)
    last_reasons: tuple[Reason, ...] = Field(default=(), max_length=MAX_REASONS)
    left_reason: str = Field(default="", max_length=200)
    updated_at: float = Field(ge=0.0)


class Move(BaseModel):
    """One rebalancing move of a stage server: ``from_stage`` -> ``to_stage`` at unix time ``at`` (s), and why."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    at: float = Field(ge=0.0)
    from_stage: int = Field(ge=0, le=1024)
    to_stage: int = Field(ge=0, le=1024)
    reason: Reason = ""


class RebalanceReport(BaseModel):
    """A stage server's rebalancing since ``started_at``.

    Attributes:
        stage: the stage it serves now.
        started_at: unix time (s) the server started; a new value marks a restart (``rebalances`` from 0).
        rebalances: moves since it started.
        moves: the newest moves, oldest first (at most ``MAX_MOVES``).
        last_decision: the reason ``rebalance.decide_move`` gave at its last check, moved or not ("" = none yet).
        last_decision_at: unix time (s) of that check (0 = none yet).
        updated_at: unix time (s) of this report.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    peer_id: str = Field(min_length=1, max_length=128)
    run_id: str = Field(max_length=64)
    model_fingerprint: str = Field(max_length=64)
    stage: int = Field(ge=0, le=1024)
    started_at: float = Field(ge=0.0)
    rebalances: int = Field(default=0, ge=0)
    moves: tuple[Move, ...] = Field(default=(), max_length=MAX_MOVES)
    last_decision: Reason = ""
    last_decision_at: float = Field(default=0.0, ge=0.0)
    updated_at: float = Field(ge=0.0)


def clip_reason(text: str) -> str:
    """``text`` cut to ``MAX_REASON_CHARS`` (what the schema accepts)."""
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 1] + "…"


def publish_report(
    dht: hivemind.DHT, owner_marker: bytes, report: TrainerReport | RebalanceReport, ttl_s: float
) -> bool:
    """Store (or refresh) our signed report for ``ttl_s`` seconds. Returns whether any DHT node accepted it."""
    key = trainer_reports_key if isinstance(report, TrainerReport) else rebalances_key
    expiration = get_dht_time() + ttl_s
    return bool(dht.store(key(report.run_id), report.model_dump(mode="json"), expiration, subkey=owner_marker))


def fetch_trainer_reports(dht: hivemind.DHT, run_id: str) -> list[TrainerReport]:
    """Valid, unexpired trainer reports of the run, sorted by peer ID (malformed or forged ones dropped)."""
    return fetch_signed_records(dht, trainer_reports_key(run_id), TrainerReport, run_id)


def fetch_rebalance_reports(dht: hivemind.DHT, run_id: str) -> list[RebalanceReport]:
    """Valid, unexpired rebalance reports of the run, sorted by peer ID (malformed or forged ones dropped)."""
    return fetch_signed_records(dht, rebalances_key(run_id), RebalanceReport, run_id)


class Reporter:
    """Publishes ``make_report()`` every ``interval_s`` seconds from a daemon thread until ``stop(final)``.

    Args:
        dht, owner_marker: where and as whom to publish.
        make_report: builds the current report (called from the reporter's thread; must be thread-safe).
        interval_s: seconds between publications; ``ttl_s``: each one's lifetime (> ``interval_s``).
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        owner_marker: bytes,
        make_report: Callable[[], TrainerReport | RebalanceReport],
        interval_s: float,
        ttl_s: float,
    ):
        if not 0 < interval_s < ttl_s:
            raise ValueError(f"need 0 < interval_s ({interval_s}) < ttl_s ({ttl_s})")
        self.dht, self.owner_marker, self.make_report = dht, owner_marker, make_report
        self.interval_s, self.ttl_s = interval_s, ttl_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pipeline-reporter", daemon=True)

    def start(self) -> None:
        self.publish()
        self._thread.start()

    def publish(self, report: TrainerReport | RebalanceReport | None = None) -> bool:
        """Publish ``report`` (default: ``make_report()``) now; False (logged) if it could not be published."""
        try:
            return publish_report(self.dht, self.owner_marker, report or self.make_report(), self.ttl_s)
        except Exception as exc:  # noqa: BLE001 - a report is display-only: never let it stop training
            logger.warning("could not publish the pipeline report: %r", exc)
            return False

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.publish()

    def stop(
        self, final: TrainerReport | RebalanceReport | None = None, final_ttl_s: float = 0.0, timeout_s: float = 5.0
    ) -> None:
        """Stop publishing; publish ``final`` (e.g. with ``left_reason`` set) once more if given, to live
        ``max(ttl_s, final_ttl_s)`` seconds (long enough for a coordinator polling less often to read it)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if final is not None:
            try:
                publish_report(self.dht, self.owner_marker, final, max(self.ttl_s, final_ttl_s))
            except Exception as exc:  # noqa: BLE001 - display-only, as in publish()
                logger.warning("could not publish the final pipeline report: %r", exc)
