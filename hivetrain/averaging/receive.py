"""The receive path of a butterfly round: what each PART, HAVE, RESULT and VOTE frame means, checked as it arrives.

``RoundReceiver.on_frame`` is the transport's frame handler (``transport.RoundTransport``, on its receiver threads).
Every part and result is validated before it is used (exact size for its slice and codec, finite values, weight in
bounds; ``validation``); a member that sends a bad one is marked bad in the inbox and never read again
(``StopReading``); a member that breaks the protocol (a plan tag that differs, a part of a slice we do not reduce, a
result from a member that does not reduce that slice, a frame sent twice) fails its link (``LinkClosed``). Nothing
received is unpickled (frames are msgpack + raw bytes), and a payload buffer is allocated only once its claimed size
equals the size the round expects.

The receiver owns the round's plan, its result buffers (one per contributor set) and the pooled receive buffers,
under its own lock; what it accepts goes to the transport's inbox (``RoundTransport.deliver``).
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
    """The round's plan, result buffers and receive path.

    Args:
        me: our peer id; round_id: the round's id.
        codec_config: the round's codec of parts (``codecs.CodecConfig``); codec: its instance, None for "none".
        result_config: the codec of reducers' results (``reduce.result_codec``: a denser "topk", else the same).
        max_weight: the largest weight a member may claim, samples.
        pool: receive buffers kept between rounds.
        plan_wait_s: how long a frame that needs the round's contributors (a reassigned part, a result) waits for
            them to be known, seconds (x4: a member's HAVE may reach us a little after the others').
    """

    def __init__(
        self, *, me: str, round_id: str, codec_config: codecs.CodecConfig, codec, max_weight: float,
        pool: BufferPool, plan_wait_s: float, result_config: codecs.CodecConfig | None = None,
    ):  # fmt: skip
        self.me, self.round_id, self.codec_config, self.codec = me, round_id, codec_config, codec
        self.result_config = result_config or codec_config
        self.max_weight, self.pool, self.plan_wait_s = max_weight, pool, plan_wait_s
        self.transport: RoundTransport | None = None  # set by the round before any link opens
        self._cond = threading.Condition()
        self._plan: Plan | None = None
        self._contributors: frozenset[str] | None = None  # C0: agreed from the HAVE frames
        self._removed: frozenset[str] = frozenset()  # the round's current removed set
        self._outs: dict[frozenset[str], torch.Tensor] = {}  # removed set -> its result buffer
        self._num_elements = 0
        self._taken: list[torch.Tensor] = []
        self._receiving = 0
        self._closed = False

    # ---- the round's side ---------------------------------------------------------------------------------------
    def start(self, plan: Plan, out: torch.Tensor) -> None:
        """Frames are read against ``plan``; results of the first contributor set land in ``out`` (fp32 (n,))."""
        with self._cond:
            self._plan, self._num_elements = plan, out.numel()
            self._outs[frozenset()] = out
            self._cond.notify_all()

    def set_contributors(self, contributors: frozenset[str]) -> None:
        """C0, the contributors agreed from the HAVE frames: reassigned parts and results are checked against it."""
        with self._cond:
            self._contributors = contributors
            self._cond.notify_all()

    def set_removed(self, removed: frozenset[str]) -> None:
        """The members the round now goes on without: a result for a smaller set is stale (dropped unread) once its
        slice has another reducer; one whose reducer still owns the slice is kept (slices are kept across attempts)."""
        with self._cond:
            self._removed = removed

    def out(self, removed: frozenset[str]) -> torch.Tensor:
        """The result buffer of the contributor set C0 minus ``removed`` (fp32 (n,), made on first use)."""
        with self._cond:
            if removed not in self._outs:
                if len(self._outs) > len(self._plan.order) + 1:  # type: ignore[union-attr]
                    raise LinkClosed("too many contributor sets in one round")
                self._outs[removed] = torch.empty(self._num_elements)
            return self._outs[removed]

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
        if self._plan is None or link.peer_id not in self._plan.order:
            raise LinkClosed(f"{link.peer_id} is not a member of this round")
        if ftype == FrameType.PART:
            self._recv_part(link, meta, num_bytes)
        elif ftype == FrameType.HAVE and not num_bytes:
            self._transport.deliver(lambda inbox: inbox.haves.setdefault(link.peer_id, meta))
        elif ftype == FrameType.RESULT:
            self._recv_result(link, meta, num_bytes)
        elif ftype == FrameType.GONE and not num_bytes:
            self._frame_slice(link, {**meta, "slice": 0})  # records its claim
        elif ftype == FrameType.VOTE and not num_bytes:
            h, m = meta.get("hash"), meta.get("mac")
            ok = isinstance(h, bytes) and isinstance(m, bytes)
            ok = ok and m == mac(link.key, b"vote", self.round_id.encode(), sub.to_bytes(2, "little"), h)
            vote = (sub, h if ok else b"bad-mac")
            # a voter may still go on with another attempt (``ButterflyRound``): keep reading
            self._transport.deliver(lambda inbox: inbox.votes.__setitem__(link.peer_id, vote))
        else:
            raise LinkClosed(f"{link.peer_id} sent an unexpected {ftype.name} frame")

    @property
    def _transport(self) -> RoundTransport:
        assert self.transport is not None, "RoundReceiver.transport is not set"
        return self.transport

    def _contributors_now(self) -> frozenset[str]:
        with self._cond:
            if not self._cond.wait_for(lambda: self._contributors is not None or self._closed, 4 * self.plan_wait_s):
                raise LinkClosed("the round's contributors were never agreed here")
            if self._closed:
                raise LinkClosed("round over")
            return self._contributors  # type: ignore[return-value]

    def _frame_slice(self, link: Link, meta: dict) -> tuple[int, frozenset[str]]:
        """The slice index and the removed set a PART or RESULT frame names; LinkClosed if malformed."""
        plan = self._plan
        i, gone = meta.get("slice"), meta.get("gone", [])
        if not isinstance(i, int) or not 0 <= i < len(plan.order) or not isinstance(gone, list):  # type: ignore[union-attr]
            raise LinkClosed(f"{link.peer_id} sent a frame with a bad slice or removed set")
        removed = frozenset(gone)
        if not removed <= set(plan.order) or link.peer_id in removed:  # type: ignore[union-attr]
            raise LinkClosed(f"{link.peer_id} sent a frame naming members not in the round, or itself, as removed")
        if removed:

            def claim(inbox) -> None:
                inbox.claims[link.peer_id] = inbox.claims.get(link.peer_id, frozenset()) | removed

            self._transport.deliver(claim)
        return i, removed

    def _recv_part(self, link: Link, meta: dict, num_bytes: int) -> None:
        j, plan = link.peer_id, self._plan
        assert plan is not None
        if meta.get("tag") != plan.tag:
            raise LinkClosed(f"{j} disagrees on the members of the round")
        i, removed = self._frame_slice(link, meta)
        if i == plan.index(j):
            raise LinkClosed(f"{j} sent us a part of its own slice")
        if i != plan.index(self.me) and plan.owner(i, self._contributors_now() - removed) != self.me:
            raise LinkClosed(f"{j} sent us a part of slice {i}, which we do not reduce")
        if self._transport.read(lambda inbox: (i, j) in inbox.parts):
            raise LinkClosed(f"{j} sent its part of slice {i} twice")
        start, end = plan.bounds[i]
        try:
            weight = validate_weight(meta.get("w"), self.max_weight)
            if meta.get("codec") != self.codec_config.name:
                raise BadContribution("codec", f"{meta.get('codec')!r} instead of {self.codec_config.name!r}")
            if num_bytes != wire_num_bytes(self.codec_config, end - start):
                raise BadContribution("size", f"{num_bytes} bytes for {end - start} elements")
        except BadContribution as exc:
            self._deliver_part(i, j, None, 0.0, str(exc))
            raise StopReading from None  # its payload cannot be trusted to have the size it claims
        if self.codec is None:
            buf = self.take(end - start)
            self._recv_tracked(link, buf)
            part: torch.Tensor | codecs.EncodedPart = buf
        else:
            raw = bytearray(num_bytes)  # the size the round expects (checked above), not a claim
            link.recv_into(memoryview(raw))
            try:
                part = codecs.from_bytes(raw, end - start, expected=self.codec_config)
            except codecs.MalformedPart as exc:
                self._deliver_part(i, j, None, 0.0, f"malformed: {exc}")
                raise StopReading from None
        try:
            tensor = validate_part(part, end - start)
        except BadContribution as exc:
            self._deliver_part(i, j, None, 0.0, str(exc))
            raise StopReading from None  # it is out of the round: nothing more it sends matters
        self._deliver_part(i, j, tensor, weight, "")

    def _deliver_part(self, i: int, j: str, tensor: torch.Tensor | None, weight: float, bad: str) -> None:
        self._transport.deliver(lambda inbox: inbox.parts.__setitem__((i, j), (tensor, weight, bad)))

    def _recv_result(self, link: Link, meta: dict, num_bytes: int) -> None:
        j, plan = link.peer_id, self._plan
        assert plan is not None
        i, removed = self._frame_slice(link, meta)
        left = self._contributors_now() - removed
        if j not in left or plan.owner(i, left) != j:
            raise LinkClosed(f"{j} is not the reducer of slice {i} once {sorted(removed)} are removed")
        start, end = plan.bounds[i]
        if num_bytes != wire_num_bytes(self.result_config, end - start):
            why = f"result of {num_bytes} bytes for {end - start} elements"
            self._deliver_result(removed, i, j, False, why, b"", meta)
            raise StopReading
        with self._cond:  # a result of a set we have left is still the slice's while its reducer still owns it
            current = self._removed
        stale = removed < current and (j in current or plan.owner(i, self._contributors_now() - current) != j)
        # a reducer sends each slice it owns once, whatever attempts follow (slices are kept across attempts)
        sent_before = lambda inbox: any(s == i and got[4] == j for (_, s), got in inbox.results.items())  # noqa: E731
        if stale or self._transport.read(sent_before):
            if not stale:
                raise LinkClosed(f"{j} sent its result of slice {i} twice")
            link.recv_into(memoryview(bytearray(num_bytes)))  # a contributor set the round has left: drop it
            return
        # Straight into the result buffer of this contributor set (each has its own: a late frame of a set we have
        # left lands in a buffer nobody reads).
        hasher = blake3.blake3()
        dest = self.out(removed)[start:end]
        if self.codec is None:
            values = dest
            link.recv_into(tensor_view(dest), on_chunk=hasher.update)
        else:
            raw = bytearray(num_bytes)  # the size the round expects (checked above)
            link.recv_into(memoryview(raw))
            hasher.update(raw)
            try:
                values = codecs.decode(codecs.from_bytes(raw, end - start, expected=self.result_config))
            except codecs.MalformedPart as exc:
                self._deliver_result(removed, i, j, False, f"malformed result: {exc}", b"", meta)
                raise StopReading from None
        try:
            validate_part(values, end - start)
        except BadContribution as exc:
            self._deliver_result(removed, i, j, False, f"bad result: {exc}", b"", meta)
            raise StopReading from None
        if values is not dest:
            dest.copy_(values)
        self._deliver_result(removed, i, j, True, "", hasher.digest(), meta)

    def _deliver_result(
        self, removed: frozenset[str], i: int, j: str, ok: bool, why: str, digest: bytes, meta: dict
    ) -> None:
        self._transport.deliver(lambda inbox: inbox.results.__setitem__((removed, i), (ok, why, digest, meta, j)))

    def _recv_tracked(self, link: Link, buf: torch.Tensor) -> None:
        """Receive into a pooled buffer, counted so that buffers are not recycled while a receiver writes."""
        with self._cond:
            self._receiving += 1
        try:
            link.recv_into(tensor_view(buf))
        finally:
            with self._cond:
                self._receiving -= 1
