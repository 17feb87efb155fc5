"""The links of one butterfly all-reduce round: dialing and accepting authenticated TCP links, one sender and one
receiver thread per link, waiting on members with stall detection, and the receive path that validates every part
and result as it arrives. ``RoundLinks`` is the base class of ``allreduce.ButterflyRound`` (see its docstring for
the protocol); it owns no round logic.

A member that closes, resets or sends nothing for ``part_timeout_s`` is reported through ``_post_error`` and makes
the round's ``_wait`` raise RoundFailed("peer_failed"). A member that sends a bad part or result is marked bad in the
inbox and never read again (``StopReading``); nothing received is unpickled (frames are msgpack + raw bytes).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import blake3
import torch

from hivetrain.averaging import codecs
from hivetrain.averaging.base import RoundFailed
from hivetrain.averaging.dataplane import FrameType, Link, LinkClosed, RoundKeys, Unreachable, dial, mac
from hivetrain.averaging.reduce import Plan, tensor_view, wire_num_bytes
from hivetrain.averaging.validation import BadContribution, validate_part, validate_weight

logger = logging.getLogger(__name__)


class StopReading(Exception):
    """The peer sent something after which its stream cannot be followed; it is already marked bad."""


class RoundLinks:
    """Links, threads and the receive path of a round. The state it uses is created by ``ButterflyRound.__init__``:
    ``members``, ``me``, ``config``, ``faults``, ``epoch``, ``round_id``, ``codec``/``codec_config``,
    ``max_weight``, ``_cond`` (guards everything below), ``_links``, ``_send_queues``, ``_plans``, ``_outs``,
    ``_inbox``, ``_done``, ``_waiting``, ``_receiving``, ``_threads``, ``_mid_fired``/``_hook_lock``,
    ``_vote_sent_at``, ``fallback`` (a ``relay.P2PFallback`` or None); and
    ``_take(num_elements)`` (a pooled receive buffer).

    Dialing: the member with the smaller id dials, over direct TCP first. If that fails (``Unreachable``: the member
    is behind NAT or a firewall) and a libp2p fallback is set, we ask the member over libp2p to dial *us* (connection
    reversal: a volunteer behind NAT can usually open outgoing connections, so the link is still direct TCP); if it
    cannot either (both behind NAT), the link goes over a libp2p stream (``relay``). Members that were unreachable
    recently skip the direct attempt.
    """

    # ---- links --------------------------------------------------------------------------------------------------
    def _attach(self, link: Link) -> None:
        with self._cond:
            if self._done or link.peer_id in self._links:
                link.close()
                return
            self._links[link.peer_id] = link
            q: queue.Queue = queue.Queue()
            self._send_queues[link.peer_id] = q
            self._cond.notify_all()
        for target, name in ((self._receiver, "recv"), (self._sender, "send")):
            t = threading.Thread(target=target, args=(link,), name=f"hivetrain-avg-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _connect(self, keys: RoundKeys, others: list[str], deadline: float) -> None:
        cfg = self.config

        def dial_one(peer_id: str) -> None:
            try:
                link = self._dial(peer_id, keys, deadline)
            except ConnectionError as exc:
                self._post_error(peer_id, str(exc))
                return
            if link is not None:  # None: it dialed us back, and the server attached that link
                self._attach(link)

        for p in others:
            if p > self.me:  # the smaller id dials: one connection per pair
                threading.Thread(target=dial_one, args=(p,), name="hivetrain-avg-dial", daemon=True).start()
        attempts = 6 if self.fallback is not None else 3  # direct dial, dial-back and libp2p may each time out
        connect_deadline = min(deadline, time.monotonic() + attempts * cfg.connect_timeout_s + cfg.declare_grace_s)
        self._wait(lambda: all(p in self._links for p in others), others, connect_deadline, "connecting", "peer_failed")

    def _dial_options(self) -> dict:
        cfg = self.config
        return dict(connect_timeout_s=cfg.connect_timeout_s, part_timeout_s=cfg.part_timeout_s,
                    buffer_num_bytes=cfg.socket_buffer_bytes,
                    join_wait_s=cfg.connect_timeout_s + cfg.declare_grace_s)  # fmt: skip

    def _dial(self, peer_id: str, keys: RoundKeys, deadline: float) -> Link | None:
        """An authenticated link to ``peer_id``: direct TCP; else (or at once if it was unreachable recently) it
        dials us back, and the link arrives through our server (returns None once attached); else a libp2p stream.
        Raises ConnectionError (LinkClosed, AuthFailed) if none works."""
        cfg, m, fallback = self.config, self.members[peer_id], self.fallback
        if fallback is None or not fallback.prefers_libp2p(peer_id):
            try:
                return dial(m.host, m.port, keys, peer_id, **self._dial_options())
            except Unreachable as exc:  # behind NAT or a firewall? it may dial us, or libp2p may reach it
                if fallback is None:
                    raise
                logger.info("%s; asking it over libp2p to dial us back", exc)
                fallback.note_unreachable(peer_id)
        wait_s = cfg.connect_timeout_s + cfg.declare_grace_s  # it may learn of the round a little after us
        # it waits up to its join wait (about wait_s) for the round, then dials within connect_timeout_s
        if fallback.request_dial_back(peer_id, self.round_id, timeout_s=wait_s + cfg.connect_timeout_s + 1.0):
            with self._cond:
                self._cond.wait_for(
                    lambda: peer_id in self._links or self._done, min(wait_s, deadline - time.monotonic())
                )
                if peer_id in self._links:
                    logger.debug("%s dialed us back", peer_id)
                    return None
        logger.info("%s could not dial us back either; trying a libp2p stream", peer_id)
        sock = fallback.open_socket(peer_id, cfg.connect_timeout_s)
        return dial(m.host, m.port, keys, peer_id, sock=sock, **self._dial_options())

    def _dial_back(self, peer_id: str) -> bool:
        """Dial ``peer_id`` directly because it asked (it could not dial us); attach the link. Never over libp2p: the
        member asking falls back to a libp2p stream itself if this fails."""
        m = self.members.get(peer_id)
        if m is None or peer_id == self.me:
            return False
        try:
            link = dial(m.host, m.port, self._keys, peer_id, **self._dial_options())
        except ConnectionError as exc:
            logger.info("could not dial %s back: %s", peer_id, exc)
            return False
        self._attach(link)
        return True

    def _post_error(self, peer_id: str, reason: str) -> None:
        with self._cond:
            self._inbox.errors.setdefault(peer_id, reason)
            self._cond.notify_all()

    def _finish(self, graceful: bool) -> None:
        """End the round: after a commit, FIN every link (the receivers drain and close them); after a failure,
        close every link at once so that members blocked on us fail now."""
        with self._cond:
            self._done = True
            links = list(self._links.values())
            self._cond.notify_all()
        for q in self._send_queues.values():
            q.put(None)
        for link in links:
            if graceful:
                link.finish()
            else:
                link.close()

    # ---- waiting ------------------------------------------------------------------------------------------------
    def _wait(self, ready, watched, deadline: float, what: str, reason: str = "timeout") -> None:
        """Block until ``ready()`` (under the lock); raise RoundFailed if a watched member (``watched``: peer ids, or a
        function returning them) fails, or at ``deadline``."""
        with self._cond:
            self._waiting = True
            try:
                while not ready():
                    ids = watched() if callable(watched) else watched
                    failed = [(p, self._inbox.errors[p]) for p in ids if p in self._inbox.errors]
                    if failed:
                        if self._claimed_bad_by_someone():  # the likely cause: members finished without us
                            raise RoundFailed("excluded", f"a reducer found our data bad; then {failed[0][1]}")
                        raise RoundFailed("peer_failed", f"{what}: {failed[0][0]}: {failed[0][1]}")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        missing = ", ".join(p for p in ids if p not in self._links)
                        raise RoundFailed(reason, f"{what}: deadline reached" + (f" ({missing})" if missing else ""))
                    self._cond.wait(min(left, 0.5))
            finally:
                self._waiting = False

    def _claimed_bad_by_someone(self) -> bool:
        for ok, _, _, meta, _ in self._inbox.results.values():
            claimed = meta.get("excluded") if ok and isinstance(meta, dict) else None
            if isinstance(claimed, list) and self.me in claimed:
                return True
        return False

    # ---- threads ------------------------------------------------------------------------------------------------
    def _sender(self, link: Link) -> None:
        q = self._send_queues[link.peer_id]
        heartbeat_s = self.config.part_timeout_s / 4
        try:
            while True:
                try:
                    item = q.get(timeout=heartbeat_s)
                except queue.Empty:
                    if self._waiting and not self._done:  # alive and waiting on someone: say so
                        link.send_frame(FrameType.HEARTBEAT, 0, {})
                    continue
                if item is None:
                    return
                ftype, sub, meta, payload = item
                progress = self._mid_transfer_hook(sub) if ftype == FrameType.PART else None
                link.send_frame(ftype, sub, meta, payload, on_progress=progress)
                if ftype == FrameType.VOTE:
                    self._vote_sent_at[link.peer_id] = time.monotonic()
        except LinkClosed as exc:
            if not self._done:
                self._post_error(link.peer_id, str(exc))

    def _mid_transfer_hook(self, sub: int):
        def on_progress(sent: int, total: int) -> None:
            with self._hook_lock:
                if 2 * sent < total or sub in self._mid_fired:
                    return
                self._mid_fired.add(sub)
                self.faults.check("averaging.mid_transfer", epoch=self.epoch, peer=self.me, round_id=self.round_id,
                                  subround=sub)  # fmt: skip

        return on_progress

    def _receiver(self, link: Link) -> None:
        j = link.peer_id
        try:
            while True:
                ftype, sub, meta, num_bytes = link.recv_header()
                if ftype == FrameType.HEARTBEAT:
                    continue
                if ftype == FrameType.PART:
                    self._recv_part(link, sub, meta, num_bytes)
                elif ftype == FrameType.RESULT:
                    self._recv_result(link, sub, meta, num_bytes)
                elif ftype == FrameType.VOTE:
                    h, m = meta.get("hash"), meta.get("mac")
                    ok = isinstance(h, bytes) and isinstance(m, bytes)
                    ok = ok and m == mac(link.key, b"vote", self.round_id.encode(), sub.to_bytes(2, "little"), h)
                    with self._cond:
                        self._inbox.votes[j] = (sub, h if ok else b"bad-mac")
                        self._cond.notify_all()
                    break
                else:
                    raise LinkClosed(f"{j} sent an unexpected {ftype.name} frame")
        except StopReading:
            pass
        except LinkClosed as exc:
            if not self._done:
                self._post_error(j, str(exc))
            link.close()
            return
        link.drain(self.config.part_timeout_s)  # nothing more is expected: drop the rest until the peer closes

    def _plan(self, sub: int) -> Plan:
        with self._cond:
            if not self._cond.wait_for(lambda: sub in self._plans or self._done, self.config.part_timeout_s):
                raise LinkClosed(f"subround {sub} never started here")
            if self._done:
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
            buf = self._take(end - start)
            self._recv_tracked(link, buf)
            part: torch.Tensor | codecs.EncodedPart = buf
        else:
            raw = link.recv_exact(num_bytes)
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
        with self._cond:
            self._inbox.parts[(sub, j)] = (tensor, weight, bad)
            self._cond.notify_all()

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
            raw = link.recv_exact(num_bytes)
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

    def _deliver_result(
        self, sub: int, j: str, ok: bool, why: str, digest: bytes, meta: dict, values: torch.Tensor | None = None
    ) -> None:
        with self._cond:
            self._inbox.results[(sub, j)] = (ok, why, digest, meta, values)
            self._cond.notify_all()

    def _recv_tracked(self, link: Link, buf: torch.Tensor, on_chunk=None) -> None:
        """Receive into a pooled buffer, counted so that buffers are not recycled while a receiver writes."""
        with self._cond:
            self._receiving += 1
        try:
            link.recv_into(tensor_view(buf), on_chunk=on_chunk)
        finally:
            with self._cond:
                self._receiving -= 1
