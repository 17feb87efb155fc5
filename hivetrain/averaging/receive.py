"""The receive path of a butterfly round: what each PART, RESULT and VOTE frame means, checked as it arrives.

``RoundReceiver.on_frame`` is the transport's frame handler (``transport.RoundTransport``, on its receiver threads).
Every part and result is validated before it is used (exact size for its slice and codec, finite values, weight in
bounds; ``validation``); a member that sends a bad one is marked bad in the inbox and never read again
(``StopReading``); a member that breaks the protocol (a subround we never start, a plan tag that differs, a reducer
that is not one) fails its link (``LinkClosed``). Nothing received is unpickled (frames are msgpack + raw bytes), and
a payload buffer is allocated only once its claimed size equals the size the round expects.

The receiver owns the round's per-subround plans and result buffers and the pooled receive buffers, under its own
lock; what it accepts goes to the transport's inbox (``RoundTransport.deliver``).
"""

from __future__ import annotations

import threading

import blake3
import torch

from hivetrain.averaging import codecs
from hivetrain.averaging.reduce import BufferPool, Plan, tensor_view, wire_num_bytes
from hivetrain.averaging.transport import RoundTransport, StopReading
from hivetrain.averaging.validation import BadContribution, validate_part, validate_weight
from hivetrain.averaging.wire import FrameType, Link, LinkClosed, mac


class RoundReceiver:
    """Plans, result buffers and the receive path of one round.

    Args:
        me: our peer id; round_id: the round's id.
        codec_config: the round's codec (``codecs.CodecConfig``); codec: its instance, None for "none".
        max_weight: the largest weight a member may claim, samples.
        pool: receive buffers kept between rounds.
        plan_wait_s: how long a frame for a subround we have not started yet waits for it, seconds.
    """

    def __init__(
        self, *, me: str, round_id: str, codec_config: codecs.CodecConfig, codec, max_weight: float,
        pool: BufferPool, plan_wait_s: float,
    ):  # fmt: skip
        self.me, self.round_id, self.codec_config, self.codec = me, round_id, codec_config, codec
        self.max_weight, self.pool, self.plan_wait_s = max_weight, pool, plan_wait_s
        self.transport: RoundTransport | None = None  # set by the round before any link opens
        self._cond = threading.Condition()
        self._plans: dict[int, Plan] = {}
        self._outs: dict[int, torch.Tensor] = {}  # subround -> its result buffer
        self._taken: list[torch.Tensor] = []
        self._receiving = 0
        self._closed = False

    # ---- the round's side ---------------------------------------------------------------------------------------
    def start_subround(self, sub: int, plan: Plan, out: torch.Tensor) -> None:
        """From now on, frames of subround ``sub`` are read against ``plan``; results land in ``out`` (fp32 (n,))."""
        with self._cond:
            self._outs[sub], self._plans[sub] = out, plan
            self._cond.notify_all()

    def out(self, sub: int) -> torch.Tensor:
        return self._outs[sub]

    def take(self, num_elements: int) -> torch.Tensor:
        """A pooled fp32 buffer of ``num_elements``, returned to the pool by ``close``."""
        buf = self.pool.take(num_elements)
        with self._cond:
            self._taken.append(buf)
        return buf

    def close(self) -> None:
        """The round is over: frames still arriving are refused; receive buffers go back to the pool unless a
        receiver may still write into one (then they are dropped)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            taken, self._taken = self._taken, []
            busy = self._receiving
        if not busy:
            for buf in taken:
                self.pool.give(buf)

    # ---- the transport's side (receiver threads) ----------------------------------------------------------------
    def on_frame(self, link: Link, ftype: FrameType, sub: int, meta: dict, num_bytes: int) -> None:
        """Read and check one frame from ``link`` (its header is read). Raises StopReading or LinkClosed."""
        if ftype == FrameType.PART:
            self._recv_part(link, sub, meta, num_bytes)
        elif ftype == FrameType.RESULT:
            self._recv_result(link, sub, meta, num_bytes)
        elif ftype == FrameType.VOTE and not num_bytes:
            h, m = meta.get("hash"), meta.get("mac")
            ok = isinstance(h, bytes) and isinstance(m, bytes)
            ok = ok and m == mac(link.key, b"vote", self.round_id.encode(), sub.to_bytes(2, "little"), h)
            vote = (sub, h if ok else b"bad-mac")
            self._transport.deliver(lambda inbox: inbox.votes.__setitem__(link.peer_id, vote))
            raise StopReading  # a voter sends nothing after its vote
        else:
            raise LinkClosed(f"{link.peer_id} sent an unexpected {ftype.name} frame")

    @property
    def _transport(self) -> RoundTransport:
        assert self.transport is not None, "RoundReceiver.transport is not set"
        return self.transport

    def _plan(self, sub: int) -> Plan:
        with self._cond:
            if not self._cond.wait_for(lambda: sub in self._plans or self._closed, self.plan_wait_s):
                raise LinkClosed(f"subround {sub} never started here")
            if self._closed:
                raise LinkClosed("round over")
            return self._plans[sub]

    def _recv_part(self, link: Link, sub: int, meta: dict, num_bytes: int) -> None:
        j, plan = link.peer_id, self._plan(sub)
        if meta.get("tag") != plan.tag or j not in plan.active:
            raise LinkClosed(f"{j} disagrees on the members of subround {sub}")
        start, end = plan.slice_of(self.me)
        try:
            weight = validate_weight(meta.get("w"), self.max_weight)
            if meta.get("codec") != self.codec_config.name:
                raise BadContribution("codec", f"{meta.get('codec')!r} instead of {self.codec_config.name!r}")
            if num_bytes != wire_num_bytes(self.codec_config, end - start):
                raise BadContribution("size", f"{num_bytes} bytes for {end - start} elements")
        except BadContribution as exc:
            self._deliver_part(sub, j, None, 0.0, str(exc))
            raise StopReading from None  # its payload cannot be trusted to have the size it claims
        if self.codec is None:
            buf = self.take(end - start)
            self._recv_tracked(link, buf)
            part: torch.Tensor | codecs.EncodedPart = buf
        else:
            raw = bytearray(num_bytes)  # the size the round expects (checked above), not a claim
            link.recv_into(memoryview(raw))
            try:
                part = codecs.from_bytes(raw, end - start, frozenset({self.codec_config.name}))
            except codecs.MalformedPart as exc:
                self._deliver_part(sub, j, None, 0.0, f"malformed: {exc}")
                raise StopReading from None
        try:
            tensor = validate_part(part, end - start)
        except BadContribution as exc:
            self._deliver_part(sub, j, None, 0.0, str(exc))
            raise StopReading from None  # it is out of the round: nothing more it sends matters
        self._deliver_part(sub, j, tensor, weight, "")

    def _deliver_part(self, sub: int, j: str, tensor: torch.Tensor | None, weight: float, bad: str) -> None:
        self._transport.deliver(lambda inbox: inbox.parts.__setitem__((sub, j), (tensor, weight, bad)))

    def _recv_result(self, link: Link, sub: int, meta: dict, num_bytes: int) -> None:
        j, plan = link.peer_id, self._plan(sub)
        if j not in plan.active:
            raise LinkClosed(f"{j} is not a reducer of subround {sub}")
        start, end = plan.slice_of(j)
        if num_bytes != wire_num_bytes(self.codec_config, end - start):
            self._deliver_result(sub, j, False, f"result of {num_bytes} bytes for {end - start} elements", b"", meta)
            raise StopReading
        # Straight into this subround's result buffer (each subround has its own: a late frame of a subround we
        # have left lands in a buffer nobody returns).
        hasher = blake3.blake3()
        dest = self._outs[sub][start:end]
        if self.codec is None:
            values = dest
            link.recv_into(tensor_view(dest), on_chunk=hasher.update)
        else:
            raw = bytearray(num_bytes)  # the size the round expects (checked above)
            link.recv_into(memoryview(raw))
            hasher.update(raw)
            try:
                values = codecs.decode(codecs.from_bytes(raw, end - start, frozenset({self.codec_config.name})))
            except codecs.MalformedPart as exc:
                self._deliver_result(sub, j, False, f"malformed result: {exc}", b"", meta)
                raise StopReading from None
        try:
            validate_part(values, end - start)
        except BadContribution as exc:
            self._deliver_result(sub, j, False, f"bad result: {exc}", b"", meta)
            raise StopReading from None
        if values is not dest:
            dest.copy_(values)
        self._deliver_result(sub, j, True, "", hasher.digest(), meta)

    def _deliver_result(self, sub: int, j: str, ok: bool, why: str, digest: bytes, meta: dict) -> None:
        self._transport.deliver(lambda inbox: inbox.results.__setitem__((sub, j), (ok, why, digest, meta, None)))

    def _recv_tracked(self, link: Link, buf: torch.Tensor) -> None:
        """Receive into a pooled buffer, counted so that buffers are not recycled while a receiver writes."""
        with self._cond:
            self._receiving += 1
        try:
            link.recv_into(tensor_view(buf))
        finally:
            with self._cond:
                self._receiving -= 1
