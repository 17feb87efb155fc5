"""The fault models of a chaos scenario (``chaos.scenario``): one strictly validated pydantic model per fault kind,
with its trigger (``at_s``, or ``on_event``/``on_peer``/``on_epoch`` plus ``delay_s``) and its own fields; ``Fault`` is
their union, discriminated by ``kind``. Launch-time kinds (``LAUNCH_TIME_KINDS``) are armed when their peer starts;
triggered kinds (``TRIGGERED_KINDS``) fire during the run (``chaos.firing``)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hivetrain.faults import HookPoint, hook_point
from hivetrain.testing.byzantine import MODES as BYZANTINE_MODES

STRICT = ConfigDict(extra="forbid", frozen=True)
EVENTS = ("start", "inner_phase", "outer_step", "round_failed", "state_downloaded", "pseudo_gradient_discarded")
LAUNCH_TIME_KINDS = ("hook", "byzantine", "latency", "unreachable")
TRIGGERED_KINDS = (
    "kill", "pause", "kill_p2pd", "kill_coordinator", "join", "bandwidth", "partition", "churn", "adversary",
    "forge_record", "flood", "cpu_starve", "restart",
)  # fmt: skip
KINDS = TRIGGERED_KINDS + LAUNCH_TIME_KINDS


class _Fault(BaseModel):
    """Fields every fault has. ``label`` is shown on the plot and in the summary (default: derived)."""

    model_config = STRICT
    label: str = Field(default="", max_length=40)
    at_s: float | None = Field(default=None, ge=0.0)
    on_event: Literal[EVENTS] | None = None  # type: ignore[valid-type]
    on_peer: int | None = Field(default=None, ge=0)
    on_epoch: int | None = Field(default=None, ge=0)
    delay_s: float = Field(default=0.0, ge=0.0)

    @model_validator(mode="after")
    def _one_trigger(self):
        kind = self.kind  # type: ignore[attr-defined]
        has_event = self.on_event is not None
        if kind in LAUNCH_TIME_KINDS:
            if self.at_s is not None or has_event or self.delay_s:
                raise ValueError(f"a {kind!r} fault is armed at launch: it takes no at_s, on_event or delay_s")
        elif (self.at_s is None) == (not has_event):
            raise ValueError("give exactly one trigger: at_s (seconds after start) or on_event")
        if not has_event and (self.on_peer is not None or self.on_epoch is not None):
            raise ValueError("on_peer and on_epoch refine on_event; set on_event too")
        return self

    def busy_s(self) -> float:
        """Seconds the fault lasts after it fires (0 = instantaneous)."""
        return 0.0

    def describe(self) -> str:
        return self.label or self.kind  # type: ignore[attr-defined]


class KillFault(_Fault):
    """SIGKILL a peer's process group (the peer and its p2pd)."""

    kind: Literal["kill"]
    peer: int = Field(ge=0)


class PauseFault(_Fault):
    """SIGSTOP a peer's process group for ``duration_s`` seconds, then SIGCONT (a laptop lid closing)."""

    kind: Literal["pause"]
    peer: int = Field(ge=0)
    duration_s: float = Field(gt=0.0)

    def busy_s(self) -> float:
        return self.duration_s


class CpuStarveFault(_Fault):
    """Starve a peer of CPU: its process group (the peer, its p2pd and DHT processes) runs ``fraction`` of every
    ``period_s`` and is SIGSTOPped the rest (``chaos/starve.py``), for ``duration_s`` seconds (0 = until the peer
    exits or the run ends). A volunteer's busy machine, at its worst: nothing of the peer runs while stopped."""

    kind: Literal["cpu_starve"]
    peer: int = Field(ge=0)
    fraction: float = Field(default=0.2, gt=0.0, lt=1.0)
    period_s: float = Field(default=1.0, ge=0.05, le=60.0)
    duration_s: float = Field(default=0.0, ge=0.0)

    def busy_s(self) -> float:
        return self.duration_s


class RestartFault(_Fault):
    """SIGKILL a peer's process group, then start it again ``down_s`` seconds later with the same identity (a
    volunteer whose machine rebooted: the same peer ID, a fresh process holding the run's initial θ that must catch up
    with the swarm). The new process is named ``peerNr`` and takes over the index for later faults."""

    kind: Literal["restart"]
    peer: int = Field(ge=0)
    down_s: float = Field(default=5.0, ge=0.0)

    def busy_s(self) -> float:
        return self.down_s


class KillP2pdFault(_Fault):
    """SIGKILL only a peer's p2pd daemon; the Python process lives on without its libp2p host."""

    kind: Literal["kill_p2pd"]
    peer: int = Field(ge=0)


class KillCoordinatorFault(_Fault):
    """SIGKILL the coordinator, restart it after ``down_s`` seconds with the same identity and address."""

    kind: Literal["kill_coordinator"]
    down_s: float = Field(ge=0.0)

    def busy_s(self) -> float:
        return self.down_s


class JoinFault(_Fault):
    """Start ``count`` new peers at once (late joiners); they take the next peer indices."""

    kind: Literal["join"]
    count: int = Field(default=1, ge=1, le=8)


class BandwidthFault(_Fault):
    """Limit a peer's link to ``mbps`` megabit/s each way (tc tbf on its veth; needs ``network = "netns"``)."""

    kind: Literal["bandwidth"]
    peer: int = Field(ge=0)
    mbps: float = Field(gt=0.0, le=100_000.0)


class PartitionFault(_Fault):
    """Cut the peers in ``side`` off from the others (and the coordinator) for ``heal_after_s`` seconds."""

    kind: Literal["partition"]
    side: tuple[int, ...] = Field(min_length=1)
    heal_after_s: float = Field(gt=0.0)

    def busy_s(self) -> float:
        return self.heal_after_s


class ChurnFault(_Fault):
    """Random joins and kills (seeded) for ``duration_s``: a Poisson process of mean interval ``mean_interval_s``,
    keeping between ``min_peers`` and ``max_peers`` peers alive."""

    kind: Literal["churn"]
    duration_s: float = Field(gt=0.0)
    mean_interval_s: float = Field(gt=0.0)
    min_peers: int = Field(default=2, ge=1)
    max_peers: int = Field(default=6, ge=1, le=16)

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_peers > self.max_peers:
            raise ValueError(f"min_peers ({self.min_peers}) must not exceed max_peers ({self.max_peers})")
        return self

    def busy_s(self) -> float:
        return self.duration_s


class HookFault(_Fault):
    """Arm ``--fault POINT:ACTION[:SECONDS][@KEY=VALUE,...]`` on a peer at launch (``testing.hostile_peer``;
    ``hivetrain.faults``)."""

    kind: Literal["hook"]
    peer: int = Field(ge=0)
    point: HookPoint
    action: Literal["raise", "sleep", "exit", "stop"]
    seconds: float = Field(default=0.0, ge=0.0)
    when: dict[str, int | str] = Field(default_factory=dict)

    @field_validator("point", mode="before")
    @classmethod
    def _known_point(cls, point: object) -> HookPoint:
        return hook_point(point)  # a ValueError listing the valid points

    @field_validator("when")
    @classmethod
    def _plain_when(cls, when: dict[str, int | str]) -> dict[str, int | str]:
        for key, value in when.items():
            if not re.fullmatch(r"[a-z_]+", key) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", str(value)):
                raise ValueError(f"when: {key}={value!r} must be a lowercase name and a plain value")
        return when

    def spec(self) -> str:
        """The ``--fault`` argument of ``testing.hostile_peer`` (parsed by ``hivetrain.faults.parse_fault_spec``)."""
        head = f"{self.point.value}:{self.action}" + (f":{self.seconds:g}" if self.seconds else "")
        cond = ",".join(f"{k}={v}" for k, v in self.when.items())
        return head + (f"@{cond}" if cond else "")


class ByzantineFault(_Fault):
    """Launch a peer with ``--byzantine MODE`` (``testing.hostile_peer``, ``testing.byzantine``)."""

    kind: Literal["byzantine"]
    peer: int = Field(ge=0)
    mode: Literal[BYZANTINE_MODES]  # type: ignore[valid-type]


class UnreachableFault(_Fault):
    """A volunteer behind NAT: the peer announces a data-plane address nobody can dial (``UNREACHABLE_HOST``), so
    every data-plane link with it must fall back to a libp2p stream (``hivetrain.averaging.relay``)."""

    kind: Literal["unreachable"]
    peer: int = Field(ge=0)


UNREACHABLE_HOST = "192.0.2.1"  # TEST-NET-1 (RFC 5737): never routed, like a private address behind NAT


class LatencyFault(_Fault):
    """Peers reach the coordinator through a TCP proxy adding ``latency_ms`` (± ``jitter_ms``) per chunk each way,
    and, with probability ``loss``, a further ``rto_ms`` (what a lost segment costs TCP: a retransmission)."""

    kind: Literal["latency"]
    latency_ms: float = Field(ge=0.0, le=10_000.0)
    jitter_ms: float = Field(default=0.0, ge=0.0, le=10_000.0)
    loss: float = Field(default=0.0, ge=0.0, lt=1.0)
    rto_ms: float = Field(default=200.0, ge=0.0, le=60_000.0)


class AdversaryFault(_Fault):
    """A hostile py-libp2p client (``hivetrain/chaos/adversary/attack.py``, its own interpreter) sends malformed
    and hostile messages to a peer's state server for ``duration_s``, holding ``slowloris`` half-open streams."""

    kind: Literal["adversary"]
    peer: int = Field(ge=0)
    duration_s: float = Field(gt=0.0, le=3600.0)
    slowloris: int = Field(default=16, ge=0, le=1024)

    def busy_s(self) -> float:
        return self.duration_s


class ForgeRecordFault(_Fault):
    """An attacker with its own identity and a DHT node without the record guard (``testing/dht_forger.py``) stores
    one signed peer record claiming ``epoch``, with a made-up state hash and an expiration ``expires_in_s`` from now,
    under the run's peers key, then leaves. ``probe_after_s`` later, and again at the end of the run, a guard-less
    probe reads the key from the honest nodes: nothing out of bounds may be left (report invariant ``dht_clean``)."""

    kind: Literal["forge_record"]
    epoch: int = Field(default=10**9, ge=0)
    expires_in_s: float = Field(default=1e9, gt=0.0)
    probe_after_s: float = Field(default=15.0, gt=0.0, le=600.0)

    def busy_s(self) -> float:
        return self.probe_after_s


class FloodFault(_Fault):
    """``idle`` idle, ``slowloris`` slowloris and ``oversized`` oversized-header connections to a peer's averaging
    data port for ``duration_s`` (``testing/flood.py``, in its own process), re-opened whenever the peer closes them."""

    kind: Literal["flood"]
    peer: int = Field(ge=0)
    duration_s: float = Field(gt=0.0, le=3600.0)
    idle: int = Field(default=1000, ge=0, le=5000)
    slowloris: int = Field(default=100, ge=0, le=5000)
    oversized: int = Field(default=0, ge=0, le=5000)

    def busy_s(self) -> float:
        return self.duration_s


Fault = Annotated[
    KillFault
    | PauseFault
    | CpuStarveFault
    | KillP2pdFault
    | RestartFault
    | KillCoordinatorFault
    | JoinFault
    | BandwidthFault
    | PartitionFault
    | ChurnFault
    | HookFault
    | ByzantineFault
    | UnreachableFault
    | LatencyFault
    | AdversaryFault
    | ForgeRecordFault
    | FloodFault,
    Field(discriminator="kind"),
]
