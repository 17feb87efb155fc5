"""How one butterfly round's parts and results go on the wire: the round's codecs and its error feedback.

``RoundCodec`` holds the two codecs of a round (``reduce.part_codec``: what a member sends of each slice;
``reduce.result_codec``: what a reducer sends of its averaged slice, the same but for a denser "topk") and, for one
``ButterflyRound.run``, the error-feedback residual (``feedback.ErrorFeedback``): for every slice ``x`` of our
contribution that we encode, ``x - decode(encode(x))`` is written at ``x``'s offset, so the caller can send what the
codec dropped with its next contribution.

Two rules keep the members' results bit-identical: a reducer reads every part, its own included, as the others would
read it, through the codec (``own_part``); and it reads its averaged slice from the very bytes it sends
(``encode_result``), encoded once. Without a codec (``compression = "none"``: ``raw``) parts and results travel as
fp32 and nothing is written to the residual.

Tensors: fp32, 1-D; buffers: the wire payload of one frame (``codecs.to_buffers``, or one ``memoryview`` of raw fp32).
"""

from __future__ import annotations

import torch

from hivetrain.averaging import codecs
from hivetrain.averaging.config import AveragingConfig
from hivetrain.averaging.reduce import part_codec, result_codec, tensor_view


class RoundCodec:
    """The codecs of one round and the residual of its current run (module docstring).

    Args:
        config: the round's averaging config (``compression`` and its settings).
        fan_in: how many members' pseudo-gradients each contribution already averages (``reduce.part_codec``).
        num_members: the round's size (a "topk" result keeps every element any member sent).
    """

    def __init__(self, config: AveragingConfig, fan_in: int, num_members: int):
        self.part_config = part_codec(config, fan_in)
        self.part = codecs.make_codec(self.part_config) if config.compression != "none" else None
        # a reducer's averaged slice: the same codec, except a denser "topk" (every element any contributor sent)
        self.result_config = result_codec(self.part_config, num_members)
        self.result = codecs.make_codec(self.result_config) if self.part is not None else None
        self.residual: torch.Tensor | None = None  # error feedback: what the codec drops from what we send

    @property
    def raw(self) -> bool:
        """No codec: parts and results are raw fp32."""
        return self.part is None

    def start(self, residual: torch.Tensor | None) -> None:
        """Begin a run: ``residual`` (fp32, the contribution's size, or None) receives what the codec drops."""
        self.residual = residual if self.part is not None else None

    def result_ratio(self) -> float:
        """Wire bytes of a result element over a part element (1 but for "topk", whose results are denser)."""
        if self.result_config is self.part_config:
            return 1.0
        return self.result_config.frame_num_bytes(1 << 16) / self.part_config.frame_num_bytes(1 << 16)

    def encode_part(self, x: torch.Tensor, offset: int) -> list:
        """Wire buffers of ``x``, the slice of our contribution at ``offset``; with error feedback, what the codec
        dropped of it goes into the residual at that offset."""
        if self.part is None:
            return [tensor_view(x)]
        part = self.part.encode(x)
        if self.residual is not None:
            torch.sub(x, self.part.decode(part), out=self.residual[offset : offset + x.numel()])
        return codecs.to_buffers(part)

    def own_part(self, flat: torch.Tensor, start: int, end: int, sent: list | None) -> torch.Tensor:
        """Our part of the slice [``start``, ``end``) of ``flat`` as its reducer reads it: ``sent`` (the buffers we
        sent of it) decoded; for the slice we reduce ourselves (``sent`` None: never sent), encoded and decoded here,
        its residual written."""
        if sent is not None:
            return self._decoded(sent, end - start) if self.part is not None else flat[start:end]
        mine = flat[start:end]
        if self.part is None:
            return mine
        decoded = self.part.decode(self.part.encode(mine))
        if self.residual is not None:
            torch.sub(mine, decoded, out=self.residual[start:end])
        return decoded

    def encode_result(self, reduced: torch.Tensor, dest: torch.Tensor) -> list:
        """Wire buffers of our averaged slice ``reduced``, encoded once; with a codec, ``dest`` (our result's slice)
        receives what every member decodes from them. Without one ``reduced`` is ``dest`` already."""
        if self.part is None:
            return [tensor_view(reduced)]
        payload = codecs.to_buffers(self.result.encode(reduced))
        dest.copy_(self._decoded(payload, dest.numel()))
        return payload

    @staticmethod
    def _decoded(payload: list, num_elements: int) -> torch.Tensor:
        """What the members read from encoded ``payload``."""
        return codecs.decode(codecs.from_bytes(b"".join(bytes(b) for b in payload), num_elements))
