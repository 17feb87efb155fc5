"""Compression of flat fp32 parts for the averaging wire, with a strict binary frame and error feedback.

A ``Codec`` turns a 1-D fp32 tensor into an ``EncodedPart`` and back; ``to_buffers``/``to_bytes`` write an
``EncodedPart`` as one frame and ``from_bytes`` parses it with strict size checks (nothing is unpickled).

Frame (little-endian, 36-byte header, then the raw payload, then the raw block scales)::

    magic b"HVP1" | version u8 | codec id u8 | scale dtype u8 | reserved u8 (= 0) | block_size u32
    | num_elements u64 | payload num_bytes u64 | scales num_bytes u64 | payload | scales

Codecs and their per-element error bounds (``x`` the input, ``x'`` the decoded value, ``a`` the absmax of the block
of ``block_size`` consecutive elements that holds ``x``):

    name            bits per element            bound on |x - x'|
    "none"          32                          0 (exact)
    "fp16"          16                          |x| * 2**-11 if |x| >= 2**-14, else 2**-25 (|x| <= 65504)
    "int8"          8 + scale_bits/block_size   scale / 2 = a / 254   (levels -127..127, scale = a / 127)
    "int4"          4 + scale_bits/block_size   scale / 2 = a / 14    (levels -7..7, scale = a / 7)
    "topk"          k/C * (i + b) + scale_bits/C   see below (chunked top-k sparsification; i = min(16, 8C/k))

"topk" (chunked top-k with quantized values, as in SparseLoCo, Sarfi et al. 2025, and DeMo's per-chunk selection,
Peng et al. 2024): the part is cut into chunks of ``block_size`` = C elements (C <= 65536; the last may be shorter);
each chunk keeps its ``k`` largest-magnitude elements (``min(k, chunk length)``; ties by torch.topk), sent as their
positions in the chunk and their values quantized to ``b`` = 2, 4 or 8 bits on a symmetric grid of levels -L..L
(L = 2**(b-1) - 1: ternary for 2 bits, then 7, 127) with one scale per chunk (its kept absmax / L). A chunk's positions
travel in the smaller of two forms (``topk_bitmap``, fixed by its length and k, so never the sender's choice): uint16
offsets, ascending (2k bytes), or a bitmap of the chunk (ceil(length / 8) bytes, element j in bit j % 8 of byte
j // 8) once k passes length / 16: the reducers' results of a group keep up to k x members per chunk, where offsets
would cost twice the bitmap. The dropped elements decode to 0, so the bound on |x - x'| is |x| for them and scale / 2
for the kept ones: a sparsifying codec is only sound with error feedback (the config refuses it without). Payload: an
8-byte sub-header (k u32, b u8, 3 zero bytes), each chunk's positions in chunk order, then the codes packed ``8 / b``
per byte (element i in bits ``b*(i % (8/b))`` up), stored as level + 2**(b-1) (so 0 is never a valid code). Decoding
refuses offsets out of the chunk, offsets not strictly ascending (a repeated index), a bitmap with other than k bits
set or a bit past the chunk's end, invalid codes, and a ``k`` or ``b`` other than the receiver's.

The int bounds hold up to one fp32 rounding of ``q * scale`` (|x| * 2**-24). With fp16 scales the scale is rounded
*up* to the next fp16 value, so no level clips and the bound is ``fp16(scale) / 2``. Blockwise absmax quantization
follows Dettmers et al. 2022 ("8-bit Optimizers via Block-wise Quantization"), here with a linear code.

Encoding is deterministic: the same input gives the same bytes on any IEEE-754 machine (amax, one division,
torch.round = round-half-to-even and casts are exact or correctly rounded; no thread-count-dependent reductions).
Buffers are read in native byte order: every platform hivetrain supports (x86-64, aarch64) is little-endian.

Error feedback (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019, "Error Feedback Fixes SignSGD", EF-SGD):
``feedback.ErrorFeedback`` holds an averager's residual: the round sends ``x + residual`` and keeps the new residual
``x + residual - decode(encode(x + residual))`` of every slice it encodes, so the compression error is sent later
instead of lost.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

CodecName = Literal["none", "fp16", "int8", "int4", "topk"]
ScaleDtype = Literal["fp32", "fp16"]

CODEC_IDS: dict[str, int] = {"none": 0, "fp16": 1, "int8": 2, "int4": 3, "topk": 4}
_SCALE_IDS: dict[str | None, int] = {None: 0, "fp32": 1, "fp16": 2}
_CODEC_NAMES, _SCALE_NAMES = {v: k for k, v in CODEC_IDS.items()}, {v: k for k, v in _SCALE_IDS.items()}
_SCALE_TORCH, _SCALE_ITEMSIZE = {"fp32": torch.float32, "fp16": torch.float16}, {None: 0, "fp32": 4, "fp16": 2}
_MAGIC, _VERSION, _HEADER = b"HVP1", 1, struct.Struct("<4sBBBBIQQQ")
HEADER_NUM_BYTES = _HEADER.size
MAX_BLOCK_SIZE = 1 << 20
_FP16_MAX = 65504.0
_LEVELS = {"int8": 127, "int4": 7}
_BLOCKED = ("int8", "int4", "topk")  # codecs with one scale per block (chunk)
MAX_TOPK_CHUNK = 1 << 16  # offsets in a chunk are uint16
TOPK_VALUE_BITS = (2, 4, 8)
_TOPK_SUB = struct.Struct("<IB3x")  # k, value bits


class MalformedPart(ValueError):
    """A frame or EncodedPart from the network is inconsistent (bad header, sizes, codec id or scales)."""


@dataclass(frozen=True)
class EncodedPart:
    """One compressed 1-D fp32 part.

    Attributes:
        codec: codec name ("none", "fp16", "int8", "int4").
        num_elements: elements of the decoded part.
        payload: the encoded values: fp32 / fp16 / int8 raw bytes, or for int4 two values per byte (element 2i in the
            low nibble, 2i+1 in the high nibble, stored as level + 8); ``payload_num_bytes(...)`` bytes exactly.
        block_size: elements per quantization block (0 for "none" and "fp16").
        scale_dtype: "fp32" or "fp16" for int codecs, None otherwise.
        scales: one scale per block (``ceil(num_elements / block_size)`` values of ``scale_dtype``), raw bytes.
    """

    codec: str
    num_elements: int
    payload: bytes | bytearray | memoryview  # "topk": sub-header, offsets, packed codes (module docstring)
    block_size: int = 0
    scale_dtype: str | None = None
    scales: bytes | bytearray | memoryview = b""

    @property
    def num_bytes(self) -> int:
        """Size of this part's frame on the wire, bytes."""
        return HEADER_NUM_BYTES + memoryview(self.payload).nbytes + memoryview(self.scales).nbytes


def topk_kept(num_elements: int, chunk: int, k: int) -> int:
    """Elements a "topk" part of ``num_elements`` keeps: ``k`` per full chunk of ``chunk``, ``min(k, rest)`` after."""
    full, rest = divmod(num_elements, chunk)
    return full * min(k, chunk) + min(k, rest)


def topk_bitmap(length: int, kept: int) -> bool:
    """Whether a "topk" chunk of ``length`` elements keeping ``kept`` sends its positions as a bitmap (ceil(length / 8)
    bytes) rather than as uint16 offsets (2 x ``kept`` bytes): whichever is smaller, offsets on a tie."""
    return (length + 7) // 8 < 2 * kept


def topk_index_num_bytes(length: int, kept: int) -> int:
    """Bytes of one "topk" chunk's positions (``topk_bitmap`` says which form)."""
    return (length + 7) // 8 if topk_bitmap(length, kept) else 2 * kept


def payload_num_bytes(codec: str, num_elements: int, block_size: int = 0, k: int = 0, value_bits: int = 0) -> int:
    """Exact payload size in bytes of a part of ``num_elements`` elements (``block_size``, ``k`` and ``value_bits``:
    "topk" only)."""
    if codec == "topk":
        kept = topk_kept(num_elements, block_size, k)
        full, rest = divmod(num_elements, block_size)
        index = full * topk_index_num_bytes(block_size, min(k, block_size))
        index += topk_index_num_bytes(rest, min(k, rest)) if rest else 0
        return _TOPK_SUB.size + index + -(-kept * value_bits // 8)
    return (num_elements + 1) // 2 if codec == "int4" else num_elements * {"none": 4, "fp16": 2, "int8": 1}[codec]


def scales_num_bytes(codec: str, num_elements: int, block_size: int, scale_dtype: str | None) -> int:
    """Exact size in bytes of the block (chunk) scales (0 for "none" and "fp16")."""
    if codec not in _BLOCKED:
        return 0
    return -(-num_elements // block_size) * _SCALE_ITEMSIZE[scale_dtype]


def _all_finite(x: torch.Tensor) -> bool:  # NaN propagates into min and max; ~5x faster than isfinite(x).all()
    return x.numel() == 0 or all(bool(torch.isfinite(v)) for v in torch.aminmax(x))


def _as_tensor(buf: bytes | bytearray | memoryview, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """A tensor over ``buf`` and whether it owns its memory (read-only buffers are copied, never aliased)."""
    mv = memoryview(buf).cast("B")
    if mv.nbytes == 0 or mv.readonly:
        return (torch.frombuffer(bytearray(mv), dtype=dtype) if mv.nbytes else torch.empty(0, dtype=dtype)), True
    return torch.frombuffer(mv, dtype=dtype), False


def _tensor_bytes(t: torch.Tensor) -> memoryview:  # zero-copy view of a CPU tensor's memory
    return memoryview(t.contiguous().numpy()).cast("B") if t.numel() else memoryview(b"")


def _check_input(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32 or x.dim() != 1 or x.device.type != "cpu":
        raise ValueError(f"expected a 1-D fp32 CPU tensor, got {tuple(x.shape)} {x.dtype} on {x.device}")
    return x.detach().contiguous()


@dataclass(frozen=True)
class CodecConfig:
    """Which codec compresses parts on the wire.

    Args:
        name: "none" (fp32), "fp16", "int8", "int4" or "topk".
        block_size: elements per quantization block for int8/int4 (1..2**20), per chunk for topk (1..2**16); ignored
            by "none"/"fp16".
        scale_dtype: dtype of the per-block scales, "fp32" (exact) or "fp16" (half the overhead; the encoder raises
            ValueError for blocks whose absmax exceeds fp16 range * levels).
        k: "topk": elements kept per chunk (1..block_size); 0 otherwise.
        value_bits: "topk": bits per kept value (2, 4 or 8); 0 otherwise.
    """

    name: CodecName = "int8"
    block_size: int = 64
    scale_dtype: ScaleDtype = "fp32"
    k: int = 0
    value_bits: int = 0

    def __post_init__(self) -> None:
        if self.name not in CODEC_IDS:
            raise ValueError(f"codec.name must be one of {sorted(CODEC_IDS)}, got {self.name!r}")
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"codec.block_size must be an int in [1, {MAX_BLOCK_SIZE}], got {self.block_size!r}")
        if self.scale_dtype not in _SCALE_TORCH:
            raise ValueError(f"codec.scale_dtype must be 'fp32' or 'fp16', got {self.scale_dtype!r}")
        if self.name == "topk":
            if self.block_size > MAX_TOPK_CHUNK:
                raise ValueError(f"topk chunks hold at most {MAX_TOPK_CHUNK} elements, got {self.block_size}")
            if not isinstance(self.k, int) or not 1 <= self.k <= self.block_size:
                raise ValueError(f"topk keeps 1..{self.block_size} elements per chunk, got k={self.k!r}")
            if self.value_bits not in TOPK_VALUE_BITS:
                raise ValueError(f"topk values take {TOPK_VALUE_BITS} bits, got {self.value_bits!r}")
        elif self.k or self.value_bits:
            raise ValueError(f"k and value_bits are for topk only, not {self.name!r}")

    def frame_num_bytes(self, num_elements: int) -> int:
        """Exact size on the wire of one part of ``num_elements`` elements in this codec, bytes ("none": the raw
        fp32 bytes, which travel without a frame)."""
        if self.name == "none":
            return 4 * num_elements
        block = self.block_size if self.name in _BLOCKED else 0
        scale = self.scale_dtype if self.name in _BLOCKED else None
        return (
            HEADER_NUM_BYTES
            + payload_num_bytes(self.name, num_elements, block, self.k, self.value_bits)
            + scales_num_bytes(self.name, num_elements, block, scale)
        )


class Codec(Protocol):
    """Encodes 1-D fp32 tensors to ``EncodedPart`` and back."""

    name: str

    def encode(self, x: torch.Tensor) -> EncodedPart:
        """Encode ``x`` (fp32, shape (n,), finite); raises ValueError on bad input."""

    def decode(self, part: EncodedPart) -> torch.Tensor:
        """Decode to a new fp32 tensor of shape (part.num_elements,); raises MalformedPart if inconsistent."""


class RawCodec:
    """ "none" (fp32 as is) or "fp16" (round-to-nearest-even cast)."""

    def __init__(self, name: Literal["none", "fp16"] = "none"):
        if name not in ("none", "fp16"):
            raise ValueError(f"RawCodec handles 'none' and 'fp16', got {name!r}")
        self.name = name

    def encode(self, x: torch.Tensor) -> EncodedPart:
        """Encode ``x``; raises ValueError for non-finite values, and for "fp16" for |x| > 65504."""
        x = _check_input(x)
        if self.name == "none":
            if not _all_finite(x):
                raise ValueError("cannot encode non-finite values")
            return EncodedPart("none", x.numel(), _tensor_bytes(x.clone()))
        absmax = float(x.abs().amax()) if x.numel() else 0.0
        if not absmax <= _FP16_MAX:  # also catches NaN
            raise ValueError(f"fp16 codec: values must be finite and within +-{_FP16_MAX}, absmax is {absmax}")
        return EncodedPart("fp16", x.numel(), _tensor_bytes(x.half()))

    def decode(self, part: EncodedPart) -> torch.Tensor:
        """Decode ``part`` into a new fp32 tensor (never aliasing the part's buffers)."""
        _check_part(part, self.name)
        if self.name == "none":
            t, owned = _as_tensor(part.payload, torch.float32)
            return t if owned else t.clone()
        return _as_tensor(part.payload, torch.float16)[0].float()


class BlockQuantCodec:
    """Blockwise absmax quantization to int8 (levels -127..127) or int4 (levels -7..7), see module docstring."""

    def __init__(self, name: Literal["int8", "int4"] = "int8", block_size: int = 64, scale_dtype: ScaleDtype = "fp32"):
        CodecConfig(name, block_size, scale_dtype)  # validates
        if name not in _LEVELS:
            raise ValueError(f"BlockQuantCodec handles 'int8' and 'int4', got {name!r}")
        self.name, self.block_size, self.scale_dtype = name, block_size, scale_dtype
        self.levels = _LEVELS[name]

    def _scales(self, x: torch.Tensor) -> torch.Tensor:
        n, bs = x.numel(), self.block_size
        num_full = n // bs
        absmax = x.new_empty(-(-n // bs))
        if num_full:
            torch.amax(x[: num_full * bs].view(num_full, bs).abs(), dim=1, out=absmax[:num_full])
        if n % bs:
            absmax[num_full] = x[num_full * bs :].abs().amax()
        if not _all_finite(absmax):
            raise ValueError("cannot encode non-finite values")
        return _stored_scale(absmax / self.levels, self.scale_dtype, self.name, self.levels)

    @staticmethod
    def _blockwise_(vals: torch.Tensor, scale: torch.Tensor, bs: int, op: str) -> torch.Tensor:
        """In place: ``vals[block b].<op>(scale[b])`` for every block of ``bs`` elements; returns ``vals``."""
        num_full = vals.numel() // bs
        if num_full:
            getattr(vals[: num_full * bs].view(num_full, bs), op)(scale[:num_full, None])
        if vals.numel() % bs:
            getattr(vals[num_full * bs :], op)(scale[num_full:])
        return vals

    def encode(self, x: torch.Tensor) -> EncodedPart:
        """Quantize ``x``; raises ValueError for non-finite values (or fp16-scale overflow)."""
        x = _check_input(x)
        scale = self._scales(x)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero blocks quantize to level 0
        q = self._blockwise_(x.clone(), safe, self.block_size, "div_").round_()
        q.clamp_(-self.levels, self.levels)  # guards |x|/scale rounding just above the top level
        if self.name == "int8":
            payload = q.to(torch.int8)
        else:
            u = q.add_(8).to(torch.uint8)
            if u.numel() % 2:
                u = torch.cat([u, u.new_zeros(1)])
            u2 = u.view(-1, 2)
            payload = u2[:, 0] | (u2[:, 1] << 4)
        scales = scale.to(_SCALE_TORCH[self.scale_dtype])
        return EncodedPart(self.name, x.numel(), _tensor_bytes(payload), self.block_size, self.scale_dtype,
                           _tensor_bytes(scales))  # fmt: skip

    def decode(self, part: EncodedPart) -> torch.Tensor:
        """Dequantize ``part`` into a new fp32 tensor of shape (part.num_elements,)."""
        _check_part(part, self.name)
        scale = _as_tensor(part.scales, _SCALE_TORCH[part.scale_dtype])[0].float()
        if self.name == "int8":
            vals = _as_tensor(part.payload, torch.int8)[0].float()
        else:
            p = _as_tensor(part.payload, torch.uint8)[0]
            vals = torch.stack([p & 0xF, p >> 4], dim=1).view(-1)[: part.num_elements].float().sub_(8)
        return self._blockwise_(vals, scale, part.block_size, "mul_")


def _stored_scale(scale: torch.Tensor, scale_dtype: str, name: str, levels: int) -> torch.Tensor:
    """``scale`` (fp32) as it will be stored: fp16 scales are rounded *up*, so that no level clips."""
    if scale_dtype != "fp16":
        return scale
    if scale.numel() and float(scale.amax()) > _FP16_MAX:
        raise ValueError(f"{name} with fp16 scales: absmax exceeds {_FP16_MAX * levels}")
    s16 = scale.half()
    s16 = torch.where(s16.float() < scale, torch.nextafter(s16, torch.full_like(s16, float("inf"))), s16)
    return s16.float()


def make_codec(config: CodecConfig) -> Codec:
    """The codec that ``config`` describes."""
    if config.name == "topk":
        from hivetrain.averaging.topk import TopKCodec  # it builds on this module's frame and helpers

        return TopKCodec(config.block_size, config.k, config.value_bits, config.scale_dtype)
    if config.name in _LEVELS:
        return BlockQuantCodec(config.name, config.block_size, config.scale_dtype)  # type: ignore[arg-type]
    return RawCodec(config.name)  # type: ignore[arg-type]


def decode(part: EncodedPart) -> torch.Tensor:
    """Decode any ``EncodedPart`` (codec, block size and scale dtype come from the part); raises MalformedPart."""
    _check_part(part)
    if part.codec == "topk":
        from hivetrain.averaging.topk import TopKCodec

        k, bits = _TOPK_SUB.unpack_from(memoryview(part.payload).cast("B"))
        return TopKCodec(part.block_size, k, bits, part.scale_dtype).decode(part)  # type: ignore[arg-type]
    if part.codec in _LEVELS:
        return BlockQuantCodec(part.codec, part.block_size, part.scale_dtype).decode(part)  # type: ignore[arg-type]
    return RawCodec(part.codec).decode(part)  # type: ignore[arg-type]


def _check_part(part: EncodedPart, codec: str | None = None) -> None:
    """Raise MalformedPart unless every declared size of ``part`` matches its buffers exactly."""
    if codec is not None and part.codec != codec:
        raise MalformedPart(f"part is {part.codec!r}, decoder is {codec!r}")
    if part.codec not in CODEC_IDS:
        raise MalformedPart(f"unknown codec {part.codec!r}")
    n = part.num_elements
    if not isinstance(n, int) or n < 0:
        raise MalformedPart(f"bad num_elements {n!r}")
    k = bits = 0
    if part.codec in _BLOCKED:
        if part.scale_dtype not in _SCALE_TORCH or not 1 <= part.block_size <= MAX_BLOCK_SIZE:
            raise MalformedPart(f"bad block_size {part.block_size} or scale dtype {part.scale_dtype!r}")
    elif part.block_size != 0 or part.scale_dtype is not None:
        raise MalformedPart(f"{part.codec!r} parts have no blocks")
    if part.codec == "topk":
        head = memoryview(part.payload).cast("B")
        if head.nbytes < _TOPK_SUB.size:
            raise MalformedPart(f"topk payload of {head.nbytes} bytes has no {_TOPK_SUB.size}-byte sub-header")
        k, bits = _TOPK_SUB.unpack_from(head)
        if bytes(head[5:8]) != b"\0\0\0" or bits not in TOPK_VALUE_BITS or not 1 <= k <= part.block_size:
            raise MalformedPart(f"bad topk sub-header (k {k}, {bits} bits, chunk {part.block_size})")
        if part.block_size > MAX_TOPK_CHUNK:
            raise MalformedPart(f"topk chunk of {part.block_size} elements exceeds {MAX_TOPK_CHUNK}")
    for what, buf, want in (
        ("payload", part.payload, payload_num_bytes(part.codec, n, part.block_size, k, bits)),
        ("scales", part.scales, scales_num_bytes(part.codec, n, part.block_size, part.scale_dtype)),
    ):
        if memoryview(buf).nbytes != want:
            raise MalformedPart(f"{what}: {memoryview(buf).nbytes} bytes, {n} {part.codec} elements need {want}")


def to_buffers(part: EncodedPart) -> list[bytes | memoryview]:
    """The frame of ``part`` as [header, payload, scales] buffers (no copy of the payload; for ``sendmsg``)."""
    _check_part(part)
    payload, scales = memoryview(part.payload).cast("B"), memoryview(part.scales).cast("B")
    header = _HEADER.pack(_MAGIC, _VERSION, CODEC_IDS[part.codec], _SCALE_IDS[part.scale_dtype], 0, part.block_size,
                          part.num_elements, payload.nbytes, scales.nbytes)  # fmt: skip
    return [header, payload, scales]


def to_bytes(part: EncodedPart) -> bytes:
    """The frame of ``part`` as one bytes object (``HEADER_NUM_BYTES`` + payload + scales bytes)."""
    return b"".join(to_buffers(part))


def from_bytes(
    frame: bytes | bytearray | memoryview,
    max_num_elements: int,
    allowed_codecs: frozenset[str] | None = None,
    expected: CodecConfig | None = None,
) -> EncodedPart:
    """Parse one frame strictly; the returned part's buffers are zero-copy views into ``frame``.

    Args:
        frame: exactly one frame, as received (no trailing bytes).
        max_num_elements: the largest part the caller accepts, elements (the expected part size).
        allowed_codecs: if given, codec names the caller accepts (e.g. only the round's codec).
        expected: if given, the one encoding the caller accepts: codec, block size, scale dtype and, for "topk", the
            elements kept per chunk and the value width must all be these (a peer sending a denser top-k than the
            round's is refused here).

    Returns:
        The EncodedPart; decode it with ``decode``. Values are not checked for finiteness here
        (``validation.validate_part`` does that after decoding).

    Raises:
        MalformedPart: bad magic/version/reserved byte, unknown codec or scale dtype, a declared size that does not
            match the buffer exactly, num_elements above ``max_num_elements``, an encoding other than
            ``expected``, or non-finite/negative scales.
    """
    mv = memoryview(frame).cast("B")
    if mv.nbytes < HEADER_NUM_BYTES:
        raise MalformedPart(f"frame of {mv.nbytes} bytes is shorter than the {HEADER_NUM_BYTES}-byte header")
    magic, version, codec_id, scale_id, reserved, block_size, n, num_payload, num_scales = _HEADER.unpack_from(mv)
    if magic != _MAGIC or version != _VERSION or reserved != 0:
        raise MalformedPart(f"bad header (magic {magic!r}, version {version}, reserved {reserved})")
    if codec_id not in _CODEC_NAMES or scale_id not in _SCALE_NAMES:
        raise MalformedPart(f"unknown codec id {codec_id} or scale dtype id {scale_id}")
    codec = _CODEC_NAMES[codec_id]
    if allowed_codecs is not None and codec not in allowed_codecs:
        raise MalformedPart(f"codec {codec!r} not allowed here (allowed: {sorted(allowed_codecs)})")
    if n > max_num_elements:
        raise MalformedPart(f"part declares {n} elements, at most {max_num_elements} accepted")
    if HEADER_NUM_BYTES + num_payload + num_scales != mv.nbytes:
        raise MalformedPart(
            f"declared {num_payload}+{num_scales} bytes after the header, got {mv.nbytes - HEADER_NUM_BYTES}"
        )
    end = HEADER_NUM_BYTES + num_payload
    part = EncodedPart(codec, n, mv[HEADER_NUM_BYTES:end], block_size, _SCALE_NAMES[scale_id], mv[end:])
    _check_part(part)
    if expected is not None:
        got = (part.codec, part.block_size, part.scale_dtype)
        blocked = expected.name in _BLOCKED
        want = (expected.name,) + ((expected.block_size, expected.scale_dtype) if blocked else (0, None))
        if part.codec == "topk":
            got += _TOPK_SUB.unpack_from(memoryview(part.payload).cast("B"))
            want += (expected.k, expected.value_bits)
        if got != want:
            raise MalformedPart(f"encoding {got} is not this round's {want}")
    if part.scale_dtype is not None:
        scales = _as_tensor(part.scales, _SCALE_TORCH[part.scale_dtype])[0]
        if scales.numel() and not (_all_finite(scales) and float(scales.amin()) >= 0.0):
            raise MalformedPart("block scales must be finite and >= 0")
    return part
