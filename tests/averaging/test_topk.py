"""The "topk" codec: chunked top-k sparsification with quantized values, strict parsing, and error feedback."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from hivetrain.averaging.codecs import (
    HEADER_NUM_BYTES,
    CodecConfig,
    EncodedPart,
    MalformedPart,
    decode,
    from_bytes,
    to_bytes,
    topk_bitmap,
    topk_kept,
)
from hivetrain.averaging.config import AveragingConfig
from hivetrain.averaging.feedback import ErrorFeedback
from hivetrain.averaging.reduce import part_codec, result_codec
from hivetrain.averaging.topk import TopKCodec

SUB = struct.Struct("<IB3x")


@pytest.mark.parametrize("k", [2, 5, 40])  # positions as offsets (2 of 64), as bitmaps (5 and 40 of 64)
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 5, 64, 200, 64 * 3 + 17])
def test_keeps_the_k_largest_of_each_chunk_within_the_value_bound(k: int, bits: int, n: int) -> None:
    torch.manual_seed(n + bits)
    x = torch.randn(n) * torch.logspace(-2, 2, n) if n else torch.zeros(0)
    config = CodecConfig("topk", 64, "fp32", k, bits)
    codec = TopKCodec(64, k, bits)
    frame = to_bytes(codec.encode(x))
    assert len(frame) == config.frame_num_bytes(n)
    y = decode(from_bytes(frame, n, expected=config))
    assert y.dtype == torch.float32 and y.shape == (n,)
    levels = 2 ** (bits - 1) - 1
    for start in range(0, n, 64):
        chunk, got = x[start : start + 64], y[start : start + 64]
        kept = torch.topk(chunk.abs(), min(k, chunk.numel())).indices
        dropped = torch.ones(chunk.numel(), dtype=torch.bool)
        dropped[kept] = False
        assert torch.count_nonzero(got[dropped]) == 0  # only kept elements are sent
        bound = chunk[kept].abs().max() / levels / 2 * (1 + 2**-20)
        assert (got[kept] - chunk[kept]).abs().max() <= bound  # kept ones within half a level
        assert torch.all(torch.sign(got[kept]) * torch.sign(chunk[kept]) >= 0)  # never the wrong sign
    assert topk_kept(n, 64, k) == (n // 64) * k + min(k, n % 64)


def test_bytes_per_element_at_two_percent() -> None:
    # 2% of 4096-element chunks, 2-bit values: 82 uint16 offsets + 20.5 bytes of codes + one fp32 scale per 16 KiB
    config = CodecConfig("topk", 4096, "fp32", 82, 2)
    n = 4096 * 256
    assert config.frame_num_bytes(n) == HEADER_NUM_BYTES + SUB.size + 256 * (82 * 2 + 4) + 256 * 82 * 2 // 8
    assert 4 * n / config.frame_num_bytes(n) > 85  # vs fp32


def _frame(x: torch.Tensor, k: int = 4, bits: int = 4) -> bytearray:
    return bytearray(to_bytes(TopKCodec(64, k, bits).encode(x)))


def _offsets_at() -> int:
    return HEADER_NUM_BYTES + SUB.size


def test_an_offset_outside_its_chunk_is_refused() -> None:
    x = torch.randn(100)  # chunks of 64 and 36, 2 kept of each (as offsets): the second's must stay below 36
    frame = _frame(x, k=2)
    offsets = np.frombuffer(frame, np.uint16, 4, _offsets_at()).copy()
    offsets[3] = 40  # the last offset of the 36-element chunk
    frame[_offsets_at() : _offsets_at() + 8] = offsets.tobytes()
    with pytest.raises(MalformedPart, match="strictly ascending and below 36"):
        decode(from_bytes(frame, 100))


def test_positions_travel_as_the_smaller_of_offsets_and_a_bitmap() -> None:
    # 3% of 4096 (123 kept): offsets, 246 bytes < 512; a group of 4's result (492 kept): the 512-byte bitmap
    assert not topk_bitmap(4096, 123) and topk_bitmap(4096, 492) and not topk_bitmap(64, 4)  # a tie: offsets
    for k, index in ((123, 246), (492, 512)):
        config = CodecConfig("topk", 4096, "fp32", k, 8)
        assert config.frame_num_bytes(4096) == HEADER_NUM_BYTES + SUB.size + index + k + 4
    frame = _frame(torch.randn(100), k=20, bits=2)  # bitmaps: 8 bytes for the chunk of 64, 5 for the one of 36
    assert len(frame) == HEADER_NUM_BYTES + SUB.size + 8 + 5 + 40 * 2 // 8 + 2 * 4
    bitmap = np.unpackbits(np.frombuffer(frame, np.uint8, 13, _offsets_at()), bitorder="little")
    assert bitmap[:64].sum() == 20 and bitmap[64 : 64 + 36].sum() == 20 and not bitmap[100:].any()


def test_a_bitmap_with_a_bit_too_many_or_past_its_chunk_is_refused() -> None:
    frame = _frame(torch.randn(100), k=20, bits=2)
    byte = next(i for i in range(8) if frame[_offsets_at() + i] != 0xFF)
    denser = bytearray(frame)
    denser[_offsets_at() + byte] |= 1 << next(b for b in range(8) if not frame[_offsets_at() + byte] >> b & 1)
    with pytest.raises(MalformedPart, match="exactly 20 of 64"):
        decode(from_bytes(denser, 100))  # one position more than the round's k: a denser part
    past = bytearray(frame)
    past[_offsets_at() + 12] |= 0x80  # bit 7 of the 36-element chunk's last byte: element 39
    with pytest.raises(MalformedPart, match="past the chunk's 36 elements"):
        decode(from_bytes(past, 100))


def test_a_repeated_offset_is_refused() -> None:
    frame = _frame(torch.randn(64))
    offsets = np.frombuffer(frame, np.uint16, 4, _offsets_at()).copy()
    offsets[1] = offsets[0]  # the same element twice: its value would count twice on some decoders
    frame[_offsets_at() : _offsets_at() + 8] = offsets.tobytes()
    with pytest.raises(MalformedPart, match="strictly ascending"):
        decode(from_bytes(frame, 64))


def test_a_code_off_the_grid_is_refused() -> None:
    frame = _frame(torch.randn(64), k=4, bits=4)
    codes_at = _offsets_at() + 8
    frame[codes_at] = 0x00  # code 0 would be level -8, one below the grid's -7
    with pytest.raises(MalformedPart, match="codes must lie in 1..15"):
        decode(from_bytes(frame, 64))


def test_a_denser_or_wider_part_than_the_rounds_is_refused() -> None:
    x = torch.randn(640)
    ours = CodecConfig("topk", 64, "fp32", 4, 4)
    decode(from_bytes(_frame(x, k=4), 640, expected=ours))
    with pytest.raises(MalformedPart, match="not this round's"):
        from_bytes(_frame(x, k=8), 640, expected=ours)  # twice the density
    with pytest.raises(MalformedPart, match="not this round's"):
        from_bytes(_frame(x, k=4, bits=8), 640, expected=ours)


def test_non_finite_values_and_scales_are_refused() -> None:
    with pytest.raises(ValueError, match="non-finite"):
        TopKCodec(64, 4, 4).encode(torch.tensor([1.0, float("nan")] * 40))
    frame = _frame(torch.randn(64))
    scale_at = len(frame) - 4
    frame[scale_at:] = struct.pack("<f", float("nan"))
    with pytest.raises(MalformedPart, match="scales must be finite"):
        from_bytes(frame, 64)


def test_a_bad_sub_header_is_refused() -> None:
    frame = _frame(torch.randn(64))
    for k, bits in ((0, 4), (65, 4), (4, 3)):
        bad = bytearray(frame)
        bad[HEADER_NUM_BYTES : HEADER_NUM_BYTES + SUB.size] = SUB.pack(k, bits)
        with pytest.raises(MalformedPart):
            decode(from_bytes(bad, 64))
    with pytest.raises(MalformedPart, match="sub-header"):
        decode(EncodedPart("topk", 64, b"\x00" * 4, 64, "fp32", b"\x00" * 4))


def test_error_feedback_residual_stays_bounded_over_100_outer_steps() -> None:
    """A synthetic stream of pseudo-gradients (a slowly turning signal plus noise), 2% density at 2 bits: what was
    sent plus the residual is exactly what was fed in, and the residual does not grow with the steps (EF-SGD's
    contraction: every coordinate that grows large enough is sent)."""
    torch.manual_seed(3)
    n, codec = 64 * 64, TopKCodec(64, 2, 2)  # 2 of 64: 3% density
    ef, sent, total = ErrorFeedback(), torch.zeros(n), torch.zeros(n)
    direction = torch.randn(n)
    norms = []
    for step in range(100):
        x = 0.01 * (direction * (1 + 0.3 * np.sin(step / 10)) + torch.randn(n))
        flat = x.clone()
        scratch = ef.apply(flat)
        got = codec.decode(codec.encode(flat))
        torch.sub(flat, got, out=scratch)
        ef.commit()
        sent += got
        total += x
        norms.append(float(ef.residual.norm()))
    torch.testing.assert_close(sent + ef.residual, total, rtol=0, atol=1e-4)  # nothing lost
    assert max(norms[50:]) <= 1.5 * max(norms[:50])  # no growth past the first half's level
    assert max(norms) < 0.3 * float(total.norm())  # and far below what 100 steps carried


def test_config_refuses_topk_without_error_feedback_or_with_robust_aggregation() -> None:
    with pytest.raises(ValueError, match="without error feedback"):
        AveragingConfig(compression="topk")
    with pytest.raises(ValueError, match="coordinate median"):
        AveragingConfig(compression="topk", error_feedback=True, aggregation="centered_clip")
    with pytest.raises(ValueError):
        AveragingConfig(compression="topk", error_feedback=True, topk_value_bits=3)
    assert (AveragingConfig().topk_density, AveragingConfig().topk_value_bits) == (0.1, 2)  # the bench's pick
    config = AveragingConfig(compression="topk", error_feedback=True, topk_density=0.02, topk_chunk=4096,
                             topk_value_bits=4)  # fmt: skip
    part = part_codec(config)
    assert (part.name, part.block_size, part.k, part.value_bits) == ("topk", 4096, 82, 4)
    assert part_codec(config, fan_in=4).k == 328 and part_codec(config, fan_in=4).value_bits == 8
    result = result_codec(part, 8)
    assert (result.k, result.value_bits) == (656, 8)  # every element any of 8 members sent
    assert result_codec(part, 100).k == 4096  # capped at the chunk
    assert result_codec(part_codec(AveragingConfig(compression="int8")), 8) == part_codec(
        AveragingConfig(compression="int8")
    )


def test_run_config_refuses_topk_with_moshpit() -> None:
    from hivetrain.config import RunConfig

    with pytest.raises(ValueError, match="sparsifying θ"):
        RunConfig.from_dict({"averaging": {"strategy": "moshpit", "compression": "topk", "error_feedback": True}})
