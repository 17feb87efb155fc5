"""What the coordinator's dashboard shows: one immutable ``DashboardSnapshot`` per refresh.

The coordinator builds a snapshot from its own state (copied under its locks: building one must not block) and
hands the dashboard a ``snapshot_fn`` returning the latest. Everything here is public: the run's config is shown
only through ``summarize_config``, which drops secret-looking keys and values, and every volunteer-supplied string
(public names, reasons) is length-capped and control-character-free here and HTML-escaped when rendered.

Times are unix seconds (``time.time()``) unless the name says ``_ago``; durations are seconds.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hivetrain.coordinator.web.pipeline_view import PipelineView

MAX_NAME_CHARS = 48
MAX_TEXT_CHARS = 200
MAX_VALUE_CHARS = 80

# Keys and values that must never reach a public page, whatever the coordinator passes in.
_SECRET_KEY_RE = re.compile(
    r"secret|passw|private|credential|auth|identity|signing|cookie|session|mnemonic|api.?key|"
    r"token(?!s_per|izer)|(^|[._-])(key|keys|pem)($|[._-])",
    re.IGNORECASE,
)
_SECRET_VALUE_RE = re.compile(r"-----BEGIN|PRIVATE KEY|^[A-Za-z0-9+/=_-]{40,}$")
# Local filesystem details of the coordinator are nobody's business either.
_PRIVATE_KEYS = {"data.paths", "data.tokenizer"}
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069]")


def clean_text(value: object, max_chars: int = MAX_TEXT_CHARS) -> str:
    """``str(value)`` without control/bidi characters, capped at ``max_chars`` (an ellipsis marks the cut)."""
    text = _CONTROL_RE.sub("", str(value)).strip()
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


def is_secret(key: str, value: object) -> bool:
    """True when a config entry looks like a credential (by its dotted key or its value)."""
    return bool(_SECRET_KEY_RE.search(key)) or bool(_SECRET_VALUE_RE.search(str(value)))


def summarize_config(raw: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """Flatten a (nested) run config into public ``(dotted key, value)`` pairs for the dashboard.

    Secret-looking entries (keys such as ``*secret*``, ``*private*``, ``*.key``, ``*token*``; PEM blocks or long
    opaque strings as values) and the coordinator's local paths (``data.paths``, ``data.tokenizer``) are dropped;
    values are capped at ``MAX_VALUE_CHARS``.

    Args:
        raw: e.g. ``RunConfig.to_dict()``; any mapping of str -> scalar / list / mapping.

    Returns:
        Sorted pairs, safe to publish.
    """
    pairs: list[tuple[str, str]] = []

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else str(key), value)
            return
        if prefix in _PRIVATE_KEYS or is_secret(prefix, node):
            return
        if isinstance(node, (list, tuple)):
            if any(isinstance(v, Mapping) or is_secret(prefix, v) for v in node):
                return
            node = ", ".join(str(v) for v in node)
        pairs.append((clean_text(prefix, MAX_VALUE_CHARS), clean_text(node, MAX_VALUE_CHARS)))

    walk("", raw)
    return tuple(sorted(pairs))


def _non_negative(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"{type(owner).__name__}.{name} must be a number, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{type(owner).__name__}.{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class RunInfo:
    """The run being trained.

    Attributes:
        run_id: the run's DHT name.
        model_preset: "tiny", "small", "base", ...
        num_parameters: trainable scalars of the model.
        config_summary: public ``(key, value)`` pairs; pass ``summarize_config(run_config.to_dict())``. Pairs that
            look secret are dropped here again, whatever is passed.
        started_at: unix time (s) the coordinator started; 0 = unknown.
    """

    run_id: str
    model_preset: str
    num_parameters: int
    config_summary: tuple[tuple[str, str], ...] = ()
    started_at: float = 0.0

    def __post_init__(self) -> None:
        _non_negative(self, "num_parameters", "started_at")
        summary = tuple(
            (clean_text(k, MAX_VALUE_CHARS), clean_text(v, MAX_VALUE_CHARS))
            for k, v in self.config_summary
            if k not in _PRIVATE_KEYS and not is_secret(str(k), v)
        )
        object.__setattr__(self, "config_summary", summary)
        object.__setattr__(self, "run_id", clean_text(self.run_id, MAX_NAME_CHARS))
        object.__setattr__(self, "model_preset", clean_text(self.model_preset, MAX_NAME_CHARS))


@dataclass(frozen=True)
class LossPoint:
    """One evaluation: ``eval_loss`` in nats/token on the shared eval windows (may be NaN/Inf if training diverged)."""

    wall_time_s: float
    epoch: int
    eval_loss: float


@dataclass(frozen=True)
class DriftPoint:
    """How far peers' θ had drifted apart at one epoch: ``drift`` = max_p ‖θ_p − θ̄‖/‖θ̄‖ estimated from the sketches
    of ``num_peers`` peers (``diloco/drift.py``); 0.0 when they hold the same θ (butterfly averaging)."""

    epoch: int
    drift: float
    num_peers: int

    def __post_init__(self) -> None:
        _non_negative(self, "epoch", "drift", "num_peers")


@dataclass(frozen=True)
class PeerRow:
    """A peer as the coordinator last saw it.

    Attributes:
        peer_id: base58 libp2p peer id.
        role: "trainer", "stage", "coordinator", ...
        stage: SWARM pipeline stage index, None for data-parallel peers.
        throughput_samples_per_s: samples per second it reported.
        epoch: the epoch it is at.
        last_seen_s_ago: seconds since its last record.
        reachability: "direct", "relayed", "unreachable" or "unknown".
        public_name: the volunteer's chosen display name ("" = anonymous); sanitised, at most 48 characters.
    """

    peer_id: str
    role: str
    stage: int | None
    throughput_samples_per_s: float
    epoch: int
    last_seen_s_ago: float
    reachability: str = "unknown"
    public_name: str = ""

    def __post_init__(self) -> None:
        _non_negative(self, "throughput_samples_per_s", "epoch", "last_seen_s_ago")
        for name in ("peer_id", "role", "reachability", "public_name"):
            object.__setattr__(self, name, clean_text(getattr(self, name), MAX_NAME_CHARS if name != "peer_id" else 80))


@dataclass(frozen=True)
class LeftPeerRow:
    """A peer that left the run (newest first on the page).

    Attributes:
        peer_id: base58 libp2p peer id.
        role: "trainer", "stage_server", ...
        public_name: the volunteer's display name ("" = anonymous); sanitised, at most 48 characters.
        epoch: the last epoch its record showed.
        last_seen_at: unix time (s) of its last record.
        reason: why it left: its last record's ``left_reason`` ("finished", "interrupted", "lost the DHT: ...")
            or "record expired" when it vanished without saying; sanitised, at most 200 characters.
    """

    peer_id: str
    role: str
    public_name: str
    epoch: int
    last_seen_at: float
    reason: str

    def __post_init__(self) -> None:
        _non_negative(self, "epoch", "last_seen_at")
        object.__setattr__(self, "peer_id", clean_text(self.peer_id, 80))
        for name in ("role", "public_name"):
            object.__setattr__(self, name, clean_text(getattr(self, name), MAX_NAME_CHARS))
        object.__setattr__(self, "reason", clean_text(self.reason))


@dataclass(frozen=True)
class RoundRow:
    """One averaging round: ``committed`` False means it failed and ``reason`` says why."""

    epoch: int
    group_size: int
    duration_s: float
    committed: bool
    reason: str = ""
    finished_at: float = 0.0

    def __post_init__(self) -> None:
        _non_negative(self, "epoch", "group_size", "duration_s", "finished_at")
        object.__setattr__(self, "reason", clean_text(self.reason))


@dataclass(frozen=True)
class CheckpointRow:
    """One checkpoint: status "ok", "torn", "tampered" or "incompatible" (see ``checkpoint.py``)."""

    epoch: int
    created_at: float
    status: str
    reason: str = ""

    def __post_init__(self) -> None:
        _non_negative(self, "epoch", "created_at")
        object.__setattr__(self, "reason", clean_text(self.reason))


@dataclass(frozen=True)
class ContributorRow:
    """Work credited to one volunteer: samples trained on (as it claims them in its record, and as the members of its
    groups witnessed them in committed rounds: ``diloco/credit.py``) and compute seconds spent (claimed)."""

    peer_id: str
    public_name: str
    samples_contributed: int
    compute_s: float
    samples_credited: int = 0

    def __post_init__(self) -> None:
        _non_negative(self, "samples_contributed", "compute_s", "samples_credited")
        object.__setattr__(self, "public_name", clean_text(self.public_name, MAX_NAME_CHARS))
        object.__setattr__(self, "peer_id", clean_text(self.peer_id, 80))

    @property
    def display_name(self) -> str:
        """The public name, or the peer id shortened to its last 8 characters."""
        return self.public_name or short_peer_id(self.peer_id)


def short_peer_id(peer_id: str) -> str:
    return "…" + peer_id[-8:] if len(peer_id) > 10 else peer_id


@dataclass(frozen=True)
class DashboardSnapshot:
    """Everything the dashboard shows at one moment. Lists are converted to tuples.

    Attributes:
        run: the run.
        epoch: the run's current epoch (committed outer steps).
        tokens_per_s: training throughput of the whole swarm, tokens per second.
        loss_curve: evaluations, oldest first (keep it bounded, e.g. the last few thousand).
        peers: known peers (the page shows the first ``page_max_rows``; ``/api/peers`` pages through all).
        rounds: recent averaging rounds, newest first.
        checkpoints: checkpoints on disk, newest first.
        contributors: the contributors board, largest first.
        rounds_committed_total: committed rounds since the run began; None = count ``rounds``.
        rounds_failed_total: failed rounds since the run began; None = count ``rounds``.
        checkpoints_written_total: checkpoints written since start; None = ``len(checkpoints)``.
        taken_at: unix time (s) the snapshot was taken.
        drift_curve: parameter drift per epoch, oldest first (epochs where at least 2 peers published a sketch).
        peers_left: peers that left, newest first (bounded by the coordinator, e.g. the last thousand).
        pipeline: a pipelined run's stages, trainers and rebalances (``web/pipeline_view.py``); None for a
            data-parallel run.
    """

    run: RunInfo
    epoch: int
    tokens_per_s: float
    loss_curve: tuple[LossPoint, ...] = ()
    peers: tuple[PeerRow, ...] = ()
    rounds: tuple[RoundRow, ...] = ()
    checkpoints: tuple[CheckpointRow, ...] = ()
    contributors: tuple[ContributorRow, ...] = ()
    rounds_committed_total: int | None = None
    rounds_failed_total: int | None = None
    checkpoints_written_total: int | None = None
    taken_at: float = 0.0
    drift_curve: tuple[DriftPoint, ...] = ()
    peers_left: tuple[LeftPeerRow, ...] = ()
    pipeline: PipelineView | None = None

    def __post_init__(self) -> None:
        _non_negative(self, "epoch", "tokens_per_s", "taken_at")
        for name in ("loss_curve", "peers", "rounds", "checkpoints", "contributors", "drift_curve", "peers_left"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.rounds_committed_total is None:
            object.__setattr__(self, "rounds_committed_total", sum(r.committed for r in self.rounds))
        if self.rounds_failed_total is None:
            object.__setattr__(self, "rounds_failed_total", sum(not r.committed for r in self.rounds))
        if self.checkpoints_written_total is None:
            object.__setattr__(self, "checkpoints_written_total", len(self.checkpoints))
        _non_negative(self, "rounds_committed_total", "rounds_failed_total", "checkpoints_written_total")

    @property
    def samples_contributed_total(self) -> int:
        return sum(c.samples_contributed for c in self.contributors)

    @property
    def samples_credited_total(self) -> int:
        return sum(c.samples_credited for c in self.contributors)

    @property
    def compute_s_total(self) -> float:
        return sum(c.compute_s for c in self.contributors)

    def latest_loss(self) -> LossPoint | None:
        """The newest evaluation with a finite loss."""
        return next((p for p in reversed(self.loss_curve) if math.isfinite(p.eval_loss)), None)

    def num_peers_alive(self, alive_within_s: float) -> int:
        """Volunteers (every role but the coordinator, which hosts the run) seen within ``alive_within_s`` s."""
        return sum(p.last_seen_s_ago <= alive_within_s and p.role != "coordinator" for p in self.peers)

    def num_volunteers(self) -> int:
        """Volunteers known (every role but the coordinator)."""
        return sum(p.role != "coordinator" for p in self.peers)


def to_jsonable(value: Any) -> Any:
    """Dataclasses/tuples -> JSON-ready dicts/lists; NaN and ±Inf -> None (JSON has no such numbers)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
