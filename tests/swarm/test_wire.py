"""Messages between trainers and stage servers: compression round trips and validation of everything received."""

from __future__ import annotations

import msgpack
import pytest
import torch
from hivemind.proto import runtime_pb2

from hivetrain.swarm import wire

H = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))


def test_round_trips_per_compression():
    assert torch.equal(wire.decode(wire.encode(H, "none"), torch.float32, (2, 8, 16)), H)
    torch.testing.assert_close(wire.decode(wire.encode(H, "fp16"), torch.float32, (2, 8, 16)), H, atol=2e-3, rtol=1e-3)
    q = wire.decode(wire.encode(H, "uint8"), torch.float32, (2, 8, 16))
    assert (q - H).abs().max() < 0.1 and q.dtype == torch.float32
    ids = torch.randint(0, 256, (2, 8))
    proto = wire.encode(ids, "uint8")  # token ids are never compressed
    assert proto.compression == runtime_pb2.CompressionType.NONE
    assert torch.equal(wire.decode(proto, torch.int64, (2, 8), vocab_size=256), ids)
    big = torch.randn(4, 32, 128)
    assert len(wire.encode(big, "fp16").buffer) == big.numel() * 2
    assert len(wire.encode(big, "uint8").buffer) == 8 + 256 * 4 + big.numel()


def _corrupt(proto: runtime_pb2.Tensor, **fields) -> runtime_pb2.Tensor:
    bad = runtime_pb2.Tensor()
    bad.CopyFrom(proto)
    for key, value in fields.items():
        if key == "size":
            del bad.size[:]
            bad.size.extend(value)
        else:
            setattr(bad, key, value)
    return bad


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: wire.encode(H), None),
        (lambda: _corrupt(wire.encode(H), dtype="float64"), "dtype"),
        (lambda: _corrupt(wire.encode(H), dtype="object"), "dtype"),
        (lambda: _corrupt(wire.encode(H), size=[2, 8, 17]), "shape"),
        (lambda: _corrupt(wire.encode(H), buffer=wire.encode(H).buffer[:-4]), "buffer"),
        (lambda: _corrupt(wire.encode(H, "fp16"), buffer=b"\x00" * 10), "buffer"),
        (lambda: _corrupt(wire.encode(H, "uint8"), buffer=b"\x05" + wire.encode(H, "uint8").buffer[1:]), "codebook"),
        (lambda: wire.encode(H.clone().index_fill_(0, torch.tensor([1]), float("nan"))), "NaN"),
        (lambda: wire.encode(torch.full((2, 8, 16), float("inf"))), "NaN or Inf"),
        (lambda: _corrupt(wire.encode(H), compression=runtime_pb2.CompressionType.BLOCKWISE_8BIT), "buffer|allowed"),
    ],
)
def test_decode_rejects_malformed_or_non_finite_tensors(make, match):
    proto = make()
    if match is None:
        wire.decode(proto, torch.float32, (2, 8, 16))
        return
    with pytest.raises(wire.BadTensor, match=match):
        wire.decode(proto, torch.float32, (2, 8, 16))


def test_decode_rejects_bad_token_ids_and_compressed_ids():
    with pytest.raises(wire.BadTensor, match="outside"):
        wire.decode(wire.encode(torch.tensor([[1, 256]])), torch.int64, (1, 2), vocab_size=256)
    with pytest.raises(wire.BadTensor, match="outside"):
        wire.decode(wire.encode(torch.tensor([[-1, 3]])), torch.int64, (1, 2), vocab_size=256)
    fp16_ids = _corrupt(wire.encode(torch.tensor([[1, 2]])), compression=runtime_pb2.CompressionType.FLOAT16)
    with pytest.raises(wire.BadTensor, match="not allowed"):
        wire.decode(fp16_ids, torch.int64, (1, 2), vocab_size=256)
    with pytest.raises(TypeError):
        wire.encode(torch.zeros(2, dtype=torch.float64))


def test_metadata_is_schema_checked():
    meta = wire.BackwardMeta(microbatch_id="t:1:0", stage=2, deadline=5.0, replay=True)
    assert wire.unpack_meta(wire.pack_meta(meta), wire.BackwardMeta) == meta
    for raw in [b"\xc1garbage", msgpack.packb({"kind": "forward"}), msgpack.packb({**meta.model_dump(), "evil": 1})]:
        with pytest.raises(wire.BadMessage):
            wire.unpack_meta(raw, wire.BackwardMeta)
    with pytest.raises(wire.BadMessage, match="exceeds"):
        wire.unpack_meta(b"\x00" * (wire.MAX_META_BYTES + 1), wire.ReplyMeta)
    with pytest.raises(wire.BadMessage):
        wire.unpack_meta(wire.pack_meta(meta), wire.ForwardMeta)  # a backward message is not a forward one


def test_stream_parts_reassemble_and_respect_the_size_limit():
    big = torch.randn(3, 100, 50)
    protos = [wire.encode(big), wire.encode(torch.randint(0, 9, (3, 100)))]
    parts = list(wire.to_parts(b"meta", protos, part_num_bytes=1000))
    assert len(parts) > 60 and parts[0].metadata == b"meta" and all(not p.metadata for p in parts[1:])
    assembler = wire.PartsAssembler(max_num_bytes=10**6)
    for part in parts:
        assembler.add(part)
    assert assembler.metadata == b"meta"
    joined = assembler.tensors()
    assert torch.equal(wire.decode(joined[0], torch.float32, (3, 100, 50)), big)
    small = wire.PartsAssembler(max_num_bytes=5000)
    with pytest.raises(wire.BadMessage, match="exceeds"):
        for part in parts:
            small.add(part)
    stray = wire.PartsAssembler(max_num_bytes=10**6)
    with pytest.raises(wire.BadMessage, match="continuation"):
        stray.add(runtime_pb2.ExpertRequest(tensors=[runtime_pb2.Tensor(buffer=b"xx")]))
