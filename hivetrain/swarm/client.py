"""Calling one stage server: one forward or backward RPC with a timeout, its reply parsed and its tensors validated.

Small messages use hivemind's unary calls (multiplexed over the persistent daemon connection); messages whose
request or reply may exceed the unary limit go over a stream in parts. A call that times out, fails in the network,
or returns a malformed reply raises ``CallFailed``; a reply whose tensor fails validation raises ``wire.BadTensor``.
Both mean "ban this server and reroute". If the server dies mid-call the daemon reports a reset stream (``kind`` =
"unreachable": the trainer declares it dead at once, ``hivetrain.swarm.failures``) or the call times out after
``timeout_s`` seconds (``kind`` = "timeout"); either way the caller gets ``CallFailed``.
"""

from __future__ import annotations

import asyncio
import time

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from transformers import LlamaConfig

from hivetrain.swarm import wire
from hivetrain.swarm.config import SwarmConfig
from hivetrain.swarm.failures import FailureKind, classify_error
from hivetrain.swarm.handler import handler_name


class CallFailed(RuntimeError):
    """A call to a stage server timed out, failed in the network, or got a malformed reply.

    Attributes:
        kind: "timeout", "unreachable" (reset stream, refused or failed dial: the server's daemon is gone) or "error".
    """

    def __init__(self, message: str, kind: FailureKind = "error"):
        super().__init__(message)
        self.kind: FailureKind = kind


class StageClient:
    """Issues calls to stage servers through this peer's P2P (must be used on the loop that owns ``p2p``)."""

    def __init__(self, p2p: P2P, run_id: str, swarm: SwarmConfig, model_config: LlamaConfig):
        self.p2p, self.run_id, self.swarm, self.model_config = p2p, run_id, swarm, model_config
        self.bytes_sent = 0
        self.bytes_received = 0

    def output_width(self, stage: int) -> int:
        return self.model_config.vocab_size if stage == self.swarm.num_stages - 1 else self.model_config.hidden_size

    async def _call(
        self,
        peer_id: str,
        kind: str,
        metadata: bytes,
        tensors: list[runtime_pb2.Tensor],
        response_num_bytes: int,
        timeout_s: float,
    ) -> tuple[wire.ReplyMeta, list[runtime_pb2.Tensor]]:
        request_num_bytes = wire.message_num_bytes(tensors)
        self.bytes_sent += request_num_bytes
        peer = PeerID.from_base58(peer_id)
        try:
            if wire.use_unary(request_num_bytes, response_num_bytes):
                request = runtime_pb2.ExpertRequest(metadata=metadata, tensors=tensors)
                response = await asyncio.wait_for(
                    self.p2p.call_protobuf_handler(
                        peer, handler_name(self.run_id, kind), request, runtime_pb2.ExpertResponse
                    ),
                    timeout_s,
                )
                reply_metadata, reply_tensors = response.metadata, list(response.tensors)
            else:
                reply_metadata, reply_tensors = await asyncio.wait_for(
                    self._call_stream(peer, kind, metadata, tensors, response_num_bytes), timeout_s
                )
        except asyncio.TimeoutError:
            raise CallFailed(f"{kind} to {peer_id[:12]} timed out after {timeout_s:.1f}s", "timeout") from None
        except Exception as exc:  # noqa: BLE001 - P2P raises many types for dead or misbehaving peers
            raise CallFailed(f"{kind} to {peer_id[:12]} failed: {exc!r}", classify_error(repr(exc))) from None
        self.bytes_received += wire.message_num_bytes(reply_tensors)
        try:
            meta = wire.unpack_meta(reply_metadata, wire.ReplyMeta)
        except wire.BadMessage as exc:
            raise CallFailed(f"{kind} to {peer_id[:12]}: {exc}") from None
        return meta, reply_tensors

    async def _call_stream(self, peer: PeerID, kind: str, metadata: bytes, tensors, response_num_bytes: int):
        async def parts():
            for part in wire.to_parts(metadata, tensors):
                yield part

        stream = await self.p2p.iterate_protobuf_handler(
            peer, handler_name(self.run_id, f"{kind}_stream"), parts(), runtime_pb2.ExpertResponse
        )
        assembler = wire.PartsAssembler(max(response_num_bytes, 1) + 2**20)
        async for message in stream:
            assembler.add(message)
        return assembler.metadata, assembler.tensors()

    async def forward(
        self,
        peer_id: str,
        stage: int,
        microbatch_id: str,
        x: runtime_pb2.Tensor,
        timeout_s: float,
        urgent: bool = False,
    ) -> tuple[wire.ReplyMeta, runtime_pb2.Tensor | None, torch.Tensor | None]:
        """Run ``stage`` at ``peer_id`` on input ``x`` ((B, T) ids or (B, T, D) hidden, serialized); ``urgent`` for a
        microbatch rerouted around a failure (``wire.ForwardMeta.urgent``).

        Returns:
            (reply, output proto, output tensor): the (B, T, D) hidden states or (B, T, V) logits as received and
            decoded; both None unless the reply's status is "ok".

        Raises:
            CallFailed: timeout, network failure, malformed reply, or an "ok" reply without its tensor.
            wire.BadTensor: the output has the wrong shape/dtype or holds NaN/Inf.
        """
        num_windows, num_tokens = x.size[0], x.size[1]
        width = self.output_width(stage)
        meta = wire.ForwardMeta(
            microbatch_id=microbatch_id, stage=stage, deadline=time.time() + timeout_s, urgent=urgent
        )
        reply, tensors = await self._call(
            peer_id, "forward", wire.pack_meta(meta), [x], num_windows * num_tokens * width * 4, timeout_s
        )
        if reply.status != "ok":
            return reply, None, None
        if len(tensors) != 1:
            raise CallFailed(f"forward reply from {peer_id[:12]} has {len(tensors)} tensors")
        out = wire.decode(tensors[0], torch.float32, (num_windows, num_tokens, width))
        return reply, tensors[0], out

    async def backward(
        self,
        peer_id: str,
        stage: int,
        microbatch_id: str,
        x: runtime_pb2.Tensor,
        grad_output: runtime_pb2.Tensor,
        timeout_s: float,
        accumulate: bool = True,
        replay: bool = False,
        urgent: bool = False,
    ) -> tuple[wire.ReplyMeta, runtime_pb2.Tensor | None]:
        """Backpropagate ``grad_output`` through ``stage`` at ``peer_id``, recomputing it from the kept input ``x``.

        Returns:
            (reply, input gradient proto): the (B, T, D) gradient w.r.t. ``x``, validated; None on the first stage,
            for replays, or unless the reply's status is "ok".

        Raises:
            CallFailed, wire.BadTensor: as ``forward``.
        """
        num_windows, num_tokens = x.size[0], x.size[1]
        meta = wire.BackwardMeta(
            microbatch_id=microbatch_id,
            stage=stage,
            deadline=time.time() + timeout_s,
            accumulate=accumulate,
            replay=replay,
            urgent=urgent,
        )
        wants_grad = stage > 0 and not replay
        response_num_bytes = num_windows * num_tokens * self.model_config.hidden_size * 4 if wants_grad else 0
        reply, tensors = await self._call(
            peer_id, "backward", wire.pack_meta(meta), [x, grad_output], response_num_bytes, timeout_s
        )
        if reply.status != "ok":
            return reply, None
        if len(tensors) != (1 if wants_grad else 0):
            raise CallFailed(f"backward reply from {peer_id[:12]} has {len(tensors)} tensors")
        if not wants_grad:
            return reply, None
        wire.decode(tensors[0], torch.float32, (num_windows, num_tokens, self.model_config.hidden_size))
        return reply, tensors[0]
