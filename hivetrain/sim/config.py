"""A simulation scenario: one frozen config per part, read from one TOML file (``scenarios/sim/*.toml``).

Tables: ``[sim]`` (size, length, seed, tick), ``[peers]`` (compute, links, NAT), ``[churn]`` (session lengths and
arrivals), ``[flash_crowd]`` (optional burst of joiners), ``[schedule]`` (the outer-step schedule, as
``diloco.schedule.PhasePlan``), ``[download]`` (late joiners' state download) and ``[averaging]``, which is the
production ``averaging.config.AveragingConfig`` itself: the simulated swarm averages with the same settings a run
would. Unknown keys are errors; cross-field checks raise ``ValueError`` naming the field.

Units are in the names: seconds (``_s``), samples, bytes, megabits per second (``_mbps``, 10^6 bit/s).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass

from hivetrain.averaging.config import AveragingConfig

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
        model_bytes: bytes of one pseudo-gradient on the wire (4 x parameters for fp32); what the all-reduce moves.
        state_bytes: bytes of the state a joiner downloads (θ plus outer momentum: 2 x model_bytes by default).
        schedule_model: "real" = every simulated peer calls ``diloco.schedule.decide_phase_end`` with every record
            (O(N) per call, O(N^2) per tick: for N up to a few hundred); "aggregate" = a vectorised model of the same
            rule (``sim.schedule_model``) with ``schedule_probes`` peers per tick checked against the real function;
            "auto" = "real" up to 300 peers.
        schedule_probes: peers per tick whose aggregate decision is compared with the real function's (divergences
            are counted in the report).
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
            factor ``compute_spread`` (p95 / p5); "classes" = ``gpu_classes`` (samples/s) drawn with ``gpu_shares``.
        datacenter_share: fraction of peers on datacenter links (``dc_*``); the rest are home links (``home_*``).
        home_upload_mbps / home_download_mbps / dc_upload_mbps / dc_download_mbps: [low, high], drawn log-uniform.
        home_latency_s / dc_latency_s: [low, high] one-way latency, drawn uniform, seconds.
        nat_share: fraction of peers behind NAT: their data-plane links go through a libp2p relay
            (``averaging.libp2p_fallback``), modelled as their bandwidth times ``relay_efficiency`` (uncalibrated).
    """

    compute: Literal["lognormal", "classes"] = "lognormal"
    samples_per_s_median: float = Field(default=4.0, gt=0.0)
    compute_spread: float = Field(default=10.0, ge=1.0)
    gpu_classes: tuple[float, ...] = (1.0, 4.0, 10.0)
    gpu_shares: tuple[float, ...] = (0.5, 0.4, 0.1)
    datacenter_share: float = Field(default=0.1, ge=0.0, le=1.0)
    home_upload_mbps: tuple[float, float] = (10.0, 100.0)
    home_download_mbps: tuple[float, float] = (50.0, 300.0)
    dc_upload_mbps: tuple[float, float] = (1000.0, 10000.0)
    dc_download_mbps: tuple[float, float] = (1000.0, 10000.0)
    home_latency_s: tuple[float, float] = (0.01, 0.08)
    dc_latency_s: tuple[float, float] = (0.001, 0.01)
    nat_share: float = Field(default=0.3, ge=0.0, le=1.0)
    relay_efficiency: float = Field(default=0.5, gt=0.0, le=1.0)

    def __post_init__(self) -> None:
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
class ScheduleSettings:
    """The outer-step schedule (``diloco.schedule.PhasePlan``) and the record heartbeat (``diloco.options``).

    Args:
        schedule / inner_steps / batch_size / target_samples_per_epoch / max_samples_per_peer / stale_after_s /
            max_extrapolation_s: as ``PhasePlan``.
        record_interval_s: every peer publishes its record and reads everyone's this often, seconds.
        record_ttl_s: a record not refreshed for this long expires; also the staleness bound of ``decide_sync``.
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


@dataclass(frozen=True, config=_STRICT)
class DownloadSettings:
    """Late joiners' state download (``diloco.state_fetch``).

    Args:
        num_donors: donors a joiner fetches from; 0 = every holder ``decide_sync`` names (what the trainer does).
        chunk_bytes: the state is fetched in chunks of this size; at most one donor per chunk at a time, so at most
            ``state_bytes / chunk_bytes`` donors are busy.
    """

    num_donors: int = Field(default=0, ge=0)
    chunk_bytes: int = Field(default=16 * 2**20, ge=1)


@dataclass(frozen=True, config=_STRICT)
class Scenario:
    """A whole simulation scenario (see the module docstring)."""

    name: str = "unnamed"
    sim: SimSettings = SimSettings()
    peers: PeerDistribution = PeerDistribution()
    churn: ChurnConfig = ChurnConfig()
    flash_crowd: FlashCrowd = FlashCrowd()
    schedule: ScheduleSettings = ScheduleSettings()
    download: DownloadSettings = DownloadSettings()
    averaging: AveragingConfig = AveragingConfig()


def parse_scenario(raw: dict[str, Any], where: str = "scenario") -> Scenario:
    """A ``Scenario`` from a TOML-shaped dict. Raises ValueError naming the bad field (unknown keys included)."""
    try:
        return Scenario(**raw)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            msg = "unknown key" if err["type"] in ("extra_forbidden", "unexpected_keyword_argument") else err["msg"]
            lines.append(f"{loc}: {msg}")
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
