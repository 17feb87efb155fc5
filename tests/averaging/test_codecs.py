"""Codecs: round trips, documented error bounds, deterministic bytes, strict frame parsing, error feedback."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from hivetrain.averaging.codecs import (
    HEADER_NUM_BYTES,
    BlockQuantCodec,
    CodecConfig,
    EncodedPart,
    MalformedPart,
    RawCodec,
    decode,
    from_bytes,
    make_codec,
    to_buffers,
    to_bytes,
)
from hivetrain.averaging.feedback import ErrorFeedback

ALL_CONFIGS = [
    CodecConfig("none"),
    CodecConfig("fp16"),
    CodecConfig("int8", 64, "fp32"),
    CodecConfig("int8", 128, "fp16"),
    CodecConfig("int4", 64, "fp32"),
    CodecConfig("int4", 33, "fp16"),
]
SIZES = [0, 1, 2, 63, 64, 65, 1001]


def _blockwise_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-element absmax of the element's block, shape (n,), by a slow obvious loop."""
    out = torch.empty_like(x)
    for start in range(0, x.numel(), block_size):
        out[start : start + block_size] = x[start : start + block_size].abs().max()
    return out


def _golden_input(n: int) -> torch.Tensor:
    """Inputs built from exact arithmetic only, so they are identical on every machine."""
    i = torch.arange(n, dtype=torch.int64)
    return (((i * 7919) % 1000) - 500).to(torch.float32) / 37.0


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda c: f"{c.name}-{c.block_size}-{c.scale_dtype}")
@pytest.mark.parametrize("n", SIZES)
def test_round_trip_within_documented_bound(config: CodecConfig, n: int) -> None:
    torch.manual_seed(n)
    x = torch.randn(n) * torch.logspace(-3, 3, n) if n else torch.zeros(0)
    codec = make_codec(config)
    part = codec.encode(x)
    y = codec.decode(part)
    assert y.dtype == torch.float32 and y.shape == (n,)
    err = (x - y).abs()
    if config.name == "none":
        assert torch.equal(x, y)
    elif config.name == "fp16":
        bound = torch.maximum(x.abs() * 2**-11, torch.full_like(x, 2**-25))
        assert bool((err <= bound).all())
    else:
        levels = 127 if config.name == "int8" else 7
        absmax = _blockwise_absmax(x, config.block_size)
        scale = absmax / levels
        if config.scale_dtype == "fp16":  # rounded up to the next fp16 value: at most 2**-10 relatively larger
            scale = scale * (1 + 2**-10)
        bound = scale / 2 * (1 + 1e-5) + x.abs() * 2**-23
        assert bool((err <= bound).all()), f"max excess {(err - bound).max()}"
    # the frame round-trips to the same decoded values
    parsed = from_bytes(to_bytes(part), max_num_elements=n)
    assert torch.equal(decode(parsed), y)
    assert part.num_bytes == len(to_bytes(part))


def test_wire_sizes_are_as_documented() -> None:
    x = torch.randn(1000)
    sizes = {c.name + c.scale_dtype: make_codec(c).encode(x).num_bytes - HEADER_NUM_BYTES for c in ALL_CONFIGS[:5]}
    assert sizes == {
        "nonefp32": 4000,
        "fp16fp32": 2000,
        "int8fp32": 1000 + 16 * 4,
        "int8fp16": 1000 + 8 * 2,
        "int4fp32": 500 + 16 * 4,
    }


def test_all_zero_blocks_decode_to_zero() -> None:
    x = torch.zeros(200)
    x[150] = 3.0
    for name in ("int8", "int4"):
        y = make_codec(CodecConfig(name, 64)).decode(make_codec(CodecConfig(name, 64)).encode(x))
        assert torch.equal(y[:128], torch.zeros(128)) and y[150] == 3.0 and bool(torch.isfinite(y).all())


@pytest.mark.parametrize(
    "config,digest",
    [
        (CodecConfig("none"), "7931263831f3ced7"),
        (CodecConfig("fp16"), "c0876eea51ec9249"),
        (CodecConfig("int8", 64, "fp32"), "c6d73e2af722d5c6"),
        (CodecConfig("int4", 64, "fp16"), "de6369831ec56145"),
    ],
    ids=lambda v: getattr(v, "name", v),
)
def test_encoding_is_deterministic_golden(config: CodecConfig, digest: str) -> None:
    """Same input -> same bytes, pinned by a digest so another machine or torch version must reproduce them."""
    x = _golden_input(4099)
    first, second = to_bytes(make_codec(config).encode(x)), to_bytes(make_codec(config).encode(x.clone()))
    assert first == second
    assert hashlib.sha256(first).hexdigest()[:16] == digest


def _f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


@pytest.mark.parametrize("name,levels", [("int8", 127), ("int4", 7)])
def test_quantized_frame_matches_pure_python_reference(name: str, levels: int) -> None:
    """The frame equals one built by an independent scalar implementation of the documented format.

    fp32 division computed in float64 and rounded once to fp32 is correctly rounded, and Python's round() is
    round-half-to-even, so the reference is exact.
    """
    n, block = 131, 64
    xs = [_f32(v) for v in _golden_input(n).tolist()]
    scales, levels_out = [], []
    for start in range(0, n, block):
        blk = xs[start : start + block]
        scale = _f32(max(abs(v) for v in blk) / levels)
        scales.append(scale)
        levels_out += [max(-levels, min(levels, round(_f32(v / scale)))) if scale > 0 else 0 for v in blk]
    if name == "int8":
        payload = struct.pack(f"<{n}b", *levels_out)
    else:
        nibbles = [q + 8 for q in levels_out] + [0]
        payload = bytes(nibbles[i] | (nibbles[i + 1] << 4) for i in range(0, n, 2))
    header = struct.pack("<4sBBBBIQQQ", b"HVP1", 1, {"int8": 2, "int4": 3}[name], 1, 0, block, n, len(payload), 12)
    expected = header + payload + struct.pack("<3f", *scales)
    assert to_bytes(make_codec(CodecConfig(name, block, "fp32")).encode(_golden_input(n))) == expected


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda c: f"{c.name}-{c.scale_dtype}")
def test_encode_rejects_non_finite(config: CodecConfig, bad: float) -> None:
    x = torch.randn(300)
    x[77] = bad
    with pytest.raises(ValueError, match="finite"):
        make_codec(config).encode(x)


def test_encode_rejects_wrong_input() -> None:
    codec = make_codec(CodecConfig("int8"))
    with pytest.raises(ValueError, match="1-D fp32"):
        codec.encode(torch.randn(4, 4))
    with pytest.raises(ValueError, match="1-D fp32"):
        codec.encode(torch.randn(16, dtype=torch.float64))
    with pytest.raises(TypeError):
        codec.encode([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="65504"):
        RawCodec("fp16").encode(torch.tensor([70000.0]))
    with pytest.raises(ValueError, match="fp16 scales"):
        BlockQuantCodec("int4", 64, "fp16").encode(torch.tensor([1e6]))


@pytest.mark.parametrize(
    "kwargs", [{"name": "int2"}, {"block_size": 0}, {"block_size": 1 << 21}, {"scale_dtype": "bf16"}]
)
def test_codec_config_rejects_bad_fields(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        CodecConfig(**kwargs)


def test_from_bytes_is_zero_copy_and_decode_does_not_alias() -> None:
    x = torch.randn(500)
    frame = bytearray(to_bytes(make_codec(CodecConfig("none")).encode(x)))
    part = from_bytes(frame, max_num_elements=500)
    y = decode(part)
    assert torch.equal(y, x)
    frame[HEADER_NUM_BYTES : HEADER_NUM_BYTES + 4] = b"\x00\x00\x00\x00"  # the part views the frame...
    assert bytes(part.payload[:4]) == b"\x00\x00\x00\x00"
    assert torch.equal(y, x)  # ...but the decoded tensor owns its memory
    assert torch.equal(decode(from_bytes(bytes(to_bytes(part)), 500))[1:], x[1:])  # read-only bytes work too


def test_to_buffers_matches_to_bytes() -> None:
    part = make_codec(CodecConfig("int4", 64)).encode(torch.randn(777))
    assert b"".join(bytes(b) for b in to_buffers(part)) == to_bytes(part)


def _frame(n: int = 300, config: CodecConfig = CodecConfig("int8", 64)) -> bytes:
    return to_bytes(make_codec(config).encode(torch.randn(n)))


def _patch_header(frame: bytes, index: int, value: int) -> bytes:
    fields = list(struct.unpack_from("<4sBBBBIQQQ", frame))
    fields[index] = value
    return struct.pack("<4sBBBBIQQQ", *fields) + frame[HEADER_NUM_BYTES:]


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda f: f[:10], "shorter than"),
        (lambda f: f[:-1], "declared"),
        (lambda f: f + b"\x00", "declared"),
        (lambda f: b"XXXX" + f[4:], "bad header"),
        (lambda f: _patch_header(f, 1, 2), "bad header"),
        (lambda f: _patch_header(f, 4, 1), "bad header"),
        (lambda f: _patch_header(f, 2, 9), "unknown codec"),
        (lambda f: _patch_header(f, 3, 7), "unknown codec"),
        (lambda f: _patch_header(f, 6, 301), "payload:"),
        (lambda f: _patch_header(f, 6, 10**9), "at most"),
        (lambda f: _patch_header(f, 5, 32), "scales:"),
        (lambda f: _patch_header(f, 5, 0), "block_size"),
        (lambda f: _patch_header(f, 2, 0), "no blocks"),
        (lambda f: _patch_header(f, 3, 2), "scales:"),
    ],
)
def test_from_bytes_rejects_malformed_frames(mutate, match: str) -> None:
    with pytest.raises(MalformedPart, match=match):
        from_bytes(mutate(_frame()), max_num_elements=1000)


def test_from_bytes_rejects_bad_scales_and_disallowed_codec() -> None:
    frame = bytearray(_frame(64))
    frame[-4:] = struct.pack("<f", float("nan"))
    with pytest.raises(MalformedPart, match="scales"):
        from_bytes(frame, 64)
    frame[-4:] = struct.pack("<f", -1.0)
    with pytest.raises(MalformedPart, match="scales"):
        from_bytes(frame, 64)
    with pytest.raises(MalformedPart, match="not allowed"):
        from_bytes(_frame(64), 64, allowed_codecs=frozenset({"int4"}))
    assert from_bytes(_frame(64), 64, allowed_codecs=frozenset({"int8"})).num_elements == 64


@pytest.mark.parametrize(
    "config", [CodecConfig("int4", 64), CodecConfig("topk", 64, "fp32", 4, 4)], ids=lambda c: c.name
)
def test_random_corruption_raises_only_malformed_part(config: CodecConfig) -> None:
    """Flipping bytes anywhere yields MalformedPart or a structurally valid part, never another exception."""
    gen = torch.Generator().manual_seed(0)
    frame = _frame(130, config)
    outcomes = {"rejected": 0, "accepted": 0}
    for trial in range(300):
        corrupt = bytearray(frame)
        for pos in torch.randint(0, len(frame), (1 + trial % 3,), generator=gen).tolist():  # 1 to 3 bytes
            corrupt[pos] = int(torch.randint(0, 256, (1,), generator=gen))
        try:
            decode(from_bytes(corrupt, max_num_elements=200))
            outcomes["accepted"] += 1
        except MalformedPart:
            outcomes["rejected"] += 1
    assert outcomes["rejected"] > 0 and outcomes["accepted"] > 0


def test_decoder_rejects_inconsistent_encoded_part() -> None:
    with pytest.raises(MalformedPart, match="payload:"):
        decode(EncodedPart("int8", 10, b"\x00" * 9, 64, "fp32", b"\x00" * 4))
    with pytest.raises(MalformedPart, match="decoder"):
        RawCodec("none").decode(EncodedPart("fp16", 1, b"\x00\x00"))
    with pytest.raises(MalformedPart, match="unknown codec"):
        decode(EncodedPart("zstd", 1, b"\x00"))


def _round_with_feedback(codec, ef: ErrorFeedback, x: torch.Tensor, block: int) -> torch.Tensor:
    """What a round does with EF: send ``x + residual`` slice by slice; the scratch gets what the codec dropped."""
    flat = x.clone()
    scratch = ef.apply(flat)
    sent = torch.empty_like(flat)
    for start in range(0, flat.numel(), block):  # slices as reducers get them, each encoded on its own
        piece = flat[start : start + block]
        sent[start : start + block] = codec.decode(codec.encode(piece))
        torch.sub(piece, sent[start : start + block], out=scratch[start : start + block])
    return sent


def test_error_feedback_sends_the_compression_error_later() -> None:
    """With EF, the sum of what was sent tracks the sum of the inputs to within one round's error (Karimireddy 2019)."""
    torch.manual_seed(1)
    codec = make_codec(CodecConfig("int4", 64))
    ef = ErrorFeedback()
    xs = [torch.randn(1000) * 0.01 + 0.003 for _ in range(20)]
    sent = torch.zeros(1000)
    for x in xs:
        sent += _round_with_feedback(codec, ef, x, 250)
        ef.commit()
    total = torch.stack(xs).sum(0)
    residual = ef.residual
    assert residual is not None
    torch.testing.assert_close(sent + residual, total, rtol=0, atol=1e-5)  # nothing lost: it is sent or kept
    ef_err = (sent - total).abs().max()
    plain_err = (torch.stack([codec.decode(codec.encode(x)) for x in xs]).sum(0) - total).abs().max()
    assert ef_err <= _blockwise_absmax(xs[-1] + residual, 64).max() / 14 + 1e-6  # one round's bound, not 20
    assert ef_err < plain_err / 3


def test_error_feedback_keeps_the_residual_when_a_round_fails() -> None:
    codec = make_codec(CodecConfig("int8", 64))
    ef = ErrorFeedback()
    x = torch.randn(100)
    _round_with_feedback(codec, ef, x, 100)
    ef.commit()
    first = ef.residual.clone()
    assert first.abs().max() > 0
    _round_with_feedback(codec, ef, x, 100)  # this round fails: no commit
    assert torch.equal(ef.residual, first)  # the retry adds the same residual again, not a newer one
    flat = x.clone()
    ef.apply(flat)
    torch.testing.assert_close(flat, x + first, rtol=0, atol=0)
    ef.commit_exact()  # applied without encoding (a group of one): nothing left over
    assert torch.count_nonzero(ef.residual) == 0
    flat = torch.ones(50)
    ef.apply(flat)  # another size: starts over from zero
    assert torch.equal(flat, torch.ones(50)) and ef.residual.numel() == 50
    ef.reset()
    assert ef.residual is None


def test_decayed_error_feedback_adds_beta_times_the_residual_and_refuses_a_beta_outside_0_1() -> None:
    """SparseLoCo's accumulator (Sarfi et al. 2025, Alg. 1): e <- beta*e + delta; beta = 1 is plain EF, bit for bit."""
    codec = make_codec(CodecConfig("int4", 64))
    x = torch.randn(256)
    plain, decayed = ErrorFeedback(), ErrorFeedback(decay=0.5)
    for ef in (plain, decayed):
        _round_with_feedback(codec, ef, x, 256)
        ef.commit()
    torch.testing.assert_close(decayed.residual, plain.residual, rtol=0, atol=0)  # same first round
    residual = plain.residual.clone()
    flat_plain, flat_decayed = x.clone(), x.clone()
    plain.apply(flat_plain)
    decayed.apply(flat_decayed)
    assert torch.equal(flat_plain, x + residual)
    torch.testing.assert_close(flat_decayed, x + 0.5 * residual, rtol=0, atol=0)
    for beta in (0.0, -0.1, 1.01, float("nan")):
        with pytest.raises(ValueError, match="decay must be in"):
            ErrorFeedback(decay=beta)
