"""Export a checkpoint's θ as a standard ``transformers`` model directory (``hivetrain export CKPT --out DIR``).

The directory holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (θ only, fp32; the outer
momentum stays behind), the run's tokenizer (``tokenizer.json``, ``tokenizer_config.json``) and a ``README.md``,
so that ``pipeline("text-generation", model=DIR)`` works with no glue code::

    from transformers import pipeline
    print(pipeline("text-generation", model=DIR)("def main", max_new_tokens=64)[0]["generated_text"])

The tokenizer is the run's ``data.tokenizer`` directory (``--tokenizer`` if it lies elsewhere here), or, for a byte
run, a 256-id tokenizer that maps id i to byte i both ways (``byte_tokenizer``): the same ids hivetrain trained on.

A checkpoint is verified (sha256, safetensors, state hash; see ``checkpoint.py``) before anything is exported, and
the directory appears atomically (written under a temporary name, then renamed).

Memory: a checkpoint is exported a piece at a time (``_write_weights``: θ's bytes copied from the checkpoint's state
file into ``model.safetensors`` 8 MiB at a time, the model described on the meta device), so the machine that hosts
a run's coordinator can export a model larger than its memory (a 7B checkpoint: 56 GB on disk, 28 GB exported). A
``TrainingState`` given directly is in memory already and goes through ``transformers``' ``save_pretrained``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from hivetrain.coordinator.checkpoint import MANIFEST_FILE, STATE_FILE, CheckpointInvalid, CheckpointStore
from hivetrain.coordinator.checkpoint_format import verify_checkpoint
from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_file import PIECE_BYTES, StateFileInvalid, read_safetensors_header
from hivetrain.model import (
    PRESETS,
    ModelSource,
    _meta_model,
    build_config,
    build_model,
    load_model_config,
    resolve_model_source,
    source_fingerprint,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_SEQ_LEN = 1024
WEIGHTS_FILE = "model.safetensors"
_EMBEDDING = "model.embed_tokens.weight"


def export_transformers(
    source: Path | str | TrainingState,
    model: str | PretrainedConfig | None,
    out_dir: Path | str,
    *,
    max_seq_len: int | None = None,
    overwrite: bool = False,
    tokenizer: str | Path | None = None,
) -> Path:
    """Write θ of a checkpoint (or of a TrainingState) as a ``transformers`` model directory.

    Args:
        source: a checkpoint directory (``epoch-N``), a checkpoint store root (its newest valid checkpoint is
            used), or a TrainingState.
        model: a preset name ("tiny", "small", "base"), a model path as in ``RunConfig.model`` (this machine's copy
            of the run's config.json or model directory), a ready ``transformers`` config, or None = the run
            config's ``model``.
        out_dir: the directory to create.
        max_seq_len: positions in a preset's exported config (tokens); None = the run config's ``data.seq_len``,
            else 1024. A config.json keeps its own. The vocabulary size of a preset is read from the embedding.
        overwrite: replace ``out_dir`` if it exists.
        tokenizer: a local ``transformers`` tokenizer directory to write into ``out_dir``; None = the run config's
            ``data.tokenizer``, and if that is empty (or there is no run config) the byte tokenizer.

    Returns:
        ``out_dir``.

    Raises:
        FileNotFoundError: ``source`` does not exist or holds no valid checkpoint.
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
        ValueError: the model cannot be determined, θ does not fit it, the checkpoint's model fingerprint
            differs from the rebuilt model's (wrong preset, sequence length or model files), or the tokenizer has
            more ids than the model's vocabulary.
        FileNotFoundError: also when the run's tokenizer directory or model files are not on this machine.
        CheckpointInvalid: ``source`` is a checkpoint directory that fails verification.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True (--force) to replace it")
    run_config: dict[str, Any] = {}
    manifest: dict[str, Any] = {}
    hf_model: PreTrainedModel | None = None
    if isinstance(source, TrainingState):
        state = source
        epoch, state_hash = state.epoch, state.state_hash()
        vocab_size = state.params[_EMBEDDING].shape[0] if _EMBEDDING in state.params else None
        config, model_source = _resolve_config(model, vocab_size, run_config, max_seq_len)
        hf_model = _model_with_params(config, state)
        described: torch.nn.Module = hf_model
    else:
        checkpoint, manifest, verified = _verified_checkpoint(Path(source))
        run_config = manifest.get("run_config") or {}
        epoch, state_hash = int(manifest["epoch"]), str(manifest["state_hash"])
        vocab_size = _header_vocab_size(checkpoint / STATE_FILE)
        config, model_source = _resolve_config(model, vocab_size, run_config, max_seq_len)
        described = _meta_model(config)
        _check_fits(config, described, manifest["param_names"], checkpoint / STATE_FILE)
    expected = manifest.get("model_fingerprint")
    if expected and model_source is not None and source_fingerprint(model_source, config, described) != expected:
        raise ValueError(
            "the rebuilt model's fingerprint differs from the checkpoint's; pass the model (--model: preset or "
            "this machine's copy of the run's model files) and --max-seq-len the run used"
        )
    hf_tokenizer = _tokenizer(tokenizer, run_config)
    if len(hf_tokenizer) > config.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(hf_tokenizer)} ids but the model's vocabulary is {config.vocab_size}; "
            "pass the tokenizer the run trained with (--tokenizer)"
        )
    num_parameters = sum(p.numel() for p in described.parameters())

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if hf_model is not None:
            hf_model.save_pretrained(tmp, safe_serialization=True)
        else:
            tmp.mkdir()
            _write_weights(checkpoint / STATE_FILE, described, tmp / WEIGHTS_FILE, verified)
            _save_configs(config, described, tmp)
        hf_tokenizer.save_pretrained(tmp)
        (tmp / "README.md").write_text(_readme(config, epoch, state_hash, num_parameters, manifest, hf_tokenizer))
        umask = os.umask(0)
        os.umask(umask)
        for path in tmp.iterdir():  # readable as any file this user writes (safetensors wrote the weights 0600)
            if path.is_file():
                path.chmod(0o666 & ~umask)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("exported epoch %d (%s) to %s", epoch, state_hash[:16], out_dir)
    planned = int((run_config.get("diloco") or {}).get("outer_steps") or 0)
    if planned > epoch:
        logger.warning(
            "epoch %d is the newest checkpoint here, but the run was set for %d outer steps: if it got further, its "
            "coordinator did not save the rest (see its log)",
            epoch,
            planned,
        )
    return out_dir


def _file_identity(stat: os.stat_result) -> tuple[int, int, int, int]:
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def _verified_checkpoint(path: Path) -> tuple[Path, dict[str, Any], tuple[int, int, int, int] | None]:
    """(directory, manifest, the state file's identity when verified) of a checkpoint directory, or of the newest
    checkpoint under a store root that passes every check (``verify_checkpoint``: read a piece at a time; skipped ones
    are logged with the reason). The identity lets the copy check that it reads the file that was verified.

    Raises:
        FileNotFoundError: ``path`` is no directory, or holds no valid checkpoint.
        CheckpointInvalid: ``path`` is a checkpoint directory that fails a check.
    """
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    if (path / MANIFEST_FILE).exists() or (path / STATE_FILE).exists():
        try:
            identity = _file_identity(os.stat(path / STATE_FILE))
        except FileNotFoundError:
            identity = None  # verify_checkpoint says what is missing
        return path, verify_checkpoint(path), identity
    listed = [c for c in CheckpointStore(path, keep_last=1).list(verify=False) if c.status == "ok"]
    if not listed:
        raise FileNotFoundError(f"{path} holds no complete checkpoint")
    for candidate in listed:
        try:
            identity = _file_identity(os.stat(candidate.path / STATE_FILE))
            return candidate.path, verify_checkpoint(candidate.path, expected_epoch=candidate.epoch), identity
        except FileNotFoundError as exc:  # pruned by its coordinator meanwhile
            logger.warning("skipping checkpoint %s: %s", candidate.path, exc)
        except CheckpointInvalid as exc:
            logger.warning("skipping checkpoint %s: %s", candidate.path, exc)
    raise FileNotFoundError(f"{path} holds no valid checkpoint (see the warnings above)")


def _check_fits(config: PretrainedConfig, meta: torch.nn.Module, names: list[str], state_path: Path) -> None:
    """θ in the checkpoint has exactly the (meta) model's parameter names and shapes.

    Raises:
        ValueError: it does not (names the first differences).
    """
    fd = os.open(state_path, os.O_RDONLY)
    try:
        _, entries = read_safetensors_header(fd, os.fstat(fd).st_size)
    except StateFileInvalid as exc:
        raise CheckpointInvalid("tampered", f"{STATE_FILE}: {exc.reason}") from None
    finally:
        os.close(fd)
    expected = {n: tuple(p.shape) for n, p in meta.named_parameters()}
    got = {n: entries[n][0] for n in names if n in entries}
    if expected != got or list(expected) != names:
        diff = sorted(set(expected.items()) ^ set(got.items()))[:3] or "the order of the parameters"
        raise ValueError(f"θ does not fit the {config.model_type} config: differing (name, shape) {diff}")


def _write_weights(
    state_path: Path, meta: torch.nn.Module, dst: Path, verified: tuple[int, int, int, int] | None = None
) -> None:
    """``model.safetensors`` of θ (fp32, the model's parameter names in its order, ``{"format": "pt"}`` metadata as
    ``transformers`` writes and expects), its bytes copied from the checkpoint's state file ``PIECE_BYTES`` at a time.
    The outer momentum stays behind.

    Raises:
        CheckpointInvalid: ("torn") the state file is not the one ``verified`` describes (its coordinator replaced
            it since): export again.
    """
    src = os.open(state_path, os.O_RDONLY)
    try:
        if verified is not None and _file_identity(os.fstat(src)) != verified:
            raise CheckpointInvalid(
                "torn", f"{state_path} changed after it was verified (being rewritten?): export again"
            )
        data_start, entries = read_safetensors_header(src, os.fstat(src).st_size)
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, p in meta.named_parameters():
            size = p.numel() * 4
            header[name] = {"dtype": "F32", "shape": list(p.shape), "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
        with open(dst, "wb") as out:
            out.write(len(blob).to_bytes(8, "little") + blob)
            for name, _ in meta.named_parameters():
                _, start, end = entries[name]
                for piece in range(start, end, PIECE_BYTES):
                    out.write(os.pread(src, min(PIECE_BYTES, end - piece), data_start + piece))
            out.flush()
            os.fsync(out.fileno())
    finally:
        os.close(src)


def _save_configs(config: PretrainedConfig, meta: torch.nn.Module, out_dir: Path) -> None:
    """``config.json`` and ``generation_config.json`` as ``save_pretrained`` writes them for the model."""
    from transformers import GenerationConfig

    config = copy.deepcopy(config)
    config.architectures = [type(meta).__name__]
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    if getattr(meta, "can_generate", lambda: False)():
        GenerationConfig.from_model_config(config).save_pretrained(out_dir)


def _header_vocab_size(state_path: Path) -> int | None:
    """Rows of the embedding, read from the safetensors header only (None if unreadable; the full load decides)."""
    try:
        with safe_open(str(state_path), framework="pt") as f:
            return int(f.get_slice(_EMBEDDING).get_shape()[0])
    except Exception:  # noqa: BLE001 - any damage is reported by the verified load that follows
        return None


def _resolve_config(
    model: str | PretrainedConfig | None,
    vocab_size: int | None,
    run_config: dict[str, Any],
    max_seq_len: int | None,
) -> tuple[PretrainedConfig, ModelSource | None]:
    """(config, source) of the exported model; source None for a ready config (no fingerprint to check then)."""
    if isinstance(model, PretrainedConfig):
        return model, None
    spec = str(model or run_config.get("model") or "")
    if not spec:
        raise ValueError("no model given and none in the checkpoint's run config")
    data = run_config.get("data") if isinstance(run_config.get("data"), dict) else {}
    seq_len = int(max_seq_len or data.get("seq_len") or DEFAULT_MAX_SEQ_LEN)
    if spec in PRESETS:
        return build_config(spec, vocab_size=int(vocab_size or 256), max_seq_len=seq_len), ModelSource("preset", spec)
    source = resolve_model_source(spec)  # FileNotFoundError names the path: pass --model with this machine's copy
    return load_model_config(source, 1, seq_len), source


def _tokenizer(path: str | Path | None, run_config: dict[str, Any]) -> PreTrainedTokenizerBase:
    """The tokenizer to export: ``path``, else the run's ``data.tokenizer``, else the byte tokenizer."""
    data = run_config.get("data") if isinstance(run_config.get("data"), dict) else {}
    path = path or data.get("tokenizer") or ""
    if not path:
        return byte_tokenizer()
    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"tokenizer directory {str(path)!r} (the run's data.tokenizer) is not on this machine; pass --tokenizer DIR"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)


def byte_tokenizer() -> PreTrainedTokenizerBase:
    """A ``transformers`` fast tokenizer of hivetrain's byte tokens: id i is byte i (vocabulary 256), both ways.

    ``encode(text)`` gives ``list(text.encode("utf-8"))``; ``decode(ids)`` gives
    ``bytes(ids).decode("utf-8", errors="replace")`` (a stray byte becomes one U+FFFD, its neighbours stay intact).
    Built from ``tokenizers``' byte-level pre-tokenizer and decoder (each byte is one printable stand-in symbol)
    over a BPE model with no merges; the ByteFallback alternative replaces a whole run of bytes with U+FFFD as soon
    as one of them is not valid UTF-8, which would garble generated text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={symbols[i]: i for i in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the symbols ``tokenizers``' ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _model_with_params(config: PretrainedConfig, state: TrainingState) -> PreTrainedModel:
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


def _readme(
    config: PretrainedConfig,
    epoch: int,
    state_hash: str,
    num_parameters: int,
    manifest: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
) -> str:
    run = manifest.get("run_config") or {}
    tokenizer_path = (run.get("data") or {}).get("tokenizer") or ""
    byte_level = len(tokenizer) == 256 and not tokenizer_path
    about_tokenizer = (
        "Byte-level (the tokenizer files here): token id = UTF-8 byte value, vocabulary 256, no special tokens;\n"
        '`list(text.encode("utf-8"))` gives the same ids, `bytes(ids).decode("utf-8", errors="replace")` the text.'
        if byte_level
        else f"The run's tokenizer ({tokenizer_path or 'given to export'}), {len(tokenizer)} ids, is in this directory."
    )
    return (
        f"# hivetrain export: run `{run.get('run_id', 'unknown')}`, epoch {epoch}\n\n"
        f"{config.model_type} causal LM ({num_parameters:,} parameters, fp32), "
        "trained with\nDiLoCo by hivetrain volunteers. Only θ is exported (no optimizer or outer momentum).\n\n"
        "## Tokenizer\n\n"
        f"{about_tokenizer}\n\n"
        "## Generate\n\n"
        "```python\n"
        "from transformers import pipeline\n"
        'generate = pipeline("text-generation", model="THIS_DIRECTORY")\n'
        'print(generate("def main", max_new_tokens=64, do_sample=False)[0]["generated_text"])\n'
        "```\n\n"
        "or `hivetrain generate THIS_DIRECTORY --prompt 'def main'`.\n\n"
        "## Provenance\n\n"
        f"- state hash (θ + momentum): `{state_hash}`\n"
        f"- model fingerprint: `{manifest.get('model_fingerprint') or 'n/a'}`\n"
        f"- max sequence length: {getattr(config, 'max_position_embeddings', 'n/a')} tokens\n"
    )
