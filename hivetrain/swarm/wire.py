"""Typed, compressed, validated messages between pipeline trainers and stage servers.

A call is a hivemind ``runtime_pb2.ExpertRequest``: ``metadata`` holds a msgpack dict validated by a pydantic model
(``ForwardMeta``, ``BackwardMeta``; replies ``ReplyMeta``), ``tensors`` hold hivemind-serialized tensors. Activations
and gradients travel as fp32 ("none"), fp16 or hivemind's uniform 8-bit quantization; token ids always travel
uncompressed. Nothing from the network is unpickled.

Every received tensor is checked before use (``decode``): compression among the allowed ones, dtype, exact shape,
buffer length consistent with the shape (checked before any allocation), finite values, token ids in the vocabulary.
A bad tensor raises ``BadTensor``; a trainer bans the server that sent it, a server rejects the request.

Payloads above hivemind's unary limit travel over a stream: ``to_parts`` splits a message into ExpertRequests of at
most ``part_num_bytes`` each (the first carries the metadata) and ``from_parts`` joins them back.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Literal, TypeVar

import msgpack
import numpy as np
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p.p2p_daemon_bindings.control import MAX_UNARY_PAYLOAD_SIZE
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import split_for_streaming
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hivetrain.swarm.config import Compression

MAX_META_BYTES = 64 * 1024
PART_NUM_BYTES = 2**20
UNARY_LIMIT_NUM_BYTES = MAX_UNARY_PAYLOAD_SIZE // 2

_CODES = {
    "none": runtime_pb2.CompressionType.NONE,
    "fp16": runtime_pb2.CompressionType.FLOAT16,
    "uint8": runtime_pb2.CompressionType.UNIFORM_8BIT,
}
_DTYPE_NAMES = {torch.float32: "float32", torch.int64: "int64"}
_UINT8_CODEBOOK = 256


class BadTensor(ValueError):
    """A received tensor failed validation (wrong shape/dtype/compression, inconsistent buffer, NaN/Inf, bad ids)."""


class BadMessage(ValueError):
    """A received message's metadata is malformed (not msgpack, too large, or not matching its schema)."""


class _Meta(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ForwardMeta(_Meta):
    """A forward call: run ``stage`` on the input tensor for microbatch ``microbatch_id``.

    Attributes:
        deadline: unix time after which the trainer no longer waits for the reply, seconds.
        urgent: the microbatch was rerouted around a failed server: the server runs it before everything but control
            tasks, so that a failure costs the microbatch one reroute, not a wait behind the survivor's queue.
    """

    kind: Literal["forward"] = "forward"
    microbatch_id: str = Field(min_length=1, max_length=128)
    stage: int = Field(ge=0, le=1024)
    deadline: float = Field(ge=0.0)
    urgent: bool = False


class BackwardMeta(_Meta):
    """A backward call: recompute ``stage`` from the kept input, backpropagate ``grad_output``.

    Attributes:
        accumulate: add the parameter gradients to the server's accumulator (False = only return the input gradient).
        replay: the call only re-adds parameter gradients lost with another server (the input gradient was already
            propagated; the server returns none).
        urgent: as ``ForwardMeta.urgent``.
    """

    kind: Literal["backward"] = "backward"
    microbatch_id: str = Field(min_length=1, max_length=128)
    stage: int = Field(ge=0, le=1024)
    deadline: float = Field(ge=0.0)
    accumulate: bool = True
    replay: bool = False
    urgent: bool = False


Status = Literal["ok", "busy", "expired", "wrong_stage", "bad_request", "error"]


class ReplyMeta(_Meta):
    """A server's reply.

    Attributes:
        status: "ok"; "busy" (syncing or moving: retry elsewhere, no ban); "expired" (finished after the deadline,
            nothing accumulated); "wrong_stage"; "bad_request"; "error".
        incarnation: random id of this server process; a new one means earlier accumulations are gone.
        window: the accumulation window this backward's gradients went into (-1 = none).
        open_window: the server's current window; windows below it are closed (applied or abandoned).
        abandoned: recently closed windows whose gradients were dropped instead of applied (trainers replay them).
        queue_len: microbatches waiting at the server when it replied.
    """

    status: Status
    detail: str = Field(default="", max_length=512)
    incarnation: str = Field(default="", max_length=64)
    window: int = Field(default=-1, ge=-1)
    open_window: int = Field(default=0, ge=0)
    abandoned: tuple[int, ...] = Field(default=(), max_length=256)
    queue_len: int = Field(default=0, ge=0)


M = TypeVar("M", bound=_Meta)


def pack_meta(meta: _Meta) -> bytes:
    return msgpack.packb(meta.model_dump(mode="json"), use_bin_type=True)


def unpack_meta(raw: bytes, schema: type[M]) -> M:
    """Parse metadata bytes with ``schema``.

    Raises:
        BadMessage: too large, not msgpack, or not matching ``schema``.
    """
    if len(raw) > MAX_META_BYTES:
        raise BadMessage(f"metadata of {len(raw)} bytes exceeds {MAX_META_BYTES}")
    try:
        value = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        return schema.model_validate(value)
    except (ValueError, TypeError, ValidationError, msgpack.UnpackException) as exc:
        raise BadMessage(f"malformed {schema.__name__}: {exc}") from None


def encode(tensor: torch.Tensor, compression: Compression = "none") -> runtime_pb2.Tensor:
    """Serialize a CPU tensor. Integer tensors (token ids) are never compressed.

    Raises:
        TypeError: a dtype other than float32/int64.
    """
    if tensor.dtype not in _DTYPE_NAMES:
        raise TypeError(f"only float32 and int64 tensors travel between stages, got {tensor.dtype}")
    code = _CODES["none"] if tensor.dtype == torch.int64 else _CODES[compression]
    return serialize_torch_tensor(tensor.detach().cpu().contiguous(), code)


def _expected_num_bytes(code: int, numel: int, item_num_bytes: int) -> int:
    if code == _CODES["none"]:
        return numel * item_num_bytes
    if code == _CODES["fp16"]:
        return numel * 2
    return 8 + _UINT8_CODEBOOK * 4 + numel


def decode(
    proto: runtime_pb2.Tensor,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Deserialize and validate one tensor.

    Args:
        proto: the received tensor.
        dtype: torch.float32 (activations, gradients) or torch.int64 (token ids).
        shape: the exact shape expected (the caller derives it from the request it made or validated).
        vocab_size: for int64 token ids, ids must lie in [0, vocab_size).

    Returns:
        A fresh, writable CPU tensor of ``dtype`` and ``shape``.

    Raises:
        BadTensor: anything about the tensor differs from what was expected, or it holds NaN/Inf.
    """
    want = _DTYPE_NAMES.get(dtype)
    if want is None:
        raise TypeError(f"unsupported dtype {dtype}")
    if proto.dtype != want:
        raise BadTensor(f"dtype {proto.dtype!r}, expected {want!r}")
    allowed = (_CODES["none"],) if dtype == torch.int64 else tuple(_CODES.values())
    if proto.compression not in allowed:
        raise BadTensor(f"compression {runtime_pb2.CompressionType.Name(proto.compression)} is not allowed here")
    if tuple(proto.size) != tuple(shape):
        raise BadTensor(f"shape {tuple(proto.size)}, expected {tuple(shape)}")
    numel = math.prod(shape)
    item_num_bytes = torch.empty((), dtype=dtype).element_size()
    expected = _expected_num_bytes(proto.compression, numel, item_num_bytes)
    if len(proto.buffer) != expected:
        raise BadTensor(f"buffer of {len(proto.buffer)} bytes, expected {expected} for shape {tuple(shape)}")
    if proto.compression == _CODES["uint8"]:
        if int.from_bytes(proto.buffer[:8], "little", signed=True) != _UINT8_CODEBOOK:
            raise BadTensor("8-bit tensor with a malformed codebook")
    try:
        if proto.compression == _CODES["uint8"]:
            tensor = _extract_uint8(proto.buffer, shape)
        else:
            tensor = deserialize_torch_tensor(proto).detach().to(dtype).clone()
    except Exception as exc:  # noqa: BLE001 - hivemind raises several types on corrupt buffers
        raise BadTensor(f"undecodable tensor: {exc!r}") from None
    tensor.requires_grad_(False)
    if dtype == torch.int64:
        if vocab_size is not None and numel and (tensor.min() < 0 or tensor.max() >= vocab_size):
            raise BadTensor(f"token ids outside [0, {vocab_size})")
    elif not torch.isfinite(tensor).all():
        raise BadTensor("tensor contains NaN or Inf")
    return tensor


def _extract_uint8(buffer: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    """hivemind's UNIFORM_8BIT layout: int64 codebook size (256), 256 float32 bucket means, uint8 indices.

    (Decoded here: hivemind 1.1.12's own extract breaks under NumPy 2.)
    """
    codebook = np.frombuffer(buffer, offset=8, count=_UINT8_CODEBOOK, dtype=np.float32)
    indices = np.frombuffer(buffer, offset=8 + _UINT8_CODEBOOK * 4, dtype=np.uint8)
    return torch.from_numpy(codebook[indices].reshape(shape).copy())


def message_num_bytes(tensors: Iterable[runtime_pb2.Tensor]) -> int:
    return sum(len(t.buffer) for t in tensors)


def use_unary(request_num_bytes: int, response_num_bytes: int) -> bool:
    """Whether both directions of a call fit hivemind's unary (persistent-connection) messages."""
    return max(request_num_bytes, response_num_bytes) <= UNARY_LIMIT_NUM_BYTES


def to_parts(
    metadata: bytes,
    tensors: list[runtime_pb2.Tensor],
    message_type: type = runtime_pb2.ExpertRequest,
    part_num_bytes: int = PART_NUM_BYTES,
) -> Iterator[runtime_pb2.ExpertRequest | runtime_pb2.ExpertResponse]:
    """Split a message into stream parts of ``message_type``; the first carries ``metadata``."""
    first = True
    for tensor in tensors:
        for part in split_for_streaming(tensor, part_num_bytes):
            yield message_type(metadata=metadata if first else b"", tensors=[part])
            first = False
    if first:
        yield message_type(metadata=metadata)


class PartsAssembler:
    """Joins stream parts back into (metadata, tensors), refusing more than ``max_num_bytes`` in all."""

    def __init__(self, max_num_bytes: int):
        self.max_num_bytes = max_num_bytes
        self.metadata = b""
        self._headers: list[runtime_pb2.Tensor] = []
        self._chunks: list[list[bytes]] = []
        self._num_bytes = 0
        self._seen_first = False

    def add(self, message: runtime_pb2.ExpertRequest | runtime_pb2.ExpertResponse) -> None:
        """Raises BadMessage past the size limit or on a stray continuation part."""
        if not self._seen_first:
            self.metadata = message.metadata
            self._seen_first = True
        for part in message.tensors:
            self._num_bytes += len(part.buffer)
            if self._num_bytes > self.max_num_bytes:
                raise BadMessage(f"message exceeds {self.max_num_bytes} bytes")
            if part.dtype:  # first part of a new tensor
                self._headers.append(part)
                self._chunks.append([part.buffer])
            elif not self._headers:
                raise BadMessage("continuation part before any tensor header")
            else:
                self._chunks[-1].append(part.buffer)

    def tensors(self) -> list[runtime_pb2.Tensor]:
        joined = []
        for header, chunks in zip(self._headers, self._chunks, strict=False):
            tensor = runtime_pb2.Tensor()
            tensor.CopyFrom(header)
            tensor.buffer = b"".join(chunks)
            tensor.chunks = 0
            joined.append(tensor)
        return joined
