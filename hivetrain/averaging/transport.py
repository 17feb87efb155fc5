"""The transport of one butterfly round: authenticated links to the other members, a sender and a receiver thread
per link, send queues, heartbeats, the inbox of what arrived, and waiting on members with failure detection. It owns
its lock; the round (``allreduce.ButterflyRound``) uses it through ``open``, ``send``, ``wait``, ``deliver`` and
``close`` and never touches a socket. What a frame means is the round's business: each received frame is handed to
the ``on_frame`` callback (``receive.RoundReceiver``), which reads its payload from the link.

Why not libp2p streams first: hivemind's all-reduce moves tensors through p2pd, protobuf messages and asyncio queues;
on loopback it is 9-11x slower than gloo. Here each pair of group members holds one TCP connection, tensors go from
their memory to the socket and from the socket into the destination tensor (``recv_into``), with no copy in between
and no serialisation. Members that cannot be dialed over TCP are reached over a libp2p stream (``relay``), with the
same frames and handshake.

Dialing: the member with the smaller id dials, over direct TCP first. If that fails (``Unreachable``: the member is
behind NAT or a firewall) and a libp2p fallback is set, we ask the member over libp2p to dial *us* (connection
reversal: a volunteer behind NAT can usually open outgoing connections, so the link is still direct TCP); if it
cannot either (both behind NAT), the link goes over a libp2p stream (``relay``). Members that were unreachable
recently skip the direct attempt. Incoming links arrive through the data-plane server, where the limits against
strangers live (``dataplane``, ``admission``).

Failures: a member that closes, resets or sends nothing for ``part_timeout_s`` is recorded in ``inbox.errors`` and
makes ``wait`` raise ``PeerFailed`` if it is watched. While a ``wait`` is in progress, idle links carry a HEARTBEAT
every ``part_timeout_s / 4``, so a member merely waiting on a slow third peer is not mistaken for a stalled one.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from hivetrain.averaging.base import RoundFailed
from hivetrain.averaging.config import AveragingConfig
from hivetrain.averaging.dataplane import DataPlaneServer
from hivetrain.averaging.handshake import Elsewhere, RoundKeys, ask_where, dial
from hivetrain.averaging.reduce import Inbox, Member
from hivetrain.averaging.wire import FrameType, Link, LinkClosed, Unreachable

logger = logging.getLogger(__name__)

# on_frame(link, type, subround, meta, payload num_bytes): reads the payload; raises StopReading or LinkClosed
FrameHandler = Callable[[Link, FrameType, int, dict, int], None]


class StopReading(Exception):
    """Raised by a frame handler: nothing more from this peer is read (it is marked bad, or it has voted); the rest is
    drained and dropped until it closes."""


class PeerFailed(RoundFailed):
    """A watched member closed, reset, stalled or broke the protocol (reason "peer_failed")."""


def refuses_connections(host: str, port: int, timeout_s: float) -> bool:
    """Whether a TCP connection to ``host:port`` is refused: nothing listens there any more (a member's process
    ended). False when it connects or times out (a firewall may drop what a live member does not need). The probe
    sends nothing; a data port's deferred accept never hands it to the server."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


class RoundTransport:
    """Links, threads, queues and inbox of one round; one per round.

    Args:
        round_id: the round's id; me: our peer id; members: peer id -> ``Member`` (signed endpoints), us included.
        secret: our X25519 secret of this call; server: our data-plane server (incoming links).
        config: timeouts and socket buffers; fallback: a ``relay.P2PFallback`` or None.
        on_frame: the handler of every received frame other than HEARTBEAT (called on receiver threads).
        group: (round key, declaration id) of the round's declaration (``handshake.RoundKeys.group``): a member that
            will never join it (``handshake.Elsewhere``) fails its link at once instead of at the connect deadline;
            those that committed the round key without us are ``went_on``.
    """

    def __init__(
        self,
        *,
        round_id: str,
        me: str,
        members: dict[str, Member],
        secret,
        server: DataPlaneServer,
        config: AveragingConfig,
        on_frame: FrameHandler,
        fallback=None,
        join_grace_s: float | None = None,
        group: tuple[str, str] = ("", ""),
    ):
        self.round_id, self.me, self.members, self.server = round_id, me, members, server
        # how long a member may take to learn of the round after us: a follower reads its leader's declaration from
        # the DHT when a push is lost, so the matchmaker's grace scaled by the DHT's latency (``Matchmaker.grace_s``);
        # the fixed ``declare_grace_s`` failed a round of 2 members behind NAT under 2 concurrent test suites
        self.join_grace_s = config.declare_grace_s if join_grace_s is None else join_grace_s
        self.config, self.fallback, self.on_frame = config, fallback, on_frame
        self.others = [p for p in members if p != me]
        self.keys = RoundKeys(round_id, me, secret, {p: members[p].kx_public for p in self.others}, self._attach,
                              dial_back=self._dial_back, group=group)  # fmt: skip
        self.went_on: set[str] = set()  # members that committed our round key in another group (``Elsewhere``)
        self.inbox = Inbox()  # guarded by the lock
        self._cond = threading.Condition()
        self._links: dict[str, Link] = {}
        self._queues: dict[str, queue.Queue] = {}
        self._sent: set[tuple[str, FrameType]] = set()  # (peer, type) of frames that left
        self._threads: list[threading.Thread] = []
        self._done = False
        self._waiting = False
        self._registered = False
        self._dropped: set[str] = set()  # members the round goes on without (``drop``)
        self._senders_active, self._busy_since, self._busy_s = 0, 0.0, 0.0  # ``send_busy_s``

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def open(self, deadline: float) -> set[str]:
        """Register with the server and link to every other member. Returns the members we could not link to before
        the connect deadline (a dial failed, its data port refuses connections, or it never dialed us): the round
        goes on without them (``ButterflyRound``). Raises RoundFailed("timeout") if ``deadline``
        (``time.monotonic()``) comes first, and RoundFailed("not_in_group") with ``closed_without_us`` as soon as a
        member says it committed our round key in another group (``went_on``): a result of ours would be a second
        state of the epoch; its group's is the epoch's (``diloco.sync_policy.decide_sync`` follows it)."""
        self.server.register(self.keys)
        self._registered = True
        for p in self.others:
            if p > self.me:  # the smaller id dials: one connection per pair
                threading.Thread(target=self._dial_one, args=(p, deadline), name="hivetrain-avg-dial",
                                 daemon=True).start()  # fmt: skip
            else:  # it dials us; if it is gone, say so before the connect deadline
                threading.Thread(target=self._watch_dialer, args=(p, deadline), name="hivetrain-avg-watch",
                                 daemon=True).start()  # fmt: skip
        cfg = self.config
        attempts = 6 if self.fallback is not None else 3  # direct dial, dial-back and libp2p may each time out
        connect_deadline = min(deadline, time.monotonic() + attempts * cfg.connect_timeout_s + cfg.declare_grace_s)
        pending = lambda: [p for p in self.others if p not in self._links and p not in self.inbox.errors]  # noqa: E731
        try:
            self.wait(lambda: not pending() or bool(self.went_on), (), connect_deadline, "connecting")
        except RoundFailed:
            if time.monotonic() >= deadline:
                raise
        if self.went_on:  # the others' answers are a round trip away (a watched member's, 1 s): name all who went on
            try:
                self.wait(lambda: not pending(), (), min(connect_deadline, time.monotonic() + cfg.connect_timeout_s),
                          "connecting")  # fmt: skip
            except RoundFailed:
                pass
            went_on = frozenset(self.went_on)
            why = "; ".join(self.inbox.errors.get(p, "") for p in sorted(went_on))
            raise RoundFailed("not_in_group", why, closed_without_us=went_on)
        with self._cond:
            unlinked = {p for p in self.others if p not in self._links}
            self._dropped |= unlinked  # a link that attaches later is closed at once (``_attach``)
        for p in unlinked:
            self.drop(p, self.inbox.errors.get(p, "not linked by the connect deadline"))
        return unlinked

    def close(self, graceful: bool) -> None:
        """End the round: after a commit, FIN every link (the receivers drain and close them); after a failure,
        close every link at once so that members blocked on us fail now. Idempotent."""
        if self._registered:
            self.server.unregister(self.round_id)
        with self._cond:
            self._done = True
            links = list(self._links.values())
            self._cond.notify_all()
        for q in self._queues.values():
            q.put(None)
        for link in links:
            if graceful:
                link.finish()
            else:
                link.close()

    @property
    def done(self) -> bool:
        return self._done

    # ---- sending ------------------------------------------------------------------------------------------------
    def send(
        self, peer_id: str, ftype: FrameType, sub: int, meta: dict, payload: Sequence = (),
        on_progress: Callable[[int, int], None] | None = None,
    ) -> None:  # fmt: skip
        """Queue a frame to ``peer_id`` (sent in order by its sender thread); ``on_progress(sent, total)`` is called
        after each payload chunk. A link that fails meanwhile is reported through ``inbox.errors``. Nothing is sent
        to a member the round dropped."""
        if peer_id in self._dropped or peer_id not in self._queues:
            return
        self._queues[peer_id].put((ftype, sub, meta, list(payload), on_progress))

    def flush(self, deadline: float) -> None:
        """Stop the senders after what is queued, waiting for them until ``deadline`` (``time.monotonic()``)."""
        with self._cond:
            queues, threads = list(self._queues.values()), list(self._threads)
        for q in queues:
            q.put(None)
        for t in threads:
            if t.name == "hivetrain-avg-send":
                t.join(max(0.0, deadline - time.monotonic()))

    def has_sent(self, peer_id: str, ftype: FrameType) -> bool:
        """Whether a frame of type ``ftype`` has left for ``peer_id`` (handed to the kernel)."""
        return (peer_id, ftype) in self._sent

    def key(self, peer_id: str) -> bytes:
        """The pair key of our link to ``peer_id`` (linked members only)."""
        return self._links[peer_id].key

    def _sending(self, delta: int) -> None:
        """A sender thread starts (+1) or ends (-1) a frame: the union of those intervals is ``send_busy_s``."""
        now = time.monotonic()
        with self._cond:
            if self._senders_active == 0 and delta > 0:
                self._busy_since = now
            self._senders_active += delta
            if self._senders_active == 0:
                self._busy_s += now - self._busy_since

    def send_busy_s(self) -> float:
        """Seconds during which at least one link was sending a frame (handing bytes to the kernel). Our upload rate
        is about ``byte_counts()[0]`` over it once the round sent far more than the sockets buffer (the last
        ``socket_buffer_bytes`` per link leave after the send returns)."""
        with self._cond:
            open_s = time.monotonic() - self._busy_since if self._senders_active else 0.0
            return self._busy_s + open_s

    def byte_counts(self) -> tuple[int, int]:
        """(bytes sent, bytes received) over all links since their handshakes."""
        links = list(self._links.values())
        return sum(link.bytes_sent for link in links), sum(link.bytes_received for link in links)

    # ---- the inbox ----------------------------------------------------------------------------------------------
    def deliver(self, update: Callable[[Inbox], None]) -> None:
        """Apply ``update`` to the inbox under the lock and wake waiters."""
        with self._cond:
            update(self.inbox)
            self._cond.notify_all()

    def post_error(self, peer_id: str, reason: str) -> None:
        self.deliver(lambda inbox: inbox.errors.setdefault(peer_id, reason))

    def read(self, view: Callable[[Inbox], object]) -> object:
        """``view(inbox)`` under the lock."""
        with self._cond:
            return view(self.inbox)

    def wait(
        self, ready: Callable[[], bool], watched: Iterable[str] | Callable[[], Iterable[str]], deadline: float,
        what: str, reason: str = "timeout",
    ) -> None:  # fmt: skip
        """Block until ``ready()`` (called under the lock; it may read ``inbox``).

        Raises:
            PeerFailed: a watched member (``watched``: peer ids, or a function returning them) failed.
            RoundFailed(reason): ``deadline`` (``time.monotonic()``) came first.
        """
        with self._cond:
            self._waiting = True
            try:
                while not ready():
                    ids = list(watched() if callable(watched) else watched)
                    failed = [(p, self.inbox.errors[p]) for p in ids if p in self.inbox.errors]
                    if failed:
                        raise PeerFailed("peer_failed", f"{what}: {failed[0][0]}: {failed[0][1]}")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        missing = ", ".join(p for p in ids if p not in self._links)
                        raise RoundFailed(reason, f"{what}: deadline reached" + (f" ({missing})" if missing else ""))
                    self._cond.wait(min(left, 0.5))
            finally:
                self._waiting = False

    def wait_any(
        self, ready: Callable[[], bool], watched: Callable[[], Iterable[str]], deadline: float, what: str
    ) -> set[str]:
        """Block until ``ready()`` (called under the lock; it may read ``inbox``) or a watched member fails.

        Returns:
            The watched members that failed (their links closed, reset or stalled), empty once ``ready()``.

        Raises:
            RoundFailed("timeout"): ``deadline`` (``time.monotonic()``) came first.
        """
        with self._cond:
            self._waiting = True
            try:
                while not ready():
                    failed = {p for p in watched() if p in self.inbox.errors}
                    if failed:
                        return failed
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise RoundFailed("timeout", f"{what}: deadline reached")
                    self._cond.wait(min(left, 0.5))
                return set()
            finally:
                self._waiting = False

    def drop(self, peer_id: str, why: str) -> None:
        """The round goes on without ``peer_id``: close our link to it (so that a stalled member that wakes up fails
        at once instead of sending into a round that moved on) and ignore whatever it sends from now on."""
        with self._cond:
            self._dropped.add(peer_id)
            self.inbox.errors.setdefault(peer_id, why)
            link = self._links.get(peer_id)
            self._cond.notify_all()
        if link is not None:
            link.close()

    def linked(self, peer_id: str) -> bool:
        """Whether we hold a link to ``peer_id`` that the round has not dropped."""
        with self._cond:
            return peer_id in self._links and peer_id not in self._dropped

    # ---- links --------------------------------------------------------------------------------------------------
    def _attach(self, link: Link) -> None:
        with self._cond:
            if (
                self._done
                or link.peer_id in self._links
                or link.peer_id not in self.others
                or (link.peer_id in self._dropped)
            ):
                link.close()
                return
            self._links[link.peer_id] = link
            self._queues[link.peer_id] = queue.Queue()
            # The threads are listed before anyone sees the link: once ``open`` returns, frames are queued and
            # ``flush`` joins the listed senders. Listed after the notify (as before), an attaching thread that lost
            # the CPU between starting a sender and listing it left ``flush`` nothing to wait for: our vote was still
            # queued when the round checked it, and the round failed although every vote had arrived (3 of 30 runs of
            # the 8-averager moshpit test beside a CPU hog).
            for target, name in ((self._receiver, "recv"), (self._sender, "send")):
                t = threading.Thread(target=target, args=(link,), name=f"hivetrain-avg-{name}", daemon=True)
                t.start()
                self._threads.append(t)
            self._cond.notify_all()

    def _dial_options(self) -> dict:
        cfg = self.config
        return dict(connect_timeout_s=cfg.connect_timeout_s, part_timeout_s=cfg.part_timeout_s,
                    buffer_num_bytes=cfg.socket_buffer_bytes,
                    join_wait_s=cfg.connect_timeout_s + self.join_grace_s)  # fmt: skip

    def _watch_dialer(self, peer_id: str, deadline: float) -> None:
        """``peer_id`` is to dial us. If it has not within 1 s (then ``connect_timeout_s``) and its data port refuses a
        TCP connection, no averager listens there any more (its process ended: killed, crashed): fail the round now.
        Waiting for its link would take the whole connect deadline (6 connect timeouts with the libp2p fallback):
        in a 9-peer two-stage round with one member SIGKILLed, two survivors spent 31 s of a 40 s round waiting to be
        dialed by the dead member and missed the retry the others committed (issue 23). Only a refusal counts: a
        timeout may be a firewall in front of a member that dials out fine, so that one is left to the deadline. After
        1 s, not ``connect_timeout_s`` (5 s): members that dial the dead peer fail at once, and 5 s later the others
        came back to a retry whose window had closed without them (9-peer chaos run). The probe sends nothing (the
        server's deferred accept never sees it)."""
        m = self.members[peer_id]
        for after_s in (min(1.0, self.config.connect_timeout_s), self.config.connect_timeout_s):
            with self._cond:
                self._cond.wait_for(
                    lambda: peer_id in self._links or self._done, max(0.0, min(after_s, deadline - time.monotonic()))
                )
                if peer_id in self._links or self._done:
                    return
            if refuses_connections(m.host, m.port, self.config.connect_timeout_s):
                self.post_error(peer_id, f"its data port {m.host}:{m.port} refuses connections: it is gone")
                return
            if self.keys.group[0]:  # it joined another declaration of our round key, or went on: it never dials us
                elsewhere = ask_where(m.host, m.port, peer_id, self.keys.group, self.config.connect_timeout_s)
                if elsewhere is not None and peer_id not in self._links:
                    self._elsewhere(peer_id, elsewhere)
                    return

    def _dial_one(self, peer_id: str, deadline: float) -> None:
        try:
            link = self._dial(peer_id, deadline)
        except Elsewhere as exc:
            self._elsewhere(peer_id, exc)
            return
        except ConnectionError as exc:
            self.post_error(peer_id, str(exc))
            return
        if link is not None:  # None: it dialed us back, and the server attached that link
            self._attach(link)

    def _elsewhere(self, peer_id: str, exc: Elsewhere) -> None:
        logger.info("round %s: %s: not waiting for it", self.round_id[:8], exc)
        if exc.went_on:
            with self._cond:
                self.went_on.add(peer_id)
        self.post_error(peer_id, str(exc))

    def _dial(self, peer_id: str, deadline: float) -> Link | None:
        """An authenticated link to ``peer_id``: direct TCP; else (or at once if it was unreachable recently) it
        dials us back, and the link arrives through our server (returns None once attached); else a libp2p stream.
        Raises ConnectionError (LinkClosed, AuthFailed) if none works."""
        cfg, m, fallback = self.config, self.members[peer_id], self.fallback
        if fallback is None or not fallback.prefers_libp2p(peer_id):
            try:
                return dial(m.host, m.port, self.keys, peer_id, **self._dial_options())
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
        return dial(m.host, m.port, self.keys, peer_id,
                    open_socket=lambda: fallback.open_socket(peer_id, cfg.connect_timeout_s),
                    **self._dial_options())  # fmt: skip

    def _dial_back(self, peer_id: str) -> bool:
        """Dial ``peer_id`` directly because it asked (it could not dial us); attach the link. Never over libp2p: the
        member asking falls back to a libp2p stream itself if this fails."""
        m = self.members.get(peer_id)
        if m is None or peer_id == self.me:
            return False
        try:
            link = dial(m.host, m.port, self.keys, peer_id, **self._dial_options())
        except ConnectionError as exc:
            logger.info("could not dial %s back: %s", peer_id, exc)
            return False
        self._attach(link)
        return True

    # ---- threads ------------------------------------------------------------------------------------------------
    def _sender(self, link: Link) -> None:
        q = self._queues[link.peer_id]
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
                ftype, sub, meta, payload, on_progress = item
                self._sending(+1)
                try:
                    link.send_frame(ftype, sub, meta, payload, on_progress=on_progress)
                finally:
                    self._sending(-1)
                self._sent.add((link.peer_id, ftype))
        except LinkClosed as exc:
            if not self._done:
                self.post_error(link.peer_id, str(exc))

    def _receiver(self, link: Link) -> None:
        try:
            while True:
                ftype, sub, meta, num_bytes = link.recv_header()
                if ftype != FrameType.HEARTBEAT:
                    self.on_frame(link, ftype, sub, meta, num_bytes)
        except StopReading:
            pass
        except LinkClosed as exc:
            if not self._done:
                self.post_error(link.peer_id, str(exc))
            link.close()
            return
        link.drain(self.config.part_timeout_s)  # nothing more is expected: drop the rest until the peer closes
