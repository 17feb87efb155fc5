"""Export a checkpoint's θ as a standard ``transformers`` model directory (``hivetrain export CKPT --out DIR``).

The directory holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (θ only, fp32; the outer
momentum stays behind) and a ``README.md`` saying how to tokenize: hivetrain's default tokenizer is raw UTF-8 bytes
(token id = byte value, vocabulary 256), so no tokenizer files are needed::

    model = AutoModelForCausalLM.from_pretrained(DIR)
    ids = torch.tensor([list("def main".encode())])
    text = bytes(model.generate(ids, max_new_tokens=64)[0].tolist()).decode("utf-8", errors="replace")

A checkpoint is verified (sha256, safetensors, state hash; see ``checkpoint.py``) before anything is exported, and
the directory appears atomically (written under a temporary name, then renamed).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import LlamaConfig, PreTrainedModel

from hivetrain.coordinator.checkpoint import (
    MANIFEST_FILE,
    STATE_FILE,
    CheckpointInvalid,
    CheckpointStore,
    load_checkpoint,
)
from hivetrain.diloco.state import TrainingState
from hivetrain.model import build_config, build_model, model_fingerprint

logger = logging.getLogger(__name__)

DEFAULT_MAX_SEQ_LEN = 1024
_EMBEDDING = "model.embed_tokens.weight"


def export_transformers(
    source: Path | str | TrainingState,
    model: str | LlamaConfig | None,
    out_dir: Path | str,
    *,
    max_seq_len: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write θ of a checkpoint (or of a TrainingState) as a ``transformers`` model directory.

    Args:
        source: a checkpoint directory (``epoch-N``), a checkpoint store root (its newest valid checkpoint is
            used), or a TrainingState.
        model: a preset name ("tiny", "small", "base"), a ready ``LlamaConfig``, or None = the preset in the
            checkpoint's run config.
        out_dir: the directory to create.
        max_seq_len: positions in the exported config (tokens); None = the run config's ``data.seq_len``, else
            1024. Ignored when ``model`` is a LlamaConfig. The vocabulary size is read from the embedding.
        overwrite: replace ``out_dir`` if it exists.

    Returns:
        ``out_dir``.

    Raises:
        FileNotFoundError: ``source`` does not exist or holds no valid checkpoint.
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
        ValueError: the model cannot be determined, θ does not fit it, or the checkpoint's model fingerprint
            differs from the rebuilt model's (wrong preset or sequence length).
        CheckpointInvalid: ``source`` is a checkpoint directory that fails verification.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True (--force) to replace it")
    run_config: dict[str, Any] = {}
    manifest: dict[str, Any] = {}
    if isinstance(source, TrainingState):
        state = source
    else:
        state, manifest = _load_source(Path(source))
        run_config = manifest.get("run_config") or {}
    vocab_size = state.params[_EMBEDDING].shape[0] if _EMBEDDING in state.params else None
    config = _resolve_config(model, vocab_size, run_config, max_seq_len)
    hf_model = _model_with_params(config, state)
    expected = manifest.get("model_fingerprint")
    if expected and model_fingerprint(config, hf_model) != expected:
        raise ValueError(
            "the rebuilt model's fingerprint differs from the checkpoint's; pass the preset and --max-seq-len "
            "the run used"
        )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        hf_model.save_pretrained(tmp, safe_serialization=True)
        (tmp / "README.md").write_text(_readme(config, state, manifest))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("exported epoch %d (%s) to %s", state.epoch, state.state_hash()[:16], out_dir)
    return out_dir


def _load_source(path: Path) -> tuple[TrainingState, dict[str, Any]]:
    """(state, manifest) of a checkpoint directory or of the newest valid checkpoint under a store root."""
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    is_checkpoint = (path / MANIFEST_FILE).exists() or (path / STATE_FILE).exists()
    candidate = path
    if not is_checkpoint:
        newest = next((c for c in CheckpointStore(path, keep_last=1).list(verify=False) if c.status == "ok"), None)
        if newest is None:
            raise FileNotFoundError(f"{path} holds no complete checkpoint")
        candidate = newest.path
    try:
        run_config = json.loads((candidate / MANIFEST_FILE).read_text()).get("run_config")
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointInvalid("torn", f"{candidate / MANIFEST_FILE}: {exc}") from None
    run_config = run_config if isinstance(run_config, dict) else {}
    # A reference model built from the run config gives the names and shapes the loaded tensors must have.
    config = _resolve_config(run_config.get("model"), _header_vocab_size(candidate / STATE_FILE), run_config, None)
    reference = TrainingState.from_model(build_model(config, seed=0))
    if is_checkpoint:
        return load_checkpoint(path, reference)
    loaded = CheckpointStore(path, keep_last=1).load_latest(reference)
    if loaded is None:
        raise FileNotFoundError(f"{path} holds no valid checkpoint (see the warnings above)")
    return loaded


def _header_vocab_size(state_path: Path) -> int | None:
    """Rows of the embedding, read from the safetensors header only (None if unreadable; the full load decides)."""
    try:
        with safe_open(str(state_path), framework="pt") as f:
            return int(f.get_slice(_EMBEDDING).get_shape()[0])
    except Exception:  # noqa: BLE001 - any damage is reported by the verified load that follows
        return None


def _resolve_config(
    model: str | LlamaConfig | None, vocab_size: int | None, run_config: dict[str, Any], max_seq_len: int | None
) -> LlamaConfig:
    if isinstance(model, LlamaConfig):
        return model
    preset = model or run_config.get("model")
    if not preset:
        raise ValueError("no model preset given and none in the checkpoint's run config")
    data = run_config.get("data") if isinstance(run_config.get("data"), dict) else {}
    seq_len = max_seq_len or data.get("seq_len") or DEFAULT_MAX_SEQ_LEN
    return build_config(str(preset), vocab_size=int(vocab_size or 256), max_seq_len=int(seq_len))


def _model_with_params(config: LlamaConfig, state: TrainingState) -> PreTrainedModel:
    model = build_model(config, seed=0)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    got = {n: tuple(t.shape) for n, t in state.params.items()}
    if expected != got:
        diff = sorted(set(expected.items()) ^ set(got.items()))[:3]
        raise ValueError(f"θ does not fit the {config.model_type} config: differing (name, shape) {diff}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(state.params[name])
    return model


def _readme(config: LlamaConfig, state: TrainingState, manifest: dict[str, Any]) -> str:
    run = manifest.get("run_config") or {}
    byte_level = not (run.get("data") or {}).get("tokenizer") and config.vocab_size == 256
    tokenizer = (
        "Byte-level: token id = UTF-8 byte value, vocabulary 256, no special tokens. Encode with\n"
        '`list(text.encode("utf-8"))`, decode with `bytes(ids).decode("utf-8", errors="replace")`.'
        if byte_level
        else f"Vocabulary {config.vocab_size}: use the tokenizer the run was trained with ({run.get('data', {})})."
    )
    return (
        f"# hivetrain export: run `{run.get('run_id', 'unknown')}`, epoch {state.epoch}\n\n"
        f"Llama decoder ({sum(t.numel() for t in state.params.values()):,} parameters, fp32), trained with\n"
        "DiLoCo by hivetrain volunteers. Only θ is exported (no optimizer or outer momentum).\n\n"
        "## Tokenizer\n\n"
        f"{tokenizer}\n\n"
        "## Load\n\n"
        "```python\n"
        "import torch\n"
        "from transformers import AutoModelForCausalLM\n"
        'model = AutoModelForCausalLM.from_pretrained("THIS_DIRECTORY")\n'
        'ids = torch.tensor([list("def main".encode())])\n'
        'print(bytes(model.generate(ids, max_new_tokens=64, do_sample=False)[0].tolist()).decode("utf-8", "replace"))\n'
        "```\n\n"
        "## Provenance\n\n"
        f"- state hash (θ + momentum): `{state.state_hash()}`\n"
        f"- model fingerprint: `{manifest.get('model_fingerprint') or 'n/a'}`\n"
        f"- max sequence length: {config.max_position_embeddings} tokens\n"
    )


def run_export(args_list: list[str]) -> int:
    """``hivetrain export CKPT --out DIR``: returns the exit code (0 ok, 1 export failed, 2 bad arguments)."""
    parser = argparse.ArgumentParser(
        prog="hivetrain export",
        description="Export a checkpoint's parameters as a transformers model directory (from_pretrained-ready).",
    )
    parser.add_argument("checkpoint", type=Path, help="a checkpoint directory (epoch-N) or a checkpoint store root")
    parser.add_argument("--out", type=Path, required=True, help="output directory to create")
    parser.add_argument("--preset", choices=("tiny", "small", "base"), help="model preset; default: the run config's")
    parser.add_argument(
        "--max-seq-len", type=int, help="positions in the exported config, tokens; default: the run's data.seq_len"
    )
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return int(exc.code or 0)
    if args.max_seq_len is not None and args.max_seq_len <= 0:
        print("hivetrain export: --max-seq-len must be a positive number of tokens", file=sys.stderr)
        return 2
    try:
        out = export_transformers(
            args.checkpoint, args.preset, args.out, max_seq_len=args.max_seq_len, overwrite=args.force
        )
    except (OSError, ValueError, CheckpointInvalid) as exc:
        print(f"hivetrain export: {exc}", file=sys.stderr)
        return 1
    print(f"exported to {out}")
    return 0
