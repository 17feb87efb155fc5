"""Chaos scenarios: a TOML file describing a swarm, its run config and the faults to apply, strictly validated.

Example (``scenarios/kill-one-of-four.toml``)::

    name = "kill-one-of-four"
    description = "SIGKILL 1 of 4 peers (and its p2pd) while a round is in flight"
    peers = 4
    max_duration_s = 240

    [run]                      # a run config (hivetrain.config.RunConfig); diloco.outer_steps >= 1
    model = "tiny"
    [run.diloco]
    inner_steps = 10
    outer_steps = 6

    [[faults]]
    kind = "kill"
    peer = 1
    on_event = "inner_phase"   # when peer 1 has finished its inner phase of epoch 2 ...
    on_peer = 1
    on_epoch = 2
    delay_s = 0.5              # ... plus 0.5 s: it is matching or sending when it dies

Peers are numbered in launch order: ``0 .. peers-1`` at the start, then the peers of each ``join`` fault in the order
of the faults. Peers started by ``churn`` have no index. A triggered fault fires at ``at_s`` seconds after the swarm
started, or ``delay_s`` after the first metrics event matching ``on_event``/``on_peer`` at epoch ``on_epoch`` or later
(a peer that missed that epoch's round, e.g. started late on a busy machine and caught up by state download, triggers
the fault at its next such event instead of never). Launch-time
faults (``hook``, ``byzantine``, ``latency``, ``unreachable``) are armed when their peer (or the swarm) starts and
take no trigger.

Invite-only runs: with ``[run.admission] mode = "token"`` the harness signs a join token with the coordinator's
identity for every peer it launches (``--join-token``), except a ``byzantine`` peer in mode ``uninvited``, which
joins without one and ignores its refusal. The harness is the only token issuer: ``run.admission.issuer`` stays
empty, and mode ``"allowlist"`` is refused (the peers' IDs are not known when the run config is written).

Every error is a ``ValueError`` naming the field (``faults[2].peer: ...``); unknown keys are errors.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from hivetrain.chaos.fault_models import KINDS, STRICT, Fault
from hivetrain.config import RunConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class Scenario(BaseModel):
    """One chaos scenario.

    Args:
        name: short name (letters, digits, '-'), used for ``chaos run NAME`` of a bundled scenario.
        description: one line shown by ``chaos list``.
        peers: peers started at the beginning (indices 0..peers-1).
        max_duration_s: the scenario is stopped (and fails) after this many seconds; every fault must end before.
        seed: seeds churn plans and the proxy's jitter/loss; a scenario run twice applies the same faults.
        threads_per_peer: torch CPU threads of each peer.
        network: "loopback" (127.0.0.1) or "netns" (each process in its own network namespace on a bridge; needed
            by bandwidth and partition faults; root only).
        max_rss_growth_mb: the RSS growth allowed per peer from its first committed step to its last sample, MiB.
        every_peer_commits: require that every honest survivor commits every epoch from its first commit to the
            end, with no state download after it (report invariant ``every_peer_kept_committing``).
        max_join_download_s: require that every honest peer started by a ``join`` fault holds the swarm's state
            within this many seconds of its start event (report invariant ``joiners_synced_in_time``).
        state_chunk_bytes: the state chunk size every peer serves (default: the peers' own); small enough that the
            state spans several chunks, so a joiner asks every donor (``testing.byzantine.CHUNK_BYTES_ENV``).
        run: the run config (``hivetrain.config.RunConfig`` fields); ``diloco.outer_steps`` must be >= 1.
        faults: what to break and when.
    """

    model_config = STRICT
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9\-]{0,63}$")
    description: str = Field(min_length=1, max_length=160)
    peers: int = Field(ge=1, le=16)
    max_duration_s: float = Field(gt=0.0, le=6 * 3600)
    seed: int = Field(default=0, ge=0)
    threads_per_peer: int = Field(default=1, ge=1, le=64)
    network: Literal["loopback", "netns"] = "loopback"
    max_rss_growth_mb: float = Field(default=256.0, gt=0.0)
    every_peer_commits: bool = False
    max_join_download_s: float | None = Field(default=None, gt=0.0)
    state_chunk_bytes: int | None = Field(default=None, ge=64 * 1024, le=64 * 2**20, multiple_of=4)
    run: dict[str, Any] = Field(default_factory=dict)
    faults: tuple[Fault, ...] = ()

    @model_validator(mode="after")
    def _cross_checks(self):
        config = RunConfig.from_dict(self.run)  # ValueError names the field; re-prefixed by load_scenario
        if config.diloco.outer_steps < 1:
            raise ValueError("run.diloco.outer_steps must be >= 1: a scenario trains a finite number of outer steps")
        num_total = self.num_indexed_peers
        for i, fault in enumerate(self.faults):
            where = f"faults[{i}] ({fault.kind})"
            end = (fault.at_s or 0.0) + fault.delay_s + fault.busy_s()
            if end >= self.max_duration_s:
                raise ValueError(
                    f"{where}: fires or lasts until {end:g}s, past the end of the scenario "
                    f"(max_duration_s = {self.max_duration_s:g})"
                )
            targets = [("peer", getattr(fault, "peer", None)), ("on_peer", fault.on_peer)]
            targets += [("side", p) for p in getattr(fault, "side", ())]
            for field, index in targets:
                if index is not None and index >= num_total:
                    raise ValueError(
                        f"{where}.{field} = {index}: peer index out of range; the scenario has peers 0..{num_total - 1}"
                        f" ({self.peers} at start + {num_total - self.peers} joining)"
                    )
            if fault.kind in ("latency", "adversary", "forge_record", "flood") and self.network != "loopback":
                raise ValueError(f'{where}: needs network = "loopback" (it runs in the host namespace)')
            if fault.kind in ("bandwidth", "partition") and self.network != "netns":
                raise ValueError(f'{where}: needs network = "netns" (network namespaces with tc)')
            if fault.kind == "partition" and len(set(fault.side)) >= self.peers:
                raise ValueError(f"{where}.side: leave at least one initial peer on the coordinator's side")
        adm = config.admission
        if adm.mode == "allowlist":
            raise ValueError(
                'run.admission.mode = "allowlist" is not supported by the harness (it cannot know the peers\' IDs '
                'when it writes the run config): use mode = "token"; the harness invites every honest peer'
            )
        if adm.issuer:
            raise ValueError(
                "run.admission.issuer: leave it empty; the harness signs every join token with the coordinator's "
                "identity, so the coordinator is the issuer"
            )
        for i, fault in enumerate(self.faults):
            if fault.kind == "byzantine" and fault.mode == "uninvited" and adm.mode != "token":
                raise ValueError(
                    f'faults[{i}] (byzantine uninvited): needs an invite-only run: set [run.admission] mode = "token"'
                    " (in an open run every peer is a member, so there is nothing to refuse)"
                )
        if self.max_join_download_s is not None and not any(f.kind == "join" for f in self.faults):
            raise ValueError("max_join_download_s bounds the joiners' state download: add a join fault")
        if sum(f.kind == "latency" for f in self.faults) > 1:
            raise ValueError("at most one latency fault (it sits in front of the coordinator)")
        return self

    @property
    def num_indexed_peers(self) -> int:
        """Initial peers plus the peers of every join fault."""
        return self.peers + sum(f.count for f in self.faults if f.kind == "join")

    def run_config(self) -> RunConfig:
        return RunConfig.from_dict(self.run)

    @property
    def invite_only(self) -> bool:
        """Whether the run admits only invited peers (``run.admission.mode = "token"``): the harness then gives each
        launched peer a join token, except ``uninvited`` byzantine peers."""
        return self.run_config().admission.mode == "token"


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = []
        for item in err["loc"]:
            if isinstance(item, int):
                loc.append(f"[{item}]")
            elif item not in KINDS:
                loc.append(f".{item}")
        field = "".join(loc).lstrip(".")
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] not in ("value_error", "union_tag_invalid"):
            msg += f" (got {err.get('input')!r})"
        parts.append(f"{field}: {msg}" if field else msg)
    return "; ".join(parts)


def parse_scenario(raw: dict[str, Any], source: str = "scenario") -> Scenario:
    """Validate a parsed scenario. Raises ValueError (``"<source>: faults[1].peer: ..."``)."""
    try:
        return Scenario.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(f"{source}: {_describe(exc)}") from None


def load_scenario(path: str | Path) -> Scenario:
    """Load and validate a scenario TOML file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not TOML, unknown key, bad value, fault past the end, peer index out of range (names the field).
    """
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    return parse_scenario(raw, str(path))


def scenarios_dir() -> Path:
    """The bundled scenarios: ``scenarios/`` at the root of the source tree (next to the ``hivetrain`` package)."""
    return Path(__file__).resolve().parents[2] / "scenarios"


def bundled_scenarios() -> dict[str, Path]:
    """name (file stem) -> path of every bundled scenario, sorted by name."""
    root = scenarios_dir()
    return {p.stem: p for p in sorted(root.glob("*.toml"))} if root.is_dir() else {}


def resolve_scenario(name_or_path: str) -> Path:
    """A path to a TOML file, or the name of a bundled scenario. Raises FileNotFoundError listing the bundled ones."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.exists():
            raise FileNotFoundError(f"no scenario file {path}")
        return path
    bundled = bundled_scenarios()
    if name_or_path in bundled:
        return bundled[name_or_path]
    raise FileNotFoundError(f"no scenario {name_or_path!r}; bundled: {', '.join(bundled) or '(none)'}")
