"""The shared training state of a DiLoCo run and its hash.

``TrainingState`` is what peers agree on after every outer step and what a late joiner downloads: the shared
parameters θ, the outer Nesterov momentum, and the epoch (number of committed outer steps). Tensors are fp32,
contiguous, on the CPU, in the model's ``named_parameters()`` order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

MOMENTUM_PREFIX = "outer_momentum."
# states a trainer's state server keeps for joiners (``state_sync.StateServer``), the current one included: the
# memory preflight counts the older ones (8 bytes per parameter each)
SERVED_EPOCHS = 3


@dataclass
class TrainingState:
    """θ, outer momentum and epoch.

    Attributes:
        epoch: committed outer steps so far (0 = the initial parameters).
        params: name -> fp32 CPU tensor (θ), in ``named_parameters()`` order.
        momentum: name -> fp32 CPU tensor of the same shape (outer Nesterov buffer; zeros before the first step).
    """

    epoch: int
    params: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]

    def __post_init__(self) -> None:
        if self.epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {self.epoch}")
        if list(self.params) != list(self.momentum):
            raise ValueError("params and momentum must have the same names in the same order")
        for name, p in self.params.items():
            m = self.momentum[name]
            if p.dtype != torch.float32 or m.dtype != torch.float32:
                raise ValueError(f"{name}: state tensors must be float32, got {p.dtype} and {m.dtype}")
            if p.shape != m.shape:
                raise ValueError(f"{name}: momentum shape {tuple(m.shape)} != parameter shape {tuple(p.shape)}")

    @classmethod
    def from_model(cls, model: torch.nn.Module, epoch: int = 0) -> TrainingState:
        """θ copied from ``model`` (to fp32 CPU), zero momentum."""
        params = {n: p.detach().to("cpu", torch.float32).clone().contiguous() for n, p in model.named_parameters()}
        return cls(epoch=epoch, params=params, momentum={n: torch.zeros_like(p) for n, p in params.items()})

    def state_hash(self) -> str:
        """sha256 (hex) over the epoch and the raw bytes of every tensor, names and shapes included.

        Equal hashes mean bit-identical θ and momentum.
        """
        digest = hashlib.sha256()
        for piece in self.hashed_pieces():
            digest.update(piece)
        return digest.hexdigest()

    def hashed_pieces(self) -> Iterator[bytes | memoryview]:
        """What ``state_hash`` reads, in order: the epoch, then per tensor (θ, then momentum) its name and shape and
        its raw bytes (a view of the buffer itself, no copy)."""
        yield f"epoch={self.epoch}".encode()
        for group, tensors in (("param", self.params), ("momentum", self.momentum)):
            for name, tensor in tensors.items():
                yield f"{group}:{name}:{tuple(tensor.shape)}".encode()
                yield tensor.contiguous().view(-1).view(torch.uint8).numpy().data

    def to_flat_dict(self) -> dict[str, torch.Tensor]:
        """One name -> tensor dict (momentum names prefixed) for safetensors files and state downloads."""
        flat = dict(self.params)
        flat.update({MOMENTUM_PREFIX + n: t for n, t in self.momentum.items()})
        return flat

    @classmethod
    def from_flat_dict(cls, flat: dict[str, torch.Tensor], epoch: int, reference: TrainingState) -> TrainingState:
        """Inverse of ``to_flat_dict``, checked against ``reference``'s names, shapes and dtypes.

        Raises:
            ValueError: a tensor is missing, extra, of another shape or dtype, or not finite.
        """
        expected = reference.to_flat_dict()
        if set(flat) != set(expected):
            missing, extra = sorted(set(expected) - set(flat)), sorted(set(flat) - set(expected))
            raise ValueError(f"state tensors do not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
        for name, ref in expected.items():
            got = flat[name]
            if got.shape != ref.shape or got.dtype != ref.dtype:
                raise ValueError(f"{name}: got {got.dtype}{tuple(got.shape)}, expected {ref.dtype}{tuple(ref.shape)}")
            if not torch.isfinite(got).all():
                raise ValueError(f"{name}: contains NaN or Inf")
        params = {n: flat[n].contiguous() for n in reference.params}
        momentum = {n: flat[MOMENTUM_PREFIX + n].contiguous() for n in reference.momentum}
        return cls(epoch=epoch, params=params, momentum=momentum)

    def clone(self) -> TrainingState:
        return TrainingState(
            epoch=self.epoch,
            params={n: t.clone() for n, t in self.params.items()},
            momentum={n: t.clone() for n, t in self.momentum.items()},
        )

    def num_bytes(self) -> int:
        """Size of θ plus momentum in bytes."""
        return sum(t.numel() * t.element_size() for t in self.to_flat_dict().values())
