"""Model presets built from ``transformers`` configs, and the model fingerprint peers compare.

Presets are small Llama decoders (``LlamaForCausalLM``) with a byte vocabulary (256) by default:

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

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

# Architecture of each preset; vocab_size and max_position_embeddings are filled in by build_config.
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
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
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
