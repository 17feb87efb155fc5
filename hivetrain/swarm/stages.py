"""Cutting a ``LlamaForCausalLM`` into pipeline stages that compute exactly what the uncut model computes.

Stage 0 holds the token embedding and the first decoder blocks, middle stages hold blocks only, the last stage holds
the last blocks, the final RMSNorm and the LM head (SWARM parallelism, Ryabinin et al., ICML 2023, Sec. 3). Every
stage that holds blocks recomputes the rotary position embeddings and the causal mask from its input's shape with
the same transformers functions the uncut ``LlamaModel.forward`` uses, so the composition of the stages is the uncut
forward pass operation for operation (equal up to float rounding; the tests check atol 1e-5).

Parameter names are the uncut model's (``model.layers.3.mlp.up_proj.weight``), so a stage's state dict is a slice of
the full model's and stage states can be checked against the full model.

Shape legend: B = windows in a microbatch, T = tokens per window, D = hidden size, V = vocabulary size.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.masking_utils import create_causal_mask
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from hivetrain.model import build_model


@dataclass(frozen=True)
class StageSpec:
    """Which part of the model a stage holds.

    Attributes:
        index: stage number, 0-based.
        num_stages: S.
        layer_start: first decoder block (inclusive).
        layer_end: last decoder block (exclusive); ``layer_start == layer_end`` = no blocks.
    """

    index: int
    num_stages: int
    layer_start: int
    layer_end: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


def plan_stages(num_layers: int, num_stages: int, layers_per_stage: tuple[int, ...] = ()) -> list[StageSpec]:
    """Assign decoder blocks to stages.

    Args:
        num_layers: decoder blocks in the model.
        num_stages: S >= 1.
        layers_per_stage: explicit block counts (sum = ``num_layers``); empty = as even as possible, the extra
            blocks going to the first stages (the last stage also carries the LM head).

    Raises:
        ValueError: S < 1, or ``layers_per_stage`` does not have S non-negative entries summing to ``num_layers``.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if layers_per_stage:
        if len(layers_per_stage) != num_stages or any(n < 0 for n in layers_per_stage):
            raise ValueError(f"layers_per_stage {layers_per_stage} must have {num_stages} entries >= 0")
        if sum(layers_per_stage) != num_layers:
            raise ValueError(f"layers_per_stage {layers_per_stage} sums to {sum(layers_per_stage)}, not {num_layers}")
        counts = list(layers_per_stage)
    else:
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if i < extra else 0) for i in range(num_stages)]
    for index, count in enumerate(counts):
        if count == 0 and 0 < index < num_stages - 1:
            raise ValueError(
                f"stage {index} of {num_stages} would hold no parameters: use at most {num_layers + 2} stages "
                f"for a {num_layers}-block model, or set layers_per_stage"
            )
    specs, start = [], 0
    for index, count in enumerate(counts):
        specs.append(StageSpec(index=index, num_stages=num_stages, layer_start=start, layer_end=start + count))
        start += count
    return specs


class PipelineStage(nn.Module):
    """One stage of a cut ``LlamaForCausalLM``.

    ``forward`` takes (B, T) int64 token ids on the first stage and (B, T, D) float hidden states elsewhere; it returns
    (B, T, D) hidden states, or (B, T, V) logits on the last stage.
    """

    def __init__(self, config: LlamaConfig, spec: StageSpec, source: PreTrainedModel | None = None):
        """Copy the stage's modules out of ``source`` (an uncut model built from ``config``), or, with no source,
        create them freshly initialised (for a server that downloads the stage's parameters from peers).

        Raises:
            ValueError: ``spec`` names blocks the model does not have.
        """
        super().__init__()
        if spec.layer_end > config.num_hidden_layers:
            raise ValueError(
                f"stage {spec.index} needs block {spec.layer_end - 1}; the model has {config.num_hidden_layers}"
            )
        self.config = config
        self.spec = spec
        self.model = nn.Module()
        if spec.is_first:
            self.model.embed_tokens = (
                copy.deepcopy(source.model.embed_tokens)
                if source is not None
                else nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
            )
        self.model.layers = nn.ModuleDict(
            {
                str(i): copy.deepcopy(source.model.layers[i]) if source is not None else LlamaDecoderLayer(config, i)
                for i in range(spec.layer_start, spec.layer_end)
            }
        )
        if spec.is_last:
            if source is not None:
                self.model.norm = copy.deepcopy(source.model.norm)
                self.lm_head = copy.deepcopy(source.lm_head)
            else:
                self.model.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config=config) if spec.num_layers else None

    def input_dtype(self) -> torch.dtype:
        """int64 on the first stage (token ids), float32 elsewhere."""
        return torch.int64 if self.spec.is_first else torch.float32

    def output_width(self) -> int:
        """Last dimension of the output: V on the last stage, D elsewhere."""
        return self.config.vocab_size if self.spec.is_last else self.config.hidden_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the stage.

        Args:
            x: (B, T) int64 token ids (first stage) or (B, T, D) float32 hidden states.

        Returns:
            (B, T, D) float32 hidden states, or (B, T, V) float32 logits on the last stage.
        """
        h_BTD = self.model.embed_tokens(x) if self.spec.is_first else x
        if self.spec.num_layers:
            num_tokens = h_BTD.shape[1]
            position_ids_1T = torch.arange(num_tokens, device=h_BTD.device).unsqueeze(0)
            causal_mask = create_causal_mask(
                config=self.config,
                inputs_embeds=h_BTD,
                attention_mask=None,
                past_key_values=None,
                position_ids=position_ids_1T,
            )
            position_embeddings = self.rotary_emb(h_BTD, position_ids=position_ids_1T)
            for layer in self.model.layers.values():
                h_BTD = layer(
                    h_BTD,
                    attention_mask=causal_mask,
                    position_ids=position_ids_1T,
                    position_embeddings=position_embeddings,
                )
        if self.spec.is_last:
            return self.lm_head(self.model.norm(h_BTD))  # (B, T, V)
        return h_BTD


def build_stage(config: LlamaConfig, spec: StageSpec, seed: int) -> PipelineStage:
    """The stage's slice of ``build_model(config, seed)``: θ₀ equal to the uncut model's initial parameters.

    The uncut model is built once (CPU, fp32) and dropped; a server of a model too big for it should download its
    stage from peers instead (``StageServer`` does when peers of its stage exist).
    """
    full = build_model(config, seed)
    stage = PipelineStage(full.config, spec, full)
    del full
    return stage


def cut_model(model: PreTrainedModel, num_stages: int, layers_per_stage: tuple[int, ...] = ()) -> list[PipelineStage]:
    """Copies of every stage of ``model`` (for tests and local reference runs)."""
    specs = plan_stages(model.config.num_hidden_layers, num_stages, layers_per_stage)
    return [PipelineStage(model.config, spec, model) for spec in specs]
