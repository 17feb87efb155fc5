"""The "topk" codec: chunked top-k sparsification with quantized values (format and bounds: ``codecs``' module
docstring). It writes and reads the same strict frame as the other codecs (``codecs.to_bytes`` / ``from_bytes``);
``codecs.make_codec`` and ``codecs.decode`` hand "topk" parts to it."""

from __future__ import annotations

import numpy as np
import torch

from hivetrain.averaging.codecs import (
    _SCALE_TORCH,
    _TOPK_SUB,
    CodecConfig,
    EncodedPart,
    MalformedPart,
    ScaleDtype,
    _all_finite,
    _as_tensor,
    _check_input,
    _check_part,
    _stored_scale,
    _tensor_bytes,
    topk_bitmap,
    topk_index_num_bytes,
    topk_kept,
)


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (each < 2**bits) packed ``8 // bits`` per byte, element i in bits ``bits * (i % per)`` up."""
    per = 8 // bits
    if per == 1:
        return codes
    pad = (-codes.numel()) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    grouped = codes.view(-1, per)
    packed = grouped[:, 0].clone()
    for j in range(1, per):
        packed |= grouped[:, j] << (bits * j)
    return packed


def _unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` codes of ``_pack_codes``'s bytes (uint8)."""
    per = 8 // bits
    if per == 1:
        return packed[:count]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return ((packed[:, None] >> shifts) & ((1 << bits) - 1)).view(-1)[:count]


class TopKCodec:
    """Chunked top-k sparsification with quantized values ("topk", see the module docstring).

    ``encode`` keeps, per chunk of ``block_size`` elements, the ``k`` elements of largest magnitude (their offsets
    ascending) and quantizes them on ``value_bits`` bits with one scale per chunk; ``decode`` scatters them back into
    zeros. Deterministic on one machine (torch.topk's ties); the bytes decode identically everywhere.
    """

    def __init__(self, block_size: int = 4096, k: int = 64, value_bits: int = 4, scale_dtype: ScaleDtype = "fp32"):
        CodecConfig("topk", block_size, scale_dtype, k, value_bits)  # validates
        self.name = "topk"
        self.block_size, self.k, self.value_bits, self.scale_dtype = block_size, k, value_bits, scale_dtype
        self.levels = 2 ** (value_bits - 1) - 1
        self._zero = 2 ** (value_bits - 1)  # the code of level 0

    def _groups(self, n: int, k: int) -> list[tuple[int, int, int, int]]:
        """(start, rows, width, kept per row): the full chunks as one group, then the shorter last chunk."""
        full, rest = divmod(n, self.block_size)
        groups = [(0, full, self.block_size, min(k, self.block_size))] if full else []
        return groups + ([(full * self.block_size, 1, rest, min(k, rest))] if rest else [])

    def encode(self, x: torch.Tensor) -> EncodedPart:
        """Sparsify and quantize ``x`` (fp32, shape (n,)); raises ValueError for non-finite values (or fp16-scale
        overflow)."""
        x = _check_input(x)
        if not _all_finite(x):
            raise ValueError("cannot encode non-finite values")
        offsets, kept = [], []
        for start, rows, width, k in self._groups(x.numel(), self.k):
            chunk = x[start : start + rows * width].view(rows, width)
            idx = torch.topk(chunk.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values
            offsets.append(idx.reshape(-1))
            kept.append(torch.gather(chunk, 1, idx))
        scales = [_stored_scale(v.abs().amax(dim=1) / self.levels, self.scale_dtype, self.name, self.levels)
                  for v in kept]  # fmt: skip
        codes = [
            v.div(torch.where(sc > 0, sc, torch.ones_like(sc))[:, None]).round_().clamp_(-self.levels, self.levels)
            for v, sc in zip(kept, scales, strict=True)
        ]
        flat_codes = torch.cat([c.reshape(-1) for c in codes]) if codes else torch.empty(0)
        packed = _pack_codes(flat_codes.add_(self._zero).to(torch.uint8), self.value_bits)
        groups = self._groups(x.numel(), self.k)
        index = [_positions(idx, width, k) for (_, _, width, k), idx in zip(groups, offsets, strict=True)]
        payload = b"".join([_TOPK_SUB.pack(self.k, self.value_bits), *index, _tensor_bytes(packed)])
        scale_all = torch.cat(scales) if scales else torch.empty(0)
        return EncodedPart("topk", x.numel(), payload, self.block_size, self.scale_dtype,
                           _tensor_bytes(scale_all.to(_SCALE_TORCH[self.scale_dtype])))  # fmt: skip

    def decode(self, part: EncodedPart) -> torch.Tensor:
        """A new fp32 tensor of shape (part.num_elements,): the kept values at their offsets, zeros elsewhere.

        Raises:
            MalformedPart: inconsistent sizes, a ``k`` or value width other than this codec's, an offset outside its
                chunk or not strictly above the one before it (a repeated index), or a code outside the grid.
        """
        _check_part(part, self.name)
        k, bits = _TOPK_SUB.unpack_from(memoryview(part.payload).cast("B"))
        if (k, bits, part.block_size) != (self.k, self.value_bits, self.block_size):
            raise MalformedPart(
                f"topk part keeps {k} of {part.block_size} at {bits} bits; this round sends {self.k} of "
                f"{self.block_size} at {self.value_bits} bits"
            )
        n = part.num_elements
        count = topk_kept(n, self.block_size, k)
        raw = memoryview(part.payload).cast("B")
        groups, at, index = self._groups(n, k), _TOPK_SUB.size, []
        for _, rows, width, kk in groups:
            index.append(_read_positions(raw, at, rows, width, kk))
            at += rows * topk_index_num_bytes(width, kk)
        codes = _unpack_codes(_as_tensor(raw[at:], torch.uint8)[0], bits, count)
        if count and (int(codes.min()) < 1 or int(codes.max()) > 2 * self._zero - 1):
            raise MalformedPart(f"topk codes must lie in 1..{2 * self._zero - 1}")
        scale = _as_tensor(part.scales, _SCALE_TORCH[part.scale_dtype])[0].float()
        out = torch.zeros(n, dtype=torch.float32)
        pos = chunk = 0
        for (start, rows, width, kk), idx in zip(groups, index, strict=True):
            levels = codes[pos : pos + rows * kk].view(rows, kk).float().sub_(self._zero)
            values = levels.mul_(scale[chunk : chunk + rows, None])
            out[start : start + rows * width].view(rows, width).scatter_(1, idx, values)
            pos, chunk = pos + rows * kk, chunk + rows
        return out


def _positions(idx: torch.Tensor, width: int, kept: int) -> bytes:
    """Wire bytes of the ascending positions ``idx`` (int64, (rows x kept,), chunk after chunk) of chunks of
    ``width`` elements: uint16 offsets, or one bitmap per chunk (``codecs.topk_bitmap``)."""
    if not topk_bitmap(width, kept):
        return idx.numpy().astype(np.uint16).tobytes()
    rows = idx.view(-1, kept).numpy()
    bits = np.zeros((rows.shape[0], width), dtype=np.bool_)
    np.put_along_axis(bits, rows, True, axis=1)
    return np.packbits(bits, axis=1, bitorder="little").tobytes()


def _read_positions(raw: memoryview, at: int, rows: int, width: int, kept: int) -> torch.Tensor:
    """The positions (int64, (rows, kept), ascending) of ``rows`` chunks of ``width`` elements from ``raw[at:]``.

    Raises:
        MalformedPart: an offset at or past ``width`` or not above the one before it; a bitmap with other than
            ``kept`` bits set in a chunk, or a bit set past the chunk's end.
    """
    if not topk_bitmap(width, kept):
        idx = torch.from_numpy(np.frombuffer(raw, np.uint16, rows * kept, at).astype(np.int64)).view(rows, kept)
        if kept and (int(idx.max()) >= width or (kept > 1 and bool((idx[:, 1:] <= idx[:, :-1]).any()))):
            raise MalformedPart(f"topk offsets must be strictly ascending and below {width} in each chunk")
        return idx
    per_chunk = (width + 7) // 8
    packed = np.frombuffer(raw, np.uint8, rows * per_chunk, at).reshape(rows, per_chunk)
    bits = np.unpackbits(packed, axis=1, bitorder="little")
    if bits[:, width:].any():
        raise MalformedPart(f"topk bitmap sets a position at or past the chunk's {width} elements")
    if (bits.sum(axis=1, dtype=np.int64) != kept).any():  # a denser part than the round's, or a sparser one
        raise MalformedPart(f"topk bitmap must set exactly {kept} of {width} positions in each chunk")
    columns = np.flatnonzero(bits) % bits.shape[1]  # row-major: each row's positions, ascending (none padded)
    return torch.from_numpy(columns).view(rows, kept)
