"""A simulation scenario: one frozen config per part, read from one TOML file (``scenarios/sim/*.toml``).

Tables: ``[sim]`` (size, length, seed, tick), ``[peers]`` (compute, links, NAT), ``[churn]`` (session lengths and
arrivals), ``[flash_crowd]`` (optional burst of joiners), ``[partition]`` (optional network split and heal),
``[schedule]`` (the outer-step schedule, as ``diloco.schedule.PhasePlan``), ``[download]`` (late joiners' state
download), ``[pipeline]`` (SWARM mode: stages, servers, trainers, routing and rebalancing timings) and
``[averaging]``, which is the production ``averaging.config.AveragingConfig`` itself: the simulated swarm averages
with the same settings a run would. Unknown keys are errors; cross-field checks raise ``ValueError`` naming the field.

Units are in the names: seconds (``_s``), samples, bytes, megabits per second (``_mbps``, 10^6 bit/s).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass

from hivetrain.averaging.config import AveragingConfig
from hivetrain.diloco.config import MAX_DOWNLOADERS_DEFAULT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_STRICT = ConfigDict(extra="forbid")


@dataclass(frozen=True, config=_STRICT)
class SimSettings:
    """Size and length of one simulation.

    Args:
        seed: seeds every random draw; the same scenario and seed give the same report (``wall_s`` aside).
        num_peers: trainers at time 0 (and the population churn keeps on average).
        outer_steps: the simulation ends once a peer commits this many outer steps (or at ``max_sim_s``).
        max_sim_s: simulated seconds after which the simulation stops regardless.
        tick_s: the period at which simulated peers poll: schedule decisions, matchmaking and record heartbeats are
            evaluated on this grid (the trainer polls matchmaking every ``averaging.poll_interval_s``; a coarser tick
            delays a decision by at most ``tick_s``), seconds.
        vector_size: elements of each peer's stand-in parameter vector (a small vector that averaging really
            averages; drift and consensus are measured on it).
        model_bytes: bytes of one fp32 pseudo-gradient (4 x parameters); the all-reduce moves it as
            ``averaging.compression`` encodes it (``sim.rounds.wire_bytes``).
        state_bytes: bytes of the state a joiner downloads (θ plus outer momentum: 2 x model_bytes by default).
        schedule_model: "real" = every simulated peer calls ``diloco.schedule.decide_phase_end`` with every record
            (O(N) per call, O(N^2) per tick: for N up to a few hundred); "aggregate" = a vectorised model of the same
            rule (``sim.schedule_model``) with ``schedule_probes`` peers per tick checked against the real function;
            "auto" = "real" up to 300 peers.
        schedule_probes: peers per tick whose aggregate decision is compared with the real function's (divergences
            are counted in the report).
        mode: "dataparallel" (``sim.dataparallel``: DiLoCo over the whole model) or "swarm" (``sim.pipeline``: SWARM
            pipeline stages, ``[pipeline]``; runs for ``max_sim_s``).
    """

    seed: int = 0
    num_peers: int = Field(default=100, ge=1, le=200_000)
    outer_steps: int = Field(default=5, ge=1, le=10_000)
    max_sim_s: float = Field(default=100_000.0, gt=0.0)
    tick_s: float = Field(default=1.0, gt=0.0, le=60.0)
    vector_size: int = Field(default=16, ge=1, le=4096)
    model_bytes: int = Field(default=100_000_000, ge=1)
    state_bytes: int = Field(default=0, ge=0, description="0 = 2 x model_bytes")
    schedule_model: Literal["real", "aggregate", "auto"] = "auto"
    schedule_probes: int = Field(default=2, ge=0, le=1000)
    mode: Literal["dataparallel", "swarm"] = "dataparallel"

    def resolved_schedule_model(self) -> Literal["real", "aggregate"]:
        if self.schedule_model == "auto":
            return "real" if self.num_peers <= 300 else "aggregate"
        return self.schedule_model

    def resolved_state_bytes(self) -> int:
        return self.state_bytes or 2 * self.model_bytes


@dataclass(frozen=True, config=_STRICT)
class PeerDistribution:
    """How simulated volunteers differ.

    Args:
        compute: "lognormal" = samples/s log-normal with median ``samples_per_s_median`` and 90% of peers within a
            factor ``compute_spread`` (p95 / p5); "classes" = ``gpu_classes`` (samples/s) drawn with ``gpu_shares``;
            "list" = peer k computes ``samples_per_s[k % len(samples_per_s)]`` (speeds measured on a real swarm, e.g.
            by ``scripts/bench/sim_calibrate.py``; joiners after the initial peers wrap around).
        samples_per_s: the speeds of ``compute = "list"``, samples/s, each > 0 (only with "list").
        datacenter_share: fraction of peers on datacenter links (``dc_*``); the rest are home links (``home_*``).
        home_upload_mbps / home_download_mbps / dc_upload_mbps / dc_download_mbps: [low, high], drawn log-uniform.
        home_latency_s / dc_latency_s: [low, high] one-way latency, drawn uniform, seconds.
        nat_share: fraction of peers behind NAT: their data-plane links go through a libp2p relay
            (``averaging.libp2p_fallback``), modelled as their bandwidth times ``relay_efficiency`` (uncalibrated).
        outer_step_s: seconds a peer spends after its round committed before its next inner phase starts (applying
            the outer step, evaluating, publishing); 0 = none. Fitted from a real swarm by ``sim_calibrate.py``.
        speed_jitter: each inner phase runs at the peer's speed x exp(speed_jitter x N(0, 1)) (a volunteer's other
            work, a shared machine's load); 0 = constant speed. Fitted from a real swarm's phase speeds.
    """

    compute: Literal["lognormal", "classes", "list"] = "lognormal"
    samples_per_s_median: float = Field(default=4.0, gt=0.0)
    compute_spread: float = Field(default=10.0, ge=1.0)
    gpu_classes: tuple[float, ...] = (1.0, 4.0, 10.0)
    gpu_shares: tuple[float, ...] = (0.5, 0.4, 0.1)
    samples_per_s: tuple[float, ...] = ()
    datacenter_share: float = Field(default=0.1, ge=0.0, le=1.0)
    home_upload_mbps: tuple[float, float] = (10.0, 100.0)
    home_download_mbps: tuple[float, float] = (50.0, 300.0)
    dc_upload_mbps: tuple[float, float] = (1000.0, 10000.0)
    dc_download_mbps: tuple[float, float] = (1000.0, 10000.0)
    home_latency_s: tuple[float, float] = (0.01, 0.08)
    dc_latency_s: tuple[float, float] = (0.001, 0.01)
    nat_share: float = Field(default=0.3, ge=0.0, le=1.0)
    relay_efficiency: float = Field(default=0.5, gt=0.0, le=1.0)
    outer_step_s: float = Field(default=0.0, ge=0.0)
    speed_jitter: float = Field(default=0.0, ge=0.0, le=3.0)

    def __post_init__(self) -> None:
        if (self.compute == "list") != bool(self.samples_per_s):
            raise ValueError('peers.samples_per_s is required with compute = "list" and only allowed with it')
        if any(not s > 0 for s in self.samples_per_s):  # also refuses NaN
            raise ValueError(f"peers.samples_per_s must all be > 0 samples/s, got {self.samples_per_s}")
        if len(self.gpu_classes) != len(self.gpu_shares) or not self.gpu_classes:
            raise ValueError("peers.gpu_classes and peers.gpu_shares must be non-empty and of equal length")
        if any(s < 0 for s in self.gpu_shares) or abs(sum(self.gpu_shares) - 1.0) > 1e-6:
            raise ValueError(f"peers.gpu_shares must be >= 0 and sum to 1, got {self.gpu_shares}")
        for name in ("home_upload_mbps", "home_download_mbps", "dc_upload_mbps", "dc_download_mbps"):
            low, high = getattr(self, name)
            if not 0 < low <= high:
                raise ValueError(f"peers.{name} must be [low, high] with 0 < low <= high, got {(low, high)}")
        for name in ("home_latency_s", "dc_latency_s"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"peers.{name} must be [low, high] with 0 <= low <= high, got {(low, high)}")


@dataclass(frozen=True, config=_STRICT)
class ChurnConfig:
    """Session lengths and arrivals.

    Args:
        session: "none" (nobody leaves), "exponential" (mean ``mean_session_s``) or "weibull" (shape
            ``weibull_shape`` < 1 is heavy-tailed; scaled to mean ``mean_session_s``).
        arrivals: new peers arrive as a Poisson process at ``num_peers / mean_session_s`` per second (the rate that
            keeps the population at ``num_peers`` on average); False = departures only.
        initial_sessions_residual: the peers present at time 0 have residual sessions (the steady state of the
            renewal process: exponential is memoryless; for weibull this draws from the same law, an approximation).
    """

    session: Literal["none", "exponential", "weibull"] = "none"
    mean_session_s: float = Field(default=3600.0, gt=0.0)
    weibull_shape: float = Field(default=0.6, gt=0.0, le=10.0)
    arrivals: bool = True


@dataclass(frozen=True, config=_STRICT)
class FlashCrowd:
    """``num_joiners`` peers arrive together at ``at_s`` (0 joiners = no flash crowd)."""

    num_joiners: int = Field(default=0, ge=0, le=200_000)
    at_s: float = Field(default=0.0, ge=0.0)


@dataclass(frozen=True, config=_STRICT)
class PartitionSettings:
    """A network partition (``sim.partition``): from ``at_s`` until ``heal_s`` a random ``share`` of the peers (side 1;
    joiners during the split too, with the same probability) can neither reach nor see the others (side 0): each side
    reads only its own side's DHT records, groups form and state downloads go only within a side, and a group that
    spans both sides when the split begins fails. ``share = 0`` = no partition.

    Raises ValueError when ``heal_s <= at_s`` with a partition configured.
    """

    share: float = Field(default=0.0, ge=0.0, lt=1.0)
    at_s: float = Field(default=0.0, ge=0.0)
    heal_s: float = Field(default=float("inf"), gt=0.0)

    def __post_init__(self) -> None:
        if self.share > 0 and self.heal_s <= self.at_s:
            raise ValueError(f"partition.heal_s ({self.heal_s}) must be > partition.at_s ({self.at_s})")

    def active(self, now: float) -> bool:
        """Whether the network is split at time ``now`` (seconds)."""
        return self.share > 0 and self.at_s <= now < self.heal_s


@dataclass(frozen=True, config=_STRICT)
class ScheduleSettings:
    """The outer-step schedule (``diloco.schedule.PhasePlan``) and the record heartbeat (``diloco.options``).

    Args:
        schedule / inner_steps / batch_size / target_samples_per_epoch / max_samples_per_peer / stale_after_s /
            max_extrapolation_s: as ``PhasePlan``.
        record_interval_s: every peer publishes its record and reads everyone's this often, seconds.
        record_ttl_s: a record not refreshed for this long expires; also the staleness bound of ``decide_sync``.
        max_carried_phases: as ``diloco.max_carried_phases`` (the same default): the most phases a carried
            contribution holds; past it the oldest are dropped (``round_policy.keep_carried``).
    """

    schedule: Literal["steps", "swarm"] = "swarm"
    inner_steps: int = Field(default=50, ge=1)
    batch_size: int = Field(default=8, ge=1)
    target_samples_per_epoch: int = Field(default=0, ge=0)
    max_samples_per_peer: int = Field(default=1_000_000, ge=1)
    stale_after_s: float = Field(default=30.0, gt=0.0)
    max_extrapolation_s: float = Field(default=15.0, ge=0.0)
    record_interval_s: float = Field(default=5.0, gt=0.0)
    record_ttl_s: float = Field(default=30.0, gt=0.0)
    max_carried_phases: int = Field(default=4, ge=1, le=64)


@dataclass(frozen=True, config=_STRICT)
class DownloadSettings:
    """Late joiners' state download (``diloco.state_fetch``).

    Args:
        num_donors: donors a joiner fetches from; 0 = every holder ``decide_sync`` names (what the trainer does).
        chunk_bytes: the state is fetched in chunks of this size; at most one donor per chunk at a time, so at most
            ``state_bytes / chunk_bytes`` donors are busy.
        max_downloaders: a donor serves at most this many downloads at once (``diloco.max_downloaders``, the same
            default; 0 = no cap): a joiner uses only donors below it, and with none free looks again a second later
            (as the trainer retries a failed download).
    """

    num_donors: int = Field(default=0, ge=0)
    chunk_bytes: int = Field(default=16 * 2**20, ge=1)
    max_downloaders: int = Field(default=MAX_DOWNLOADERS_DEFAULT, ge=0)


@dataclass(frozen=True, config=_STRICT)
class PipelineSettings:
    """SWARM pipeline mode (``sim.pipeline``): stage servers, trainers that stream microbatches through them.

    Args:
        num_stages: S, pipeline stages.
        num_servers: stage servers at time 0 (``[churn]`` applies to servers: sessions and arrivals keep this many on
            average).
        initial_placement: "choose_stage" = each initial server joins through ``swarm.rebalance.choose_stage``, in
            turn; "round_robin" = server k serves stage k mod S (ignores speeds); "skewed" = half of them on stage 0,
            the rest round robin (a placement for rebalancing to repair).
        num_trainers / inflight_per_trainer: trainers, and microbatches each keeps in the pipeline (closed loop).
        server_mb_per_s_median / server_spread: a server's speed in microbatches/s (one forward + one backward) at a
            stage of cost 1, log-normal with this median and p95/p5 ratio; at stage s it is speed / stage_costs[s].
        stage_costs: relative compute cost of each stage; empty = all 1.
        announce_interval_s: servers re-announce their ``StageRecord`` this often (staggered), seconds.
        record_max_age_s: trainers and servers ignore records older than this, seconds (a dead server is routed to
            until its record ages out).
        call_timeout_s: a trainer gives up on a hop after this long and bans the server, seconds.
        ban_base_s / ban_max_s: a failed server's first ban and longest ban, seconds (doubling per failure).
        Defaults of these timings are ``swarm.config.SwarmConfig``'s (request_timeout_s, record_ttl_s, ...).
        hop_latency_s: one-way network latency per hop (activations' transfer time is not modelled), seconds.
        rebalance / rebalance_interval_s / rebalance_margin / min_servers_per_stage: every interval each serving
            server asks ``swarm.rebalance.decide_move`` (margin as a fraction of the mover's throughput: 0.2 = 20%).
        move_s: a moving or joining server fetches its stage's state for this long before it serves, seconds.
        warmup_s: throughput is measured after this, seconds.
    """

    num_stages: int = Field(default=4, ge=1, le=64)
    num_servers: int = Field(default=100, ge=1, le=100_000)
    initial_placement: Literal["choose_stage", "round_robin", "skewed"] = "choose_stage"
    num_trainers: int = Field(default=8, ge=1, le=10_000)
    inflight_per_trainer: int = Field(default=16, ge=1, le=10_000)
    server_mb_per_s_median: float = Field(default=1.0, gt=0.0)
    server_spread: float = Field(default=4.0, ge=1.0)
    stage_costs: tuple[float, ...] = ()
    announce_interval_s: float = Field(default=1.0, gt=0.0)
    record_max_age_s: float = Field(default=5.0, gt=0.0)
    call_timeout_s: float = Field(default=10.0, gt=0.0)
    ban_base_s: float = Field(default=2.0, gt=0.0)
    ban_max_s: float = Field(default=60.0, gt=0.0)
    hop_latency_s: float = Field(default=0.05, ge=0.0)
    rebalance: bool = True
    rebalance_interval_s: float = Field(default=10.0, gt=0.0)
    rebalance_margin: float = Field(default=0.2, ge=0.0)
    min_servers_per_stage: int = Field(default=1, ge=0)
    move_s: float = Field(default=30.0, ge=0.0)
    warmup_s: float = Field(default=60.0, ge=0.0)

    def __post_init__(self) -> None:
        if self.stage_costs and len(self.stage_costs) != self.num_stages:
            raise ValueError(f"pipeline.stage_costs must have num_stages ({self.num_stages}) entries or none")
        if any(c <= 0 for c in self.stage_costs):
            raise ValueError(f"pipeline.stage_costs must be > 0, got {self.stage_costs}")
        if self.ban_max_s < self.ban_base_s:
            raise ValueError("pipeline.ban_max_s must be >= ban_base_s")
        if self.record_max_age_s < self.announce_interval_s:
            raise ValueError("pipeline.record_max_age_s must be >= announce_interval_s (records would age out)")

    def cost(self, stage: int) -> float:
        return self.stage_costs[stage] if self.stage_costs else 1.0


NOT_MODELLED_AVERAGING = (
    "aggregation",
    "clip_tau",
    "clip_tau_factor",
    "clip_iters",
    "error_feedback",
    "max_update_ratio",
    "update_norm_window",
    "update_norm_min_history",
)
"""``[averaging]`` keys a scenario may not change from their defaults: robust aggregation, error feedback and the
update bound change what is applied, which the simulator does not model (it would silently run the default)."""


@dataclass(frozen=True, config=_STRICT)
class Scenario:
    """A whole simulation scenario (see the module docstring)."""

    name: str = "unnamed"
    sim: SimSettings = SimSettings()
    peers: PeerDistribution = PeerDistribution()
    churn: ChurnConfig = ChurnConfig()
    flash_crowd: FlashCrowd = FlashCrowd()
    partition: PartitionSettings = PartitionSettings()
    schedule: ScheduleSettings = ScheduleSettings()
    download: DownloadSettings = DownloadSettings()
    averaging: AveragingConfig = AveragingConfig()
    pipeline: PipelineSettings = PipelineSettings()

    def __post_init__(self) -> None:
        defaults = AveragingConfig()
        set_but_not_modelled = [
            f"averaging.{name} = {getattr(self.averaging, name)!r}"
            for name in NOT_MODELLED_AVERAGING
            if getattr(self.averaging, name) != getattr(defaults, name)
        ]
        if set_but_not_modelled:
            raise ValueError(
                f"{', '.join(set_but_not_modelled)}: the simulator does not model this (its rounds take the plain "
                "sample-weighted mean of what members send, with no update bound or error feedback); remove it from "
                "the scenario, or measure it with a real swarm (`hivetrain chaos`, `scripts/bench/`)"
            )
        given = len(self.peers.samples_per_s)
        if given and given != self.sim.num_peers:
            raise ValueError(f"peers.samples_per_s has {given} speed(s) for sim.num_peers = {self.sim.num_peers}")


def parse_scenario(raw: dict[str, Any], where: str = "scenario") -> Scenario:
    """A ``Scenario`` from a TOML-shaped dict. Raises ValueError naming the bad field (unknown keys included)."""
    try:
        return Scenario(**raw)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            unknown = err["type"] in ("extra_forbidden", "unexpected_keyword_argument")
            msg = "unknown key" if unknown else err["msg"].removeprefix("Value error, ")
            lines.append(f"{loc}: {msg}" if loc else msg)
        raise ValueError(f"{where}: " + "; ".join(lines)) from None
    except TypeError as exc:  # an unknown top-level table
        raise ValueError(f"{where}: {exc}") from None


def load_scenario(path: str | Path) -> Scenario:
    """Read a scenario TOML file; its ``name`` defaults to the file's stem.

    Raises:
        ValueError: not TOML, an unknown key or a bad value (the message names the field).
        FileNotFoundError: no such file.
    """
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    raw.setdefault("name", path.stem)
    return parse_scenario(raw, str(path))
