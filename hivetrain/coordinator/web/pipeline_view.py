"""What the dashboard shows of a pipelined (SWARM) run: stages, their servers, trainers' totals, rebalances.

Built by ``coordinator/pipeline.py`` from the records it polls; immutable; every volunteer-supplied string is
length-capped and control-character-free here (``clean_text``) and HTML-escaped when rendered. Units are in the
names: ``_mb_per_s`` = microbatches per second, ``_at`` = unix seconds, ``_s_ago`` = seconds before the snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass

from hivetrain.coordinator.web.snapshot import MAX_NAME_CHARS, _non_negative, clean_text


@dataclass(frozen=True)
class StageServerRow:
    """A stage server as its last ``StageRecord`` announced it (claimed figures, bounded by the record's schema).

    Attributes:
        throughput_mb_per_s: its measured capacity, microbatches/s.
        load: fraction of its last announce interval spent computing, in [0, 1].
        queue_len: microbatches waiting or running there.
        rebalances: its moves since it started, as credited by the coordinator.
        last_decision: the reason of its last rebalance check, moved or not ("" = none seen).
    """

    peer_id: str
    status: str
    throughput_mb_per_s: float
    load: float
    queue_len: int
    epoch: int
    last_seen_s_ago: float
    rebalances: int = 0
    last_decision: str = ""

    def __post_init__(self) -> None:
        _non_negative(self, "throughput_mb_per_s", "load", "queue_len", "epoch", "last_seen_s_ago", "rebalances")
        object.__setattr__(self, "peer_id", clean_text(self.peer_id, 80))
        object.__setattr__(self, "status", clean_text(self.status, MAX_NAME_CHARS))
        object.__setattr__(self, "last_decision", clean_text(self.last_decision))


@dataclass(frozen=True)
class StageRow:
    """One stage: its live servers and their summed throughput; ``bottleneck``: the stage with the least."""

    index: int
    servers: tuple[StageServerRow, ...]
    throughput_mb_per_s: float
    bottleneck: bool = False

    def __post_init__(self) -> None:
        _non_negative(self, "index", "throughput_mb_per_s")
        object.__setattr__(self, "servers", tuple(self.servers))

    @property
    def mean_load(self) -> float:
        return sum(s.load for s in self.servers) / len(self.servers) if self.servers else 0.0


@dataclass(frozen=True)
class PipelineTrainerRow:
    """A pipeline trainer: its counters as the coordinator credited them (see ``coordinator/pipeline.py``).

    Attributes:
        microbatches, reroutes, replays, deaths: credited totals (a claim is credited only as a bounded increase).
        last_reasons: its newest ban / death reasons, newest last (each at most 200 characters).
        left_reason: "" while it trains; why it stopped otherwise.
    """

    peer_id: str
    microbatches: int
    reroutes: int
    replays: int
    deaths: int
    last_seen_s_ago: float
    last_reasons: tuple[str, ...] = ()
    left_reason: str = ""

    def __post_init__(self) -> None:
        _non_negative(self, "microbatches", "reroutes", "replays", "deaths", "last_seen_s_ago")
        object.__setattr__(self, "peer_id", clean_text(self.peer_id, 80))
        object.__setattr__(self, "last_reasons", tuple(clean_text(r) for r in self.last_reasons))
        object.__setattr__(self, "left_reason", clean_text(self.left_reason))


@dataclass(frozen=True)
class RebalanceRow:
    """One move of a stage server: ``from_stage`` -> ``to_stage`` at ``at`` (unix s, the server's claim clamped to
    when the coordinator saw it), and ``reason`` (``rebalance.decide_move``'s, at most 200 characters)."""

    peer_id: str
    at: float
    from_stage: int
    to_stage: int
    reason: str

    def __post_init__(self) -> None:
        _non_negative(self, "at", "from_stage", "to_stage")
        object.__setattr__(self, "peer_id", clean_text(self.peer_id, 80))
        object.__setattr__(self, "reason", clean_text(self.reason))


@dataclass(frozen=True)
class PipelineView:
    """The pipeline at one moment.

    Attributes:
        num_stages: S of the run's ``[swarm]`` table.
        microbatch_size: windows per microbatch.
        stages: one row per stage, index order (a stage nobody serves has no servers).
        trainers: trainers whose reports are live, or that left recently (their last report is still in the DHT).
        pipeline_throughput_mb_per_s: min over stages of their servers' announced throughput (the bottleneck).
        microbatches_per_s: credited microbatches per second over the last ``window_s`` seconds.
        microbatches_total, reroutes_total, replays_total, deaths_total, rebalances_total: credited since the
            coordinator started (kept when peers leave).
        rebalances: recent moves, newest first.
        window_s: the span ``microbatches_per_s`` is measured over, seconds.
    """

    num_stages: int
    microbatch_size: int
    stages: tuple[StageRow, ...] = ()
    trainers: tuple[PipelineTrainerRow, ...] = ()
    pipeline_throughput_mb_per_s: float = 0.0
    microbatches_per_s: float = 0.0
    microbatches_total: int = 0
    reroutes_total: int = 0
    replays_total: int = 0
    deaths_total: int = 0
    rebalances_total: int = 0
    rebalances: tuple[RebalanceRow, ...] = ()
    window_s: float = 60.0

    def __post_init__(self) -> None:
        _non_negative(
            self,
            "num_stages",
            "microbatch_size",
            "pipeline_throughput_mb_per_s",
            "microbatches_per_s",
            "microbatches_total",
            "reroutes_total",
            "replays_total",
            "deaths_total",
            "rebalances_total",
            "window_s",
        )
        for name in ("stages", "trainers", "rebalances"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def num_servers(self) -> int:
        return sum(len(stage.servers) for stage in self.stages)
