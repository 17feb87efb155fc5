"""A stage server's incoming RPCs (hivemind P2P protobuf handlers): forward and backward, unary and streamed.

Handler names (protocol IDs) are ``"{run_id}.swarm.forward"``, ``".forward_stream"``, ``".backward"`` and
``".backward_stream"``. A request is a ``runtime_pb2.ExpertRequest`` (see ``hivetrain.swarm.wire``); every reply carries
a ``ReplyMeta`` with a status, so the trainer can tell "busy, go elsewhere" from "broken, ban me". The handler
validates everything it receives (metadata schema, stage, tensor count, shapes against the server's limits, dtype,
finiteness, token ids) before queuing work on the runtime. If the trainer disconnects mid-call, the queued work
still runs (its deadline bounds it) and only the reply is lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import torch
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from hivetrain.swarm import wire
from hivetrain.swarm.config import SwarmConfig
from hivetrain.swarm.runtime import BackwardResult, ServerBusy, StageRuntime, TaskExpired

logger = logging.getLogger(__name__)

HANDLER_KINDS = ("forward", "forward_stream", "backward", "backward_stream")


def handler_name(run_id: str, kind: str) -> str:
    return f"{run_id}.swarm.{kind}"


class StageHandler:
    """Serves forward/backward calls for whatever stage ``runtime`` currently holds.

    Args:
        runtime: the compute loop (its ``spec`` says which stage is served right now).
        swarm: limits (microbatch size, compression of replies).
        max_seq_len: the longest window accepted, tokens.
        is_accepting: returns False while the server syncs or moves (calls are answered "busy").
    """

    def __init__(self, runtime: StageRuntime, swarm: SwarmConfig, max_seq_len: int, is_accepting=lambda: True):
        self.runtime = runtime
        self.swarm = swarm
        self.max_seq_len = max_seq_len
        self.is_accepting = is_accepting
        self.num_served = 0
        self.num_rejected = 0

    async def register(self, p2p: P2P, run_id: str) -> None:
        await p2p.add_protobuf_handler(handler_name(run_id, "forward"), self.rpc_forward, runtime_pb2.ExpertRequest)
        await p2p.add_protobuf_handler(handler_name(run_id, "backward"), self.rpc_backward, runtime_pb2.ExpertRequest)
        for kind, fn in (("forward_stream", self.rpc_forward_stream), ("backward_stream", self.rpc_backward_stream)):
            await p2p.add_protobuf_handler(
                handler_name(run_id, kind), fn, runtime_pb2.ExpertRequest, stream_input=True, stream_output=True
            )

    async def unregister(self, p2p: P2P, run_id: str) -> None:
        for kind in HANDLER_KINDS:
            streamed = kind.endswith("_stream")
            try:
                await p2p.remove_protobuf_handler(
                    handler_name(run_id, kind), stream_input=streamed, stream_output=streamed
                )
            except Exception as exc:  # noqa: BLE001 - the daemon may already be gone at shutdown
                logger.debug("removing handler %s failed: %r", kind, exc)

    # ---- protobuf entry points ------------------------------------------------------------------------------------

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, _: P2PContext) -> runtime_pb2.ExpertResponse:
        meta, tensors = await self._forward(request.metadata, list(request.tensors))
        return runtime_pb2.ExpertResponse(metadata=wire.pack_meta(meta), tensors=tensors)

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, _: P2PContext) -> runtime_pb2.ExpertResponse:
        meta, tensors = await self._backward(request.metadata, list(request.tensors))
        return runtime_pb2.ExpertResponse(metadata=wire.pack_meta(meta), tensors=tensors)

    async def rpc_forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], _: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        metadata, tensors = await self._gather(requests)
        meta, out = await self._forward(metadata, tensors)
        for part in wire.to_parts(wire.pack_meta(meta), out, runtime_pb2.ExpertResponse):
            yield part

    async def rpc_backward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], _: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        metadata, tensors = await self._gather(requests)
        meta, out = await self._backward(metadata, tensors)
        for part in wire.to_parts(wire.pack_meta(meta), out, runtime_pb2.ExpertResponse):
            yield part

    # ---- validation and dispatch ----------------------------------------------------------------------------------

    def _max_message_num_bytes(self) -> int:
        config = self.runtime.module.config
        width = max(config.hidden_size, config.vocab_size)
        return 2 * self.swarm.microbatch_size * self.max_seq_len * width * 4 + 2**20

    async def _gather(self, requests: AsyncIterator[runtime_pb2.ExpertRequest]):
        assembler = wire.PartsAssembler(self._max_message_num_bytes())
        try:
            async for message in requests:
                assembler.add(message)
        except wire.BadMessage:
            return b"", []
        return assembler.metadata, assembler.tensors()

    def _reply(self, status: wire.Status, detail: str = "", window: int = -1) -> wire.ReplyMeta:
        rt = self.runtime
        return wire.ReplyMeta(
            status=status,
            detail=detail[:500],
            incarnation=rt.incarnation,
            window=window,
            open_window=rt.phase,
            abandoned=tuple(rt.abandoned),
            queue_len=rt.queue_len(),
        )

    def _input_shape(self, proto: runtime_pb2.Tensor) -> tuple[int, ...]:
        """The input shape this server accepts for ``proto`` (raises BadTensor outside its limits)."""
        spec, config = self.runtime.spec, self.runtime.module.config
        size = tuple(proto.size)
        rank = 2 if spec.is_first else 3
        if len(size) != rank:
            raise wire.BadTensor(f"stage {spec.index} takes rank-{rank} input, got shape {size}")
        if not 1 <= size[0] <= self.swarm.microbatch_size or not 1 <= size[1] <= self.max_seq_len:
            raise wire.BadTensor(
                f"input {size} exceeds {self.swarm.microbatch_size} windows x {self.max_seq_len} tokens"
            )
        if rank == 3 and size[2] != config.hidden_size:
            raise wire.BadTensor(f"hidden size {size[2]} != {config.hidden_size}")
        return size

    def _decode_input(self, proto: runtime_pb2.Tensor) -> torch.Tensor:
        shape = self._input_shape(proto)
        if self.runtime.spec.is_first:
            return wire.decode(proto, torch.int64, shape, vocab_size=self.runtime.module.config.vocab_size)
        return wire.decode(proto, torch.float32, shape)

    def _check(self, meta: wire.ForwardMeta | wire.BackwardMeta, tensors: list, count: int) -> wire.ReplyMeta | None:
        if meta.stage != self.runtime.spec.index:
            return self._reply("wrong_stage", f"this server serves stage {self.runtime.spec.index}")
        if not self.is_accepting():
            self.num_rejected += 1
            return self._reply("busy", "syncing or moving")
        if len(tensors) != count:
            return self._reply("bad_request", f"expected {count} tensor(s), got {len(tensors)}")
        return None

    async def _forward(self, metadata: bytes, tensors: list[runtime_pb2.Tensor]):
        try:
            meta = wire.unpack_meta(metadata, wire.ForwardMeta)
            rejected = self._check(meta, tensors, 1)
            if rejected is not None:
                return rejected, []
            x = self._decode_input(tensors[0])
        except (wire.BadMessage, wire.BadTensor) as exc:
            return self._reply("bad_request", str(exc)), []
        future = self.runtime.submit_forward(x, meta.microbatch_id, meta.deadline, urgent=meta.urgent)
        status, detail, out = await self._await(future)
        if out is None:
            return self._reply(status, detail), []
        self.num_served += 1
        return self._reply("ok"), [wire.encode(out, self.swarm.compression)]

    async def _backward(self, metadata: bytes, tensors: list[runtime_pb2.Tensor]):
        try:
            meta = wire.unpack_meta(metadata, wire.BackwardMeta)
            rejected = self._check(meta, tensors, 2)
            if rejected is not None:
                return rejected, []
            x = self._decode_input(tensors[0])
            width = self.runtime.module.output_width()
            grad_output = wire.decode(tensors[1], torch.float32, (*x.shape[:2], width))
        except (wire.BadMessage, wire.BadTensor) as exc:
            return self._reply("bad_request", str(exc)), []
        future = self.runtime.submit_backward(
            x, grad_output, meta.microbatch_id, meta.deadline, meta.accumulate, meta.replay, urgent=meta.urgent
        )
        status, detail, result = await self._await(future)
        if result is None:
            return self._reply(status, detail), []
        assert isinstance(result, BackwardResult)
        out = [] if result.grad_input is None else [wire.encode(result.grad_input, self.swarm.compression)]
        return self._reply("ok", window=result.window), out

    @staticmethod
    async def _await(future) -> tuple[wire.Status, str, object]:
        try:
            return "ok", "", await asyncio.wrap_future(future)
        except TaskExpired as exc:
            return "expired", str(exc), None
        except ServerBusy as exc:
            return "busy", str(exc), None
        except Exception as exc:  # noqa: BLE001 - a failing task must not kill the handler
            logger.warning("stage task failed: %r", exc)
            return "error", repr(exc), None
