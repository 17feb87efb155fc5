"""The run's configuration: one frozen dataclass per component, loaded from one TOML file.

A run is described by a TOML file (see ``configs/*.toml``) with one table per component, each component's config
class next to it::

    run_id = "demo"
    model = "small"
    [data]      -> DataConfig (``hivetrain.data.config``)
    [diloco]    -> DilocoConfig (``hivetrain.diloco.config``)
    [averaging] -> AveragingConfig (``hivetrain.averaging.config``)
    [admission] -> AdmissionConfig (``hivetrain.peers.config``: who may join; open by default)
    [swarm]     -> SwarmConfig (``hivetrain.swarm.config``; optional: present = a SWARM pipeline run)

This module holds ``RunConfig`` (the tables together, and the checks across them) and its loading.

Unknown keys are errors. Validation errors are ``ValueError`` (pydantic's ``ValidationError`` subclasses it) and
name the offending field, e.g. ``diloco.outer_lr``. Command-line overrides use dotted names
(``{"diloco.inner_steps": 20}``) and go through the same validation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from hivetrain.averaging.config import AveragingConfig
from hivetrain.data.config import DataConfig
from hivetrain.diloco.config import DilocoConfig
from hivetrain.peers.config import AdmissionConfig
from hivetrain.swarm.config import NOT_PIPELINED, SwarmConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_STRICT = ConfigDict(extra="forbid")

MODEL_PRESETS = ("tiny", "small", "base")


@dataclass(frozen=True, config=_STRICT)
class RunConfig:
    """One training run. Every peer of the run holds the same RunConfig (the coordinator publishes it signed).

    Args:
        run_id: names the run in the DHT; letters, digits, '-', '_' and '.'.
        model: a model preset (tiny ~0.5M, small ~5M, base ~150M parameters), or a path (it holds a '/' or ends in
            '.json': write ``./dir`` for a relative directory): a ``transformers`` config.json or a directory
            holding one (any causal LM architecture, fresh weights from ``seed``), or a pretrained directory with
            ``*.safetensors`` weights, which are θ₀ (continued pretraining). Every peer needs the files on its disk
            (``join-swarm --model-path`` if elsewhere); see ``hivetrain.model``.
        seed: seeds the initial parameters (identical on every peer) and each peer's data stream.
        swarm: the SWARM pipeline settings (``[swarm]``). Absent = ``NOT_PIPELINED`` (``num_stages = 0``): a
            data-parallel DiLoCo run, and ``to_dict`` leaves the table out (so a data-parallel run's TOML and
            fingerprint do not change). Present = the model is cut into ``swarm.num_stages`` stages; volunteers join
            it with the same ``join-swarm ADDRESS`` and take a stage-server or pipeline-trainer role.
    """

    run_id: str = "hivetrain"
    model: str = Field(default="tiny", min_length=1, max_length=1024)
    seed: int = Field(default=0, ge=0)
    data: DataConfig = DataConfig()
    diloco: DilocoConfig = DilocoConfig()
    averaging: AveragingConfig = AveragingConfig()
    admission: AdmissionConfig = AdmissionConfig()
    swarm: SwarmConfig = NOT_PIPELINED

    @property
    def pipelined(self) -> bool:
        """Whether this is a SWARM pipeline run (a ``[swarm]`` table with ``num_stages`` >= 1)."""
        return self.swarm.pipelined

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", self.run_id):
            raise ValueError(f"run_id {self.run_id!r}: use 1-64 letters, digits, '-', '_' or '.'")
        # the same rule as hivetrain.model.is_model_path (kept here so that loading a config imports no torch)
        if self.model not in MODEL_PRESETS and not ("/" in self.model or self.model.endswith(".json")):
            raise ValueError(
                f"model {self.model!r}: not a preset {list(MODEL_PRESETS)} nor a path (a config.json, or a directory "
                f"holding one: write ./{self.model} for a relative directory)"
            )
        honest_weight = self.diloco.inner_steps * self.diloco.samples_per_inner_step(self.data.batch_size)
        if self.averaging.max_samples_per_round < honest_weight:
            raise ValueError(
                "averaging.max_samples_per_round must be at least diloco.inner_steps * data.batch_size * "
                f"diloco.grad_accum_steps ({honest_weight}), the weight an honest peer claims"
            )
        if self.diloco.overlap != "off" and not self.averaging.exact_average:
            raise ValueError(
                f"diloco.overlap={self.diloco.overlap!r} needs averaging.strategy='butterfly': moshpit and gossip "
                "average θ after each peer's own outer step, so there is no shared state for a round in flight to land "
                "on; set diloco.overlap='off' or use the butterfly strategy"
            )
        if self.diloco.fragments > 1 and not self.averaging.exact_average:
            raise ValueError(
                f"diloco.fragments = {self.diloco.fragments} needs averaging.strategy='butterfly': a fragment's outer "
                "step lands on the shared state, which moshpit and gossip do not keep; set diloco.fragments = 1"
            )
        if not self.averaging.exact_average and self.averaging.compression in ("int8", "int4", "topk"):
            raise ValueError(
                f"averaging.compression={self.averaging.compression!r} with averaging.strategy="
                f"{self.averaging.strategy!r}: moshpit and gossip average the parameters θ, not the pseudo-gradient, "
                "and quantizing or sparsifying θ would destroy the model; use compression 'none' or 'fp16', or the "
                "butterfly strategy"
            )
        self.swarm.check_unset()
        if self.pipelined:
            self.swarm.num_microbatches(self.data.batch_size)  # raises: batch not a multiple of the microbatch
            # Stage servers compute in fp32, one microbatch per call, and wait for their outer step: refuse the DiLoCo
            # trainer's settings they would silently ignore.
            ignored = [
                f"{name} = {value!r}"
                for name, value, default in (
                    ("diloco.precision", self.diloco.precision, ("auto", "fp32")),
                    ("diloco.grad_accum_steps", self.diloco.grad_accum_steps, (1,)),
                    ("diloco.overlap", self.diloco.overlap, ("off",)),
                    ("diloco.fragments", self.diloco.fragments, (1,)),
                )
                if value not in default
            ]
            if ignored:
                raise ValueError(
                    f"{', '.join(ignored)} with a [swarm] table: SWARM stage servers compute in fp32 without gradient "
                    "accumulation, overlapped rounds or fragments; remove these settings (or the [swarm] table)"
                )
            if self.admission.mode != "open":
                raise ValueError(
                    f"admission.mode = {self.admission.mode!r} with a [swarm] table: stage servers do not check "
                    "membership yet, so an invite-only pipelined run would not be invite-only; use admission.mode "
                    "= 'open' or a data-parallel run (no [swarm] table)"
                )

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (JSON/msgpack/TOML friendly) that ``RunConfig.from_dict`` accepts back; the ``swarm`` table
        only for a pipelined run."""
        raw = to_plain(dataclasses.asdict(self))
        if not self.pipelined:
            del raw["swarm"]
        return raw

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON form: equal on peers that hold the same config."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunConfig:
        """Validate ``raw`` (e.g. parsed TOML). Raises ValueError naming the first bad field."""
        try:
            return _ADAPTER.validate_python(raw)
        except ValidationError as exc:
            raise ValueError(_describe(exc)) from None


_ADAPTER = TypeAdapter(RunConfig)


def to_plain(value: Any) -> Any:
    """Dataclass-as-dict values with tuples turned into lists (JSON/msgpack/TOML friendly)."""
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "config"
        if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            parts.append(f"{field}: unknown key")
        elif err["type"] == "value_error":
            parts.append(str(err["msg"]).removeprefix("Value error, "))
        else:
            parts.append(f"{field}: {err['msg']} (got {err.get('input')!r})")
    return "invalid run config: " + "; ".join(parts)


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of ``raw`` with dotted-name overrides applied (``{"diloco.inner_steps": 5}``).

    ``None`` values are skipped so that CLI flags left unset change nothing.
    """
    result = json.loads(json.dumps(raw))
    for dotted, value in overrides.items():
        if value is None:
            continue
        node = result
        *parents, leaf = dotted.split(".")
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    return result


def load_run_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Load a run config from a TOML file (or defaults when ``path`` is None) and apply overrides.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: malformed TOML, unknown keys, or values out of range (the message names the field).
    """
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML: {exc}") from None
    return RunConfig.from_dict(apply_overrides(raw, overrides or {}))
