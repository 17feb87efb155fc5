"""The run's configuration: one frozen dataclass per component, loaded from one TOML file.

A run is described by a TOML file (see ``configs/*.toml``) with one table per component::

    run_id = "demo"
    model = "small"
    [data]      -> DataConfig
    [diloco]    -> DilocoConfig
    [averaging] -> AveragingConfig
    [admission] -> AdmissionConfig (who may join; open by default)
    [swarm]     -> SwarmConfig (optional: present = a SWARM pipeline run, ``hivetrain.swarm.config``)

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
from typing import Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from hivetrain.averaging.config import AveragingConfig
from hivetrain.peers.membership import peer_id_problem
from hivetrain.swarm.config import NOT_PIPELINED, SwarmConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_STRICT = ConfigDict(extra="forbid")

MODEL_PRESETS = ("tiny", "small", "base")


@dataclass(frozen=True, config=_STRICT)
class DataConfig:
    """Training data and batching.

    Args:
        paths: text files, .jsonl/.json/.parquet/.arrow record files, directories (searched recursively for text
            files and .jsonl/.parquet/.arrow) or globs; empty = this machine's Python standard library sources
            (real text every machine has). Read as streams: a corpus may be far bigger than memory.
        text_field: the field of a record (in .jsonl/.json/.parquet/.arrow files) that holds its text.
        tokenizer: path of a local ``transformers`` tokenizer directory; empty = bytes (vocabulary 256).
        seq_len: tokens per training window.
        batch_size: windows per inner step (samples per inner step).
        num_eval_windows: held-out windows every peer evaluates on (the same windows on every peer).
        eval_fraction: fraction of the corpus's documents held out for evaluation, chosen by a hash of their content
            (the same documents on every peer; ``hivetrain.data.stream``).
        max_corpus_bytes: use at most about this many bytes of files, the first in sorted order (0 = no limit;
            memory does not depend on it).
        shuffle_windows: windows in each peer's shuffle buffer (memory: this x (seq_len + 1) tokens).
    """

    paths: tuple[str, ...] = ()
    text_field: str = Field(default="text", min_length=1, max_length=256)
    tokenizer: str = ""
    seq_len: int = Field(default=128, ge=8, le=65536)
    batch_size: int = Field(default=8, ge=1, le=4096)
    num_eval_windows: int = Field(default=32, ge=1, le=100_000)
    eval_fraction: float = Field(default=0.02, gt=0.0, lt=0.5)
    max_corpus_bytes: int = Field(default=0, ge=0)
    shuffle_windows: int = Field(default=512, ge=1, le=1_000_000)


MAX_DOWNLOADERS_DEFAULT = 16
"""``diloco.max_downloaders``'s default: peers one donor serves at once (measured: dev/LOG.md, 2026-11-29)."""


@dataclass(frozen=True, config=_STRICT)
class DilocoConfig:
    """DiLoCo hyper-parameters (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of LMs").

    Args:
        inner_steps: H, inner AdamW steps between outer steps.
        inner_lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warmup of the inner learning rate, in inner steps.
        total_inner_steps: length of the cosine decay in inner steps; 0 = outer_steps * inner_steps.
        min_lr_ratio: floor of the cosine decay as a fraction of inner_lr (kept > 0 so open-ended runs still learn).
        grad_clip: max global gradient norm per inner step; 0 = no clipping.
        outer_lr: outer SGD learning rate. Default 1.0 with ``outer_momentum`` 0: plain averaging of the peers'
            updates, the best or within noise of the best setting at every length that
            ``scripts/bench/diloco_vs_ddp.py`` measured (10 to 120 outer steps, tiny and small presets; dev/LOG.md,
            2026-11-25). The paper's 0.7 with momentum 0.9 (tuned on a 150M model, H = 500) ended 5-14 points
            further behind tuned data parallelism there (e.g. +11.1% vs +5.6% eval loss at 10 outer steps).
        outer_momentum: outer Nesterov momentum (see ``outer_lr``; paper: 0.9).
        outer_steps: stop after this many outer steps (epochs); 0 = train until stopped.
        eval_every: evaluate on the held-out windows every this many outer steps; 0 = only at start and end.
        schedule: when a peer ends its inner phase. "swarm" (default): when the samples that all live peers have
            computed at this epoch reach ``target_samples_per_epoch`` (estimated from the progress and throughput
            every peer publishes, as hivemind's ``ProgressTracker``), so every peer ends at about the same time and a
            fast peer runs more inner steps than a slow one (Async Local-SGD's dynamic local updates, Liu et al.
            2024). "steps": every peer runs exactly ``inner_steps`` inner steps (the paper's fixed H; slow peers
            arrive late).
        target_samples_per_epoch: the swarm's samples per epoch for ``schedule = "swarm"``; 0 = ``inner_steps *
            data.batch_size * grad_accum_steps`` times the number of live trainers at the epoch (equal peers then run
            H steps each).
        overlap: "off" = the peer waits for its epoch's round before the next inner phase. "delayed" = the next inner
            phase starts at once from the newest shared θ while the round runs in the background (the averaged
            update lands one epoch late). "eager" = the same, but the next phase starts from θ advanced by an
            estimate of the average in flight: the previous average with our own share replaced by our new
            pseudo-gradient (Kale et al. 2025, "Eager updates for overlapped communication and computation in
            DiLoCo"). The shared state stays bit-identical across peers in every mode.
        precision: the compute precision of the inner steps' forward and backward passes (``diloco/inner.py``).
            "auto" (default): bf16 autocast on CUDA GPUs with native bf16 (compute capability 8.0+), fp16 autocast
            with a gradient scaler on older CUDA GPUs, fp32 on CPUs and other devices (so CPU peers compute exactly
            as without autocast). "fp32": no autocast anywhere. "bf16": bf16 autocast on every peer, CPUs included
            (torch autocasts there too; slow on CPUs without bf16 instructions). "fp16": fp16 autocast with a
            gradient scaler (steps with Inf/NaN gradients are skipped and counted); a peer without a CUDA GPU
            refuses to start with a ValueError rather than silently train in another precision. Parameters, AdamW
            state, θ, the outer momentum and the pseudo-gradient stay fp32 in every mode, so peers of one run may
            use different precisions (mixed GPU/CPU swarms: keep "auto") and still hold bit-identical state. Why:
            bf16 autocast roughly halves activation memory and runs on a GPU's tensor cores.
        grad_accum_steps: microbatches per inner step (gradient accumulation). Each inner step averages the
            gradients of ``grad_accum_steps`` microbatches of ``data.batch_size`` windows, so an inner step
            trains on ``data.batch_size * grad_accum_steps`` samples (the weight a peer claims counts them all)
            while activations are held for one microbatch. Default 1 (no accumulation). Why: a large batch that
            does not fit in device memory.
        max_carried_phases: the most inner phases one contribution holds. A round that fails while nobody moved on
            carries the peer's pseudo-gradient into its next round, merged with the next phase's as their
            sample-weighted mean (``diloco.rounds.Contribution``); when a new phase would make more than this many,
            the oldest carried phase is dropped and counted in ``samples_discarded``. 1 = never carry. Default 4:
            phases carried at one epoch are estimates of one update from one θ, so each more only averages noise
            down (the mean of k has sqrt(1/k) of one's noise: the 5th phase would cut it by 11% more, the 2nd by
            29%), while the peer trains for k phases without an outer step and holds one fp32 copy of the
            parameters per phase; four phases cover rounds missed for three phases in a row (issue 22 saw six, on
            a machine at load 7-18 whose matchmaking could not converge).
        max_downloaders: a peer serves its state's chunks to at most this many downloading peers at once (0 = no
            cap; ``diloco.state_sync.StateServer``). A joiner refused as one too many takes its chunks from the other
            holders, so no donor serves more than its share of a flash crowd. Default ``MAX_DOWNLOADERS_DEFAULT``
            (measured in the simulator's flash crowd: dev/LOG.md, 2026-11-29 session 13).
    """

    inner_steps: int = Field(default=50, ge=1, le=1_000_000)
    inner_lr: float = Field(default=1e-3, gt=0.0, le=1.0)
    weight_decay: float = Field(default=0.1, ge=0.0, le=1.0)
    warmup_steps: int = Field(default=20, ge=0)
    total_inner_steps: int = Field(default=0, ge=0)
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    grad_clip: float = Field(default=1.0, ge=0.0)
    outer_lr: float = Field(default=1.0, gt=0.0, le=10.0)
    outer_momentum: float = Field(default=0.0, ge=0.0, lt=1.0)
    outer_steps: int = Field(default=0, ge=0)
    eval_every: int = Field(default=1, ge=0)
    schedule: Literal["steps", "swarm"] = "swarm"
    target_samples_per_epoch: int = Field(default=0, ge=0)
    overlap: Literal["off", "delayed", "eager"] = "off"
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    grad_accum_steps: int = Field(default=1, ge=1, le=4096)
    max_carried_phases: int = Field(default=4, ge=1, le=64)
    max_downloaders: int = Field(default=MAX_DOWNLOADERS_DEFAULT, ge=0, le=4096)

    def samples_per_inner_step(self, batch_size: int) -> int:
        """Samples (windows) one inner step trains on: ``batch_size`` (``data.batch_size``) * ``grad_accum_steps``."""
        return batch_size * self.grad_accum_steps

    def schedule_length(self) -> int:
        """Inner steps over which the cosine schedule decays (at least the warmup)."""
        length = self.total_inner_steps or self.outer_steps * self.inner_steps or 100_000
        return max(length, self.warmup_steps + 1)


@dataclass(frozen=True, config=_STRICT)
class AdmissionConfig:
    """Who may take part in the run (``hivetrain.peers.membership``; README "Running a public run safely").

    Args:
        mode: "open" (default): anyone who knows the address. "allowlist": only the peer IDs in ``allowlist``.
            "token": those, plus peers holding a join token for their own peer ID signed by ``issuer``
            (``hivetrain coordinator invite PEER_ID``). Every honest peer drops the DHT records of non-members, never
            groups with them, refuses their data-plane connections and neither downloads state from nor serves it to
            them. The issuer (the coordinator) is always a member.
        allowlist: base58 peer IDs (``hivetrain identity show`` prints a volunteer's), at most 4096.
        issuer: base58 peer ID whose signed join tokens count; "" = the run's coordinator (the signer of the run
            config record the joiner trusts; the coordinator itself uses its own identity).
    """

    mode: Literal["open", "allowlist", "token"] = "open"
    allowlist: tuple[str, ...] = Field(default=(), max_length=4096)
    issuer: str = ""

    def __post_init__(self) -> None:
        for i, peer_id in enumerate(self.allowlist):
            problem = peer_id_problem(peer_id)
            if problem:
                raise ValueError(f"admission.allowlist[{i}]: {problem}")
        if self.issuer and peer_id_problem(self.issuer):
            raise ValueError(f"admission.issuer: {peer_id_problem(self.issuer)}")
        if len(set(self.allowlist)) != len(self.allowlist):
            raise ValueError("admission.allowlist lists a peer ID twice")
        if self.mode == "allowlist" and not self.allowlist:
            raise ValueError(
                "admission.mode = 'allowlist' with an empty admission.allowlist would admit nobody but the "
                "coordinator: list the members' peer IDs (`hivetrain identity show` prints one) or use mode 'token'"
            )


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
                )
                if value not in default
            ]
            if ignored:
                raise ValueError(
                    f"{', '.join(ignored)} with a [swarm] table: SWARM stage servers compute in fp32 without gradient "
                    "accumulation or overlapped rounds; remove these settings (or the [swarm] table)"
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
