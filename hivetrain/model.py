"""The run's model: a preset, a ``transformers`` config.json or a pretrained directory; and its fingerprint.

``RunConfig.model`` names one of three sources (``resolve_model_source``):

- a preset (below): a small Llama decoder, fresh weights from the run seed;
- a ``config.json`` (or a directory holding one and no weights) of any ``AutoModelForCausalLM`` architecture
  (Llama, Qwen2, GPT-NeoX, ...): fresh weights from the run seed;
- a pretrained directory (``config.json`` plus ``*.safetensors`` weights): the weights are θ₀ (continued
  pretraining), and their sha256 is part of the fingerprint, so peers holding other weights are refused.

Nothing is downloaded and no remote code runs: every file must be on the peer's disk (``join-swarm --model-path``
points at it when it lies elsewhere than the run config says).

Presets are Llama decoders (``LlamaForCausalLM``) with a byte vocabulary (256) by default:

=======  ===========  =====================================================
preset   parameters   meant for
=======  ===========  =====================================================
tiny     ~0.46M       tests
small    ~4.9M        the CPU demo
base     ~154M        a GPU volunteer
=======  ===========  =====================================================

Shapes: ``input_ids`` are ``(B, T)`` int64, logits ``(B, T, vocab)`` float32.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel

if TYPE_CHECKING:
    from hivetrain.config import RunConfig

# Architecture of each preset; vocab_size and max_position_embeddings are filled in by build_config.
PRESETS = ("tiny", "small", "base")
_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=344),
    "small": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, intermediate_size=688),
    "base": dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, intermediate_size=2816),
}


def build_config(preset: str, vocab_size: int = 256, max_seq_len: int = 1024) -> LlamaConfig:
    """The ``LlamaConfig`` of a preset.

    Raises:
        ValueError: unknown preset, or a vocabulary/sequence length that is not positive.
    """
    if preset not in _PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(_PRESETS)}")
    if vocab_size <= 0 or max_seq_len <= 0:
        raise ValueError(f"vocab_size ({vocab_size}) and max_seq_len ({max_seq_len}) must be positive")
    arch = _PRESETS[preset]
    return LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=max_seq_len,
        num_key_value_heads=arch["num_attention_heads"],
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **arch,
    )


def build_model(config: LlamaConfig, seed: int) -> PreTrainedModel:
    """A freshly initialised model whose parameters depend only on ``config``, ``seed`` and the torch version.

    Every peer of a run builds the same initial parameters θ₀ this way; peers still compare state hashes
    (a different torch build could initialise differently) and download state on a mismatch.
    """
    fork_devices: list[int] = []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        except ValueError:  # an architecture without SDPA attention: its default (eager) attention
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model


def model_fingerprint(config: LlamaConfig, model: torch.nn.Module) -> str:
    """sha256 (hex) over the architecture fields of ``config`` and every parameter's name and shape.

    Two peers can average parameters only if their fingerprints are equal.
    """
    arch = {k: v for k, v in sorted(config.to_dict().items()) if k not in _VOLATILE_CONFIG_KEYS}
    shapes = [(name, list(p.shape)) for name, p in model.named_parameters()]
    blob = json.dumps({"arch": arch, "shapes": shapes}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


_VOLATILE_CONFIG_KEYS = {"transformers_version", "torch_dtype", "dtype", "_name_or_path", "_attn_implementation"}


# ---------------------------------------------------------------------------------------------------------------
# The run's model: a preset, a config.json or a pretrained directory.

CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class ModelSource:
    """Where a run's model comes from (see the module docstring).

    Attributes:
        kind: "preset", "config" (fresh weights from a config.json) or "pretrained" (θ₀ = the saved weights).
        name: the preset name, or the resolved path (a directory, or a config.json for kind "config").
        weight_files: the ``*.safetensors`` files of a pretrained directory, sorted; empty otherwise.
    """

    kind: Literal["preset", "config", "pretrained"]
    name: str
    weight_files: tuple[Path, ...] = ()

    @property
    def config_path(self) -> Path | None:
        """The config.json to read (None for a preset)."""
        if self.kind == "preset":
            return None
        path = Path(self.name)
        return path if path.is_file() else path / CONFIG_FILE


def is_model_path(spec: str) -> bool:
    """Whether ``RunConfig.model`` names a path rather than a preset: it holds a '/' or ends in '.json'."""
    return "/" in spec or spec.endswith(".json")


def public_model_name(spec: str) -> str:
    """What the dashboard shows for ``RunConfig.model``: a preset's name, or a path's last directory name (the
    coordinator's local paths are nobody's business)."""
    if not is_model_path(spec):
        return spec
    path = Path(spec)
    return (path.parent.name if path.suffix == ".json" else path.name) or "custom"


def resolve_model_source(spec: str, path_override: str | Path | None = None) -> ModelSource:
    """Resolve ``RunConfig.model`` (or the peer's ``--model-path``, which replaces a path in it) to a ModelSource.

    Args:
        spec: a preset name ("tiny", "small", "base"), a config.json, or a directory holding a config.json and
            optionally ``*.safetensors`` weights.
        path_override: where this machine keeps the run's model files when they are not at ``spec``; ignored for
            presets.

    Raises:
        ValueError: ``spec`` is neither a preset nor a path, or the directory holds ``.bin``/``.pt`` weights only
            (pickles are never loaded; convert them to safetensors).
        FileNotFoundError: the path, or the directory's config.json, does not exist.
    """
    if spec in _PRESETS and not path_override:
        return ModelSource("preset", spec)
    if spec in _PRESETS:
        raise ValueError(f"--model-path is for runs whose model is a path; this run uses the preset {spec!r}")
    if not is_model_path(spec):
        raise ValueError(f"model {spec!r} is neither a preset {list(PRESETS)} nor a path (write ./{spec} for a dir)")
    path = Path(path_override or spec).expanduser()
    if not path.exists():
        hint = "" if path_override else " (on a peer that keeps the model files elsewhere, pass --model-path DIR)"
        raise FileNotFoundError(f"model path {str(path)!r} does not exist{hint}")
    if path.is_file():
        return ModelSource("config", str(path.resolve()))
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} holds no {CONFIG_FILE}")
    weights = tuple(sorted(path.glob("*.safetensors")))
    if not weights and (any(path.glob("*.bin")) or any(path.glob("*.pt"))):
        raise ValueError(
            f"model directory {str(path)!r} holds pickled weights (.bin/.pt) only, which hivetrain never loads; "
            "save them as safetensors (model.save_pretrained(DIR, safe_serialization=True))"
        )
    return ModelSource("pretrained" if weights else "config", str(path.resolve()), weights)


def load_model_config(source: ModelSource, vocab_size: int, max_seq_len: int) -> PretrainedConfig:
    """The ``transformers`` config of ``source`` for a tokenizer of ``vocab_size`` ids and ``max_seq_len`` windows.

    A preset's config is built for exactly that vocabulary and length (as it always was). A config.json keeps its
    own ``vocab_size`` and positions, which must cover the tokenizer and the windows.

    Raises:
        ValueError: the config's ``vocab_size`` is smaller than the tokenizer's, its positions are fewer than
            ``max_seq_len``, or it is not a causal LM config ``transformers`` knows (no remote code is run).
    """
    if source.kind == "preset":
        return build_config(source.name, vocab_size=vocab_size, max_seq_len=max_seq_len)
    path = source.config_path
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"{path}: not a transformers model config ({exc})") from None
    model_vocab = getattr(config, "vocab_size", None)
    if not isinstance(model_vocab, int) or model_vocab < vocab_size:
        raise ValueError(
            f"{path}: vocab_size {model_vocab} does not cover the tokenizer's {vocab_size} ids; raise vocab_size "
            "in the config, or use the tokenizer the model was made for (data.tokenizer)"
        )
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions < max_seq_len:
        raise ValueError(
            f"{path}: max_position_embeddings {positions} is shorter than data.seq_len {max_seq_len}; lower "
            "data.seq_len or raise the config's positions"
        )
    return config


def weights_sha256(files: tuple[Path, ...] | list[Path]) -> str:
    """sha256 (hex) of the tensors in safetensors ``files``: every tensor's name, dtype, shape and bytes, by name.

    Independent of how the weights are sharded across files and of file metadata; reads one tensor at a time.

    Raises:
        ValueError: a tensor name appears in two files, or a file is not valid safetensors.
    """
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if name in where:
                        raise ValueError(f"tensor {name!r} is in both {where[name]} and {path}")
                    where[name] = path
        except (OSError, RuntimeError) as exc:  # safetensors raises its own errors as subclasses of these or Exception
            raise ValueError(f"{path}: not a valid safetensors file ({exc})") from None
    digest = hashlib.sha256()
    handles: dict[Path, object] = {}
    try:
        for name in sorted(where):
            path = where[name]
            if path not in handles:
                handles[path] = safe_open(str(path), framework="pt")
            tensor = handles[path].get_tensor(name)  # type: ignore[attr-defined]
            digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
            digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    finally:
        handles.clear()
    return digest.hexdigest()


class RunModel(NamedTuple):
    """What every peer of a run builds: the ``transformers`` config, the model (θ₀, fp32, CPU or meta), and the
    fingerprint peers compare (``model_fingerprint``, extended with the initial weights' sha256 when pretrained)."""

    config: PretrainedConfig
    model: PreTrainedModel
    fingerprint: str


def set_activation_checkpointing(model: PreTrainedModel, enabled: bool) -> None:
    """Turn activation checkpointing on or off (``DilocoConfig.activation_checkpointing``): in train mode each decoder
    layer keeps only its input and recomputes its activations in the backward pass (``transformers``' gradient
    checkpointing over non-reentrant ``torch.utils.checkpoint``; Chen et al. 2016, "Training Deep Nets with Sublinear
    Memory Cost"). Evaluation (eval mode, no gradients) is unaffected.

    Raises:
        ValueError: ``enabled`` for a model class that does not support it (the message names the setting to change).
    """
    if not enabled:
        if is_activation_checkpointing(model):
            model.activation_checkpointing_disable()
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(model).__name__} does not support activation checkpointing: set diloco.activation_checkpointing "
            "= 'off' (and a smaller data.batch_size if memory is short)"
        )
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False  # a KV cache is for generation; with checkpointing transformers warns on every call


def is_activation_checkpointing(model: torch.nn.Module) -> bool:
    """Whether ``set_activation_checkpointing`` turned it on for ``model`` (False for a model without the feature)."""
    return bool(getattr(model, "is_activation_checkpointing", False))


def build_run_model(
    run_config: RunConfig,
    vocab_size: int,
    *,
    model_path: str | Path | None = None,
    meta: bool = False,
) -> RunModel:
    """Build the run's model θ₀ and fingerprint: the one function every call site (peer, coordinator, export,
    SWARM stage) uses, so they agree.

    Args:
        run_config: its ``model`` (preset or path), ``seed`` (fresh weights) and ``data.seq_len`` are used.
        vocab_size: ids the run's tokenizer produces (256 for bytes); a preset is built for exactly this many, a
            config.json must cover it.
        model_path: this machine's copy of the run's model files when they are not at ``run_config.model``.
        meta: build on the meta device (shapes only, no memory, no weights loaded); the fingerprint is the same.

    Returns:
        RunModel(config, model, fingerprint): fp32 parameters on the CPU (or meta), in train mode as from_config.

    Raises:
        ValueError / FileNotFoundError: see ``resolve_model_source`` and ``load_model_config``; a pretrained
            directory whose weights miss or misfit some of the model's parameters.
    """
    source = resolve_model_source(run_config.model, model_path)
    config = load_model_config(source, vocab_size, run_config.data.seq_len)
    if meta:
        model = _meta_model(config)
    elif source.kind == "pretrained":
        model = _load_pretrained(source, config, run_config.seed)
    else:
        model = build_model(config, seed=run_config.seed)
    return RunModel(config, model, source_fingerprint(source, config, model))


def source_fingerprint(source: ModelSource, config: PretrainedConfig, model: torch.nn.Module) -> str:
    """``model_fingerprint`` (architecture and shapes), and for a pretrained source the sha256 of its weights too.

    A preset's or config.json's fingerprint is ``model_fingerprint(config, model)`` unchanged; a pretrained start's is
    sha256 over that and ``weights_sha256(source.weight_files)``, so peers whose θ₀ differs never average together.
    """
    fingerprint = model_fingerprint(config, model)
    if source.kind == "pretrained":
        blob = json.dumps({"arch": fingerprint, "weights_sha256": weights_sha256(source.weight_files)})
        fingerprint = hashlib.sha256(blob.encode()).hexdigest()
    return fingerprint


def _load_pretrained(source: ModelSource, config: PretrainedConfig, seed: int) -> PreTrainedModel:
    fork_devices: list[int] = []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)  # nothing should be left to chance, but if it is, every peer draws the same
        model, info = AutoModelForCausalLM.from_pretrained(
            source.name,
            config=config,
            local_files_only=True,
            trust_remote_code=False,
            use_safetensors=True,
            dtype=torch.float32,
            output_loading_info=True,
        )
    missing = list(info.get("missing_keys") or []) + [str(k) for k in info.get("mismatched_keys") or []]
    if missing:
        raise ValueError(
            f"{source.name}: the weights do not cover the model (missing or misfit: {missing[:3]}); θ₀ of a "
            "pretrained start must come entirely from its safetensors files"
        )
    model.train()
    return model


def describe_run_model(
    run_config: RunConfig, vocab_size: int, model_path: str | Path | None = None
) -> tuple[PretrainedConfig, int]:
    """(config, trainable scalars) of the run's model, from the meta device: no memory, no weights read.

    Raises: as ``build_run_model``.
    """
    source = resolve_model_source(run_config.model, model_path)
    config = load_model_config(source, vocab_size, run_config.data.seq_len)
    return config, count_parameters(_meta_model(config))


def _meta_model(config: PretrainedConfig) -> PreTrainedModel:
    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        except ValueError:  # no SDPA for this architecture
            return AutoModelForCausalLM.from_config(config)


def count_parameters(model: torch.nn.Module) -> int:
    """Number of trainable scalars."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@torch.no_grad()
def evaluate(model: PreTrainedModel, windows_NT: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats per token) of ``model`` on ``windows_NT``.

    Args:
        windows_NT: (N, T+1) int64 token windows; inputs are [:, :-1], targets [:, 1:].
        batch_size: windows per forward pass.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, windows_NT.shape[0], batch_size):
        batch = windows_NT[start : start + batch_size].to(device)
        loss = lm_loss(model, batch)
        total += loss.item() * batch.shape[0]
        count += batch.shape[0]
    model.train(was_training)
    return total / max(count, 1)


def lm_loss(model: PreTrainedModel, windows_BT1: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy (nats, scalar) on (B, T+1) windows."""
    logits_BTV = model(input_ids=windows_BT1[:, :-1]).logits
    targets_BT = windows_BT1[:, 1:]
    return torch.nn.functional.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten())
