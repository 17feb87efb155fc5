"""GroupAverager: matchmaking over the DHT, then an all-or-nothing butterfly all-reduce over direct TCP.

Lifecycle: ``GroupAverager(node, prefix, config)`` -> ``start()`` (binds the data port) -> ``wait_ready(timeout_s)``
-> ``average(...)`` once per outer step, from any one thread at a time -> ``shutdown()``.

Strategies:
    "butterfly"  one declaration of all peers ready at the epoch; up to ``target_group_size`` of them average in
                 one group, more in the two-stage all-reduce of ``hierarchical`` (rows of at most that size, then
                 columns across them). The result is the exact sample-weighted mean of every participant,
                 bit-identical on every member (issue 23: before, groups averaged apart and the epoch forked).
    "moshpit"    peers ready at the epoch agree on the list of participants, then run ``moshpit_rounds`` rounds in
                 the groups of ``groups.moshpit_groups`` on a grid of ``grid_for(n, target_group_size)``
                 (Ryabinin et al. 2021, Alg. 1); on a full grid d rounds reach the exact global weighted mean.
    "gossip"     the same with random pairs (``groups.gossip_pairs``); an approximate average.
For "moshpit"/"gossip" each inner round is all-or-nothing within its group, but different groups end with different
values until the rounds mix them completely; a failed inner round keeps our current value and goes on.

Error feedback (``config.error_feedback``, with a codec): our contribution is ``tensors + residual``, and the residual
becomes what the codec dropped from it (``feedback.ErrorFeedback``) once a round that carried it commits; a failed
call leaves the residual as it was. For "moshpit"/"gossip" the first committed inner round carries it.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from hivetrain.averaging.allreduce import ButterflyRound
from hivetrain.averaging.base import ExpectedPeers, RoundFailed, RoundResult
from hivetrain.averaging.config import AveragingConfig
from hivetrain.averaging.dataplane import DataPlaneServer, Pusher
from hivetrain.averaging.feedback import ErrorFeedback
from hivetrain.averaging.groups import UPLOAD_SAMPLE_BUFFERS, gossip_pairs, grid_for, moshpit_groups
from hivetrain.averaging.hierarchical import two_stage
from hivetrain.averaging.matchmaker import Matchmaker
from hivetrain.averaging.matchmaking import MAX_MEMBERS, GroupDeclaration
from hivetrain.averaging.reduce import BufferPool, Member, OutputBuffers, RoundOutcome, all_finite
from hivetrain.averaging.relay import P2PFallback
from hivetrain.faults import NO_FAULTS, FaultInjector
from hivetrain.peers.bans import BanConfig, BanList
from hivetrain.peers.node import ip_of

logger = logging.getLogger(__name__)

_FAILURES = {"late": "not_in_group", "not_in_group": "not_in_group", "no_group": "no_group", "too_small": "no_group"}


def _peer_ids(x: object) -> bool:
    return isinstance(x, frozenset) and all(isinstance(p, str) for p in x)


def _announce_host_from(maddrs: Sequence[str]) -> str:
    hosts = (ip_of(str(addr)) for addr in maddrs)
    return next((h for h in hosts if h and h not in ("0.0.0.0", "::")), "127.0.0.1")


class GroupAverager:
    """Averages tensors with the peers of the same epoch; implements ``hivetrain.averaging.base.Averager``.

    Args:
        node: our running DHT node (``hivetrain.peers.node.start_node``).
        prefix: scopes the DHT keys of this averager, e.g. f"{run_id}.avg" or f"{run_id}.stage{k}.avg".
        config: the ``[averaging]`` table.
        faults: fault injector (tests, chaos harness).
        listen_host: address the data port binds (port chosen by the OS).
        announce_host: address others dial; None = ``listen_host`` if it is specific, else the first address of
            the DHT node's visible multiaddrs.
        admits: whether a peer ID is a member of the run (``peers.membership.MemberRoster.admits``): non-members'
            matchmaking records are ignored and their data-plane links refused. None = an open run.

    Attribute ``record_levels``: a function giving the swarm's peer-record shard levels (default: level 0 only), set
    by the DiLoCo trainer to its view's (``SwarmView.shard_levels``): our matchmaking entries go in the shards one
    level coarser (``entry_shards``), so that no round key's DHT value grows with the swarm.
    """

    def __init__(
        self,
        node,
        prefix: str,
        config: AveragingConfig,
        *,
        faults: FaultInjector = NO_FAULTS,
        listen_host: str = "0.0.0.0",
        announce_host: str | None = None,
        admits: Callable[[str], bool] | None = None,
    ):
        if not prefix:
            raise ValueError("prefix must be a non-empty string")
        self.node, self.prefix, self.config, self.faults = node, prefix, config, faults
        self.listen_host, self.announce_host = listen_host, announce_host
        # our upload rate, Mbit/s, published in our entries (it sizes the slice we reduce): declared, or measured
        # from our committed rounds (``_note_upload``); None until known
        self.upload_mbps: float | None = config.upload_mbps or None
        self.server = DataPlaneServer(
            listen_host,
            connect_timeout_s=config.connect_timeout_s,
            part_timeout_s=config.part_timeout_s,
            buffer_num_bytes=config.socket_buffer_bytes,
            join_wait_s=config.connect_timeout_s + config.declare_grace_s,
            on_declaration=lambda raw: self.matchmaker.offer(raw),
            on_ready=lambda raw: self.matchmaker.offer_entry(raw),
            admits=admits,
        )
        self.matchmaker = Matchmaker(
            node,
            prefix,
            poll_interval_s=config.poll_interval_s,
            declare_grace_s=config.declare_grace_s,
            push=Pusher(timeout_s=config.connect_timeout_s),
            admits=admits,
            read_bytes_per_s=config.matchmaking_read_kib_s * 1024,
            record_levels=lambda: self.record_levels(),
        )
        self.record_levels: Callable[[], Sequence[int]] = lambda: (0,)
        ban_time_s = max(config.ban_time_s, 1.0)
        self.bans = BanList(BanConfig(ban_base_s=ban_time_s, ban_max_s=max(3600.0, ban_time_s)))
        self.pool = BufferPool()  # receive buffers and the flat input, kept between calls (~2x the input size)
        self._outputs = OutputBuffers()  # result buffers, reused once the caller has let go of them
        # error feedback: one residual per slot; the round of epoch e uses slot e mod ``feedback_slots`` (the trainer
        # sets it to ``diloco.fragments``: each fragment's rounds carry their own residual); ``_feedback`` is the
        # current round's
        self.feedback_slots = 1
        self._feedbacks: dict[int, ErrorFeedback] = {}
        self._feedback = self._feedback_slot(0)
        self.fallback: P2PFallback | None = None  # set by start() if config.libp2p_fallback
        self._lock = threading.Lock()
        self._started = threading.Event()
        self._closed = False

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Bind the data port and start accepting links. Raises OSError if ``listen_host`` cannot be bound."""
        if self._started.is_set():
            return
        self.server.start()
        if self.config.libp2p_fallback:
            fallback = P2PFallback(self.node, self.prefix, self.server)
            try:
                fallback.start(timeout_s=max(10.0, self.config.connect_timeout_s))
                self.fallback = fallback
            except Exception as exc:  # noqa: BLE001 - direct TCP still works; say what is lost
                fallback.shutdown()
                logger.warning("no libp2p fallback for the data plane (peers behind NAT cannot average): %s", exc)
        if self.announce_host is None:
            specific = self.listen_host not in ("0.0.0.0", "::", "")
            self.announce_host = self.listen_host if specific else _announce_host_from(self.node.visible_maddrs())
        self._started.set()
        logger.info("averager %s listening on %s:%d", self.prefix, self.announce_host, self.server.port)

    @property
    def data_address(self) -> str | None:
        """``announce_host:port`` of our data port once ``start`` ran, else None (what the "start" event names)."""
        return f"{self.announce_host}:{self.server.port}" if self._started.is_set() else None

    def wait_ready(self, timeout_s: float) -> None:
        """Block until started and the DHT node is alive. Raises TimeoutError after ``timeout_s`` seconds."""
        if not self._started.wait(timeout_s):
            raise TimeoutError(f"averager not started within {timeout_s}s (call start())")
        if not self.node.dht.is_alive():
            raise TimeoutError("the DHT node is not running")

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop accepting links; idempotent. A round in progress fails on its own within its timeouts."""
        self._closed = True
        if self.fallback is not None:
            self.fallback.shutdown(timeout_s)
        self.server.shutdown(timeout_s)
        self.pool.clear()

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def dht_latency_s(self) -> float:
        """The slowest of our recent matchmaking DHT operations, seconds (``Matchmaker.dht_latency_s``): callers'
        retry backoffs are never shorter."""
        return self.matchmaker.dht_latency_s

    def ban(self, peer_ids: Iterable[str], reason: str) -> None:
        """Leave these peers out of our groups for the longest ban (``BanConfig.ban_max_s``, >= 1 h): the
        caller caught them lying outside a round (a poisoned state, an impossible epoch), evidence at least as strong
        as bad data inside one. Thread-safe."""
        now = time.time()
        for peer in peer_ids:
            self.bans.ban(peer, now, self.bans.config.ban_max_s, reason=reason)

    def banned(self) -> frozenset[str]:
        """Peers left out of our groups now: caught sending bad data in a round (for ``ban_time_s``, longer for
        repeat offenders) or banned by ``ban``. Thread-safe."""
        return self._banned_now()

    # ---- averaging ----------------------------------------------------------------------------------------------
    def average(
        self,
        tensors: Sequence[torch.Tensor],
        weight: float,
        epoch: int,
        timeout_s: float,
        expected_peers: ExpectedPeers = frozenset(),
        accept: Callable[[torch.Tensor, tuple[str, ...]], str] | None = None,
        patience_s: float = 0.0,
    ) -> RoundResult:
        """Average ``tensors`` with the peers ready at ``epoch``, weighted by ``weight`` (see ``base.Averager``).

        Args:
            tensors: fp32 CPU tensors, the same shapes and order on every peer; not modified.
            weight: our weight in samples, finite, in [0, max_samples_per_round].
            epoch: only peers calling with the same epoch average together.
            timeout_s: the whole call ends within this many seconds (plus at most ``poll_interval_s``, or
                ``commit_timeout_s`` for a round that reached its vote).
            expected_peers: peer ids expected at ``epoch`` (ours may be in it): once all of them (banned ones aside)
                are ready, the group closes at once instead of after ``matchmaking_time_s``. Empty = wait for the
                window (or ``target_group_size`` ready peers). A callable is asked at every decision (``base``).
            accept: "butterfly" only (see ``base.Averager``): checks the flat fp32 (n,) result before we vote (a
                solo result before it is returned), given ``epoch_groups`` too with other members; a non-empty reason
                refuses it: RoundFailed("refused") here, "aborted" on every other member.
            patience_s: while an expected peer is not ready, the group waits this long past its window, seconds
                (at least the declare grace; see ``base.Averager``).

        Returns:
            RoundResult: the mean (fp32, input shapes), bit-identical on every member for "butterfly".

        Raises:
            RoundFailed: "not_in_group" (a group formed without us, ``closed_without_us``: resync), "no_group"
                (nobody, or fewer than ``min_group_size``), "peer_failed"/"timeout"/"aborted" (a member died, stalled
                or misbehaved; nothing was applied anywhere, except in the two-phase-commit gap of ``allreduce``:
                then ``voted`` holds the result we voted for, in the shapes of ``tensors``), "excluded" (others found
                our data bad), "refused" (``accept`` refused the result). If a member dies mid-call, the survivors
                fail within about ``part_timeout_s``.
            ValueError / TypeError: bad local input.
            RuntimeError: ``start()`` was not called, or the averager is shut down.
        """
        started = time.monotonic()
        self._check_input(tensors, weight, epoch, timeout_s)
        if not callable(expected_peers) and not _peer_ids(expected_peers):
            raise TypeError("expected_peers must be a frozenset of peer id strings, or a function returning one")
        if isinstance(patience_s, bool) or not isinstance(patience_s, int | float) or not 0 <= patience_s < timeout_s:
            raise ValueError(f"patience_s must be a number in [0, timeout_s={timeout_s}), got {patience_s!r}")
        if not self._started.is_set() or self._closed:
            raise RuntimeError("GroupAverager is not running: call start() first")
        deadline = started + timeout_s
        # one contiguous tensor is read in place (the round never writes it) unless error feedback or a fault hook
        # may change it; else it is copied into a pooled buffer (reused between calls: no page faults)
        in_place = len(tensors) == 1 and tensors[0].is_contiguous()
        in_place = in_place and not self.config.error_feedback and self.faults is NO_FAULTS
        with self._lock:
            self._feedback = self._feedback_slot(epoch % self.feedback_slots)
            flat = tensors[0].detach().reshape(-1) if in_place else self.pool.take(sum(t.numel() for t in tensors))
            try:
                if not in_place:
                    torch.cat([t.detach().reshape(-1) for t in tensors], out=flat)
                # a zero-weight contribution counts for nothing: it neither carries nor consumes the residual
                residual = self._feedback.apply(flat) if self._feedback is not None and weight > 0 else None
                args = (flat, float(weight), epoch, deadline, residual, expected_peers, float(patience_s))
                if self.config.exact_average:  # butterfly; moshpit and gossip mix
                    outcome, round_id, group = self._butterfly(*args, accept=accept)
                else:
                    outcome, round_id, group = self._mixing(*args)
            except RoundFailed as exc:
                if exc.voted is not None:  # the flat result we voted for, in the caller's shapes
                    views = _unflatten(exc.voted.tensors[0], tensors)
                    exc.voted = replace(exc.voted, tensors=views, duration_s=time.monotonic() - started)
                raise
            finally:
                if not in_place:
                    self.pool.give(flat)
        return RoundResult(
            tensors=_unflatten(outcome.flat, tensors),
            group=group,
            total_weight=outcome.total_weight,
            round_id=round_id,
            bytes_sent=outcome.bytes_sent,
            bytes_received=outcome.bytes_received,
            duration_s=time.monotonic() - started,
            excluded=outcome.excluded,
            slice_members=outcome.slice_members,
            weights=outcome.weights,
        )

    def _check_input(self, tensors: Sequence[torch.Tensor], weight: float, epoch: int, timeout_s: float):
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence) or not tensors:
            raise TypeError("tensors must be a non-empty sequence of torch.Tensor")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensors[{i}] is a {type(t).__name__}, not a torch.Tensor")
            if t.dtype != torch.float32 or t.device.type != "cpu":
                raise ValueError(f"tensors[{i}] is {t.dtype} on {t.device}; expected float32 on cpu")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            raise ValueError(f"weight must be a finite number, got {weight!r}")
        if not 0 <= weight <= self.config.max_samples_per_round:
            raise ValueError(f"weight {weight} outside [0, max_samples_per_round={self.config.max_samples_per_round}]")
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be finite and > 0, got {timeout_s}")
        for i, t in enumerate(tensors):
            if not all_finite(t.detach().reshape(-1)):
                raise ValueError(f"tensors[{i}] holds NaN or Inf")

    def _banned_now(self) -> frozenset[str]:
        return frozenset(r.peer_id for r in self.bans.active(time.time()))

    def _match(
        self,
        round_key: str,
        target: int,
        deadline: float,
        expected: ExpectedPeers,
        patience_s: float,
        tolerant_rows: int = 0,
    ) -> tuple[GroupDeclaration, X25519PrivateKey, frozenset[str]]:
        cfg = self.config
        secret = X25519PrivateKey.generate()
        kx_public = secret.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        # we wait for a group until the call's deadline (less the grace a follower gives its leader); the window we
        # open closes after matchmaking_time_s (longer on a slow DHT): past it we wait only for expected peers
        # without whom we would be alone (``matchmaking.decide``)
        wait_s = max(0.0, deadline - time.monotonic() - self.matchmaker.grace_s())
        window_s = self.matchmaker.window_s(cfg.matchmaking_time_s)
        assert self.announce_host is not None
        me = self.matchmaker.make_entry(
            round_key, os.urandom(16), self.announce_host, self.port, kx_public, wait_s, window_s, self.upload_mbps
        )
        banned = self._banned_now()
        decision, reason = self.matchmaker.match(
            me,
            target_group_size=target,
            min_group_size=cfg.min_group_size,
            ttl_s=cfg.round_timeout_s,
            deadline_monotonic=deadline,
            banned=banned,
            expected=expected,
            patience_s=patience_s,
            tolerant_rows=tolerant_rows,
        )
        if decision.action != "joined" or decision.declaration is None:
            closed = frozenset(decision.declaration.member_ids() if decision.declaration is not None else ())
            raise RoundFailed(_FAILURES.get(decision.action, "no_group"), reason, closed_without_us=closed)
        return decision.declaration, secret, banned

    def _run(
        self,
        round_id: str,
        decl: GroupDeclaration,
        ids: Sequence[str],
        secret,
        flat,
        weight,
        epoch,
        deadline,
        out,
        residual_out=None,
        **kw,
    ) -> RoundOutcome:
        entries = {m.peer_id: m for m in decl.members}
        members = [
            Member(p, entries[p].host, entries[p].port, entries[p].kx_public, entries[p].upload_mbps) for p in ids
        ]
        config = kw.pop("config", self.config)  # the two-stage round's confirm runs plain fp32
        kw.setdefault("drop_failed", config.drop_failed)  # columns pass False (confirms too with drop_failed off)
        r = ButterflyRound(round_id=round_id, members=members, me=self.node.peer_id, secret=secret, server=self.server,
                           config=config, faults=self.faults, epoch=epoch, bans=self.bans, pool=self.pool,
                           fallback=self.fallback, join_grace_s=self.matchmaker.grace_s(),
                           group=(decl.round_key, decl.round_id), **kw)  # fmt: skip
        outcome = r.run(flat, weight, deadline, out=out, residual_out=residual_out)
        self._note_upload(outcome, len(ids) - 1)
        return outcome

    def _note_upload(self, outcome: RoundOutcome, num_links: int) -> None:
        """Update our measured upload rate (``upload_mbps``, published in our next entries) from a committed round:
        the bytes we sent over the time our links were sending, when the round sent at least ``UPLOAD_SAMPLE_BUFFERS``
        socket buffers per link (below that, the sends return once the kernel holds the bytes, and the rate says
        nothing of the link). A declared rate (``averaging.upload_mbps``) is never replaced."""
        if self.config.upload_mbps > 0 or outcome.send_busy_s <= 0 or num_links < 1:
            return
        if outcome.bytes_sent < UPLOAD_SAMPLE_BUFFERS * max(self.config.socket_buffer_bytes, 1 << 20) * num_links:
            return
        sample = outcome.bytes_sent * 8 / outcome.send_busy_s / 1e6
        self.upload_mbps = sample if self.upload_mbps is None else 0.5 * (self.upload_mbps + sample)

    def _butterfly(
        self, flat: torch.Tensor, weight: float, epoch: int, deadline: float, residual, expected, patience_s, accept
    ):
        """Every peer ready at the epoch in one declaration; one group of them, or with more than
        ``target_group_size`` the two-stage all-reduce (``hierarchical``): one mean either way."""
        out = self._outputs
        out.prepare(flat.numel())  # a free kept buffer, or a new one touched while we wait on the DHT
        self.server.note_committed(f"e{epoch}", "", committed=False)  # at this round key again: not done with it
        cfg = self.config
        # a round that goes on without members that fail stays the epoch's while it may still commit without them
        tolerant_rows = cfg.target_group_size if cfg.drop_failed else 0  # (``matchmaking.over_because``)
        decl, secret, banned = self._match(f"e{epoch}", MAX_MEMBERS, deadline, expected, patience_s, tolerant_rows)
        ids = decl.member_ids()
        if accept is not None and len(ids) > 1:  # ranked against our epoch's other declarations, read meanwhile
            rules = {"tolerant_rows": tolerant_rows, "min_group_size": cfg.min_group_size}
            groups = self.matchmaker.epoch_groups(decl, cfg.round_timeout_s, **rules)
            checks = accept
            accept = lambda x, group: checks(x, group, epoch_groups=groups())  # noqa: E731
        if len(ids) == 1:
            refusal = accept(flat, tuple(ids)) if accept is not None else ""
            if refusal:
                raise RoundFailed("refused", refusal)
            solo = RoundOutcome(out.get().copy_(flat), ids, (), weight, 0, 0, weights=((ids[0], weight),))
            self._feedback_done(residual, exact=True)
            return solo, decl.round_id, ids
        if len(ids) > self.config.target_group_size:

            def run(round_id: str, members, x, w, dest, residual_out, **kw) -> RoundOutcome:
                return self._run(round_id, decl, members, secret, x, w, epoch, deadline, dest, residual_out,
                                 banned=banned, **kw)  # fmt: skip

            outcome = two_stage(self.node.peer_id, decl.round_id, list(ids), self.config, run, flat, weight,
                                out=out.get(), residual_out=residual, accept=accept)  # fmt: skip
        else:
            outcome = self._run(decl.round_id, decl, ids, secret, flat, weight, epoch, deadline, out.get(), residual,
                                banned=banned, accept=accept)  # fmt: skip
        self.server.note_committed(decl.round_key, decl.round_id)  # we never average at this round key again
        self._feedback_done(residual)
        return outcome, decl.round_id, outcome.contributors

    def _feedback_slot(self, slot: int) -> ErrorFeedback | None:
        if not self.config.error_feedback:
            return None
        return self._feedbacks.setdefault(slot, ErrorFeedback(self.config.error_feedback_decay))

    def _feedback_done(self, residual, exact: bool = False) -> None:
        """A round that carried our contribution (residual included) committed."""
        if residual is None or self._feedback is None:
            return
        if exact:
            self._feedback.commit_exact()
        else:
            self._feedback.commit()

    def _mixing(self, flat: torch.Tensor, weight: float, epoch: int, deadline: float, residual, expected, patience_s):
        """Moshpit / gossip: agree on the participants once, then ``moshpit_rounds`` rounds in derived groups."""
        cfg = self.config
        decl, secret, banned = self._match(f"e{epoch}", MAX_MEMBERS, deadline, expected, patience_s)
        ids = decl.member_ids()
        current, current_w = flat, weight
        sent = received = 0
        committed = 0
        excluded: set[str] = set()
        grid = grid_for(len(ids), cfg.target_group_size) if len(ids) > 1 else (2,)
        for r in range(cfg.moshpit_rounds):
            index = epoch * cfg.moshpit_rounds + r
            if cfg.strategy == "moshpit":
                groups, why = moshpit_groups(ids, grid, index, self.prefix)
            else:
                groups, why = gossip_pairs(ids, index, self.prefix)
            group = next(g for g in groups if self.node.peer_id in g)
            logger.debug("%s round %d: %s; our group %s", cfg.strategy, r, why, group)
            if len(group) == 1:
                continue
            round_id = hashlib.sha256(f"{decl.round_id}|{r}|{','.join(group)}".encode()).hexdigest()[:32]
            max_weight = cfg.max_samples_per_round * (cfg.target_group_size + 1) ** r
            try:
                carry = residual if committed == 0 else None  # our own contribution is in the first committed round
                outcome = self._run(round_id, decl, group, secret, current, current_w, epoch, deadline, None, carry,
                                    banned=banned, max_weight=max_weight)  # fmt: skip
            except RoundFailed as exc:
                logger.warning("%s round %d of epoch %d failed: %s", cfg.strategy, r, epoch, exc)
                if time.monotonic() >= deadline:
                    break
                continue
            if committed == 0:
                self._feedback_done(residual)
            committed += 1
            current = outcome.flat
            if cfg.strategy == "moshpit":  # a group's mean stands for its members' total weight (exact on a full grid)
                current_w = outcome.total_weight
            sent, received = sent + outcome.bytes_sent, received + outcome.bytes_received
            excluded |= set(outcome.excluded)
        if committed == 0 and len(ids) > 1:
            raise RoundFailed("aborted", f"none of the {cfg.moshpit_rounds} {cfg.strategy} rounds committed")
        if len(ids) == 1:
            self._feedback_done(residual, exact=True)
        result = current.clone() if current is flat else current  # ``flat`` goes back to the pool
        outcome = RoundOutcome(result, ids, tuple(sorted(excluded)), current_w, sent, received)
        return outcome, decl.round_id, tuple(p for p in ids if p not in excluded)


def _unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` (n,) in the shapes of ``like``, in order."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out
