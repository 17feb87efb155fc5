"""The averaging interface the rest of hivetrain uses.

DiLoCo calls ``averager.average(tensors, weight, epoch, timeout_s, expected_peers, accept)`` once per outer step with
its pseudo-gradient.
The call either returns a ``RoundResult`` whose tensors are bit-identical on every member of the group, or raises
``RoundFailed``; a failed round changes nothing locally (the caller keeps θ and may retry or resync).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

ExpectedPeers = frozenset[str] | Callable[[], frozenset[str]]
"""``Averager.average``'s ``expected_peers``: the peer ids expected at the epoch, or a function returning them now."""


class RoundFailed(RuntimeError):
    """An averaging round did not commit for us; nothing from it may be applied on this evidence alone.

    Attributes:
        reason: a short machine-readable cause ("no_group", "timeout", "peer_failed", "aborted", "bad_input",
            "refused": our ``accept`` check refused the result, so we voted against it and nobody commits, ...).
        voted: set when the round failed after we voted (the two-phase-commit gap, ``allreduce``): the result we
            voted for, which members that received every vote may have committed. The caller applies it only on
            evidence that a member did (``diloco.round_policy.committed_without_us``); None otherwise.
        closed_without_us: peer ids (base58) of the members of a group of our round key that closed without us
            ("not_in_group": matchmaking's "late" / "not_in_group" verdicts): the epoch's round, whose result the
            caller may follow once its members hold it (``diloco.sync_policy.decide_sync``); empty otherwise.
    """

    def __init__(self, reason: str, detail: str = "", *, closed_without_us: frozenset[str] = frozenset()):
        super().__init__(f"averaging round failed: {reason}" + (f" ({detail})" if detail else ""))
        self.reason = reason
        self.detail = detail
        self.voted: RoundResult | None = None
        self.closed_without_us = closed_without_us


@dataclass(frozen=True)
class RoundResult:
    """A committed averaging round.

    Attributes:
        tensors: the weighted mean, fp32, same shapes as the inputs; bit-identical on every member.
        group: peer ids (base58) of the members whose contributions are in the mean, sorted.
        total_weight: sum of the members' weights (samples).
        round_id: identifies the round (the same on every member).
        bytes_sent: payload bytes this peer sent during the round.
        bytes_received: payload bytes this peer received during the round.
        duration_s: wall time of the call, seconds.
        excluded: members of the round whose contributions are not counted in ``total_weight`` (they died, stalled
            or sent bad data), sorted.
        slice_members: (start, end, members) per slice of the flattened tensors that averages other members than
            ``group``: a slice reduced before a member was dropped keeps its part (``allreduce``); empty = none.
        weights: (peer id, samples) of the contributors of the group we averaged in ourselves, as its members agreed
            them (the two-stage round: our row); empty for moshpit/gossip. What a member witnesses for the credit of
            the others (``diloco.credit``).
    """

    tensors: list[torch.Tensor]
    group: tuple[str, ...]
    total_weight: float
    round_id: str
    bytes_sent: int = 0
    bytes_received: int = 0
    duration_s: float = 0.0
    excluded: tuple[str, ...] = field(default_factory=tuple)
    slice_members: tuple[tuple[int, int, tuple[str, ...]], ...] = field(default_factory=tuple)
    weights: tuple[tuple[str, float], ...] = field(default_factory=tuple)


class Averager(Protocol):
    """What DiLoCo needs from an averaging engine."""

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
        """Average ``tensors`` with the peers ready at ``epoch``, weighted by ``weight``.

        Args:
            tensors: fp32 CPU tensors (any shapes); the same shapes and order on every peer.
            weight: this peer's weight, in samples (finite, >= 0).
            epoch: peers average only with peers of the same epoch.
            timeout_s: the whole call (matchmaking + all-reduce + commit) ends within this many seconds.
            expected_peers: the peer ids (base58) the caller expects to average at ``epoch``, e.g. the live trainers
                its DHT records show at that epoch; ours may be in it or not. The group closes as soon as every one
                of them (peers we banned aside) is ready, instead of waiting out the matchmaking window: the window
                is only for peers not yet visible. A peer missing from the set is still grouped if it is ready in
                time; an expected peer that never comes delays the group to the window (and ``patience_s``), no
                further. An empty set
                (the default) = no such knowledge: the group closes at the window or when it is full. A callable
                returning the set is asked again at every matchmaking decision: peers that move on without us
                (their records now show a later epoch) stop being waited for. A woken laptop's first view of the
                swarm can be the one from before its sleep; a fixed set kept it waiting a whole round timeout for
                peers 6 epochs ahead (chaos ``pause-twice``, dev/LOG.md 2026-12-01).
            accept: called once with the full result, a flat fp32 tensor (n,) (the inputs concatenated in order;
                read-only, valid during the call only), and the peer ids whose contributions it holds (sorted), on
                every member that holds it, before it votes to commit; returns "" to vote normally, or a reason to
                refuse. A refusing member votes against the result (a
                vote that matches nobody's), so every member fails with "aborted" and nobody commits, and its own
                call raises ``RoundFailed("refused", reason)``; neither carries a ``voted`` result. A round of one
                is checked too. Engines whose members end a call with different values ("moshpit", "gossip")
                ignore it: there the caller checks its own applied step. None = accept every result. A round of
                several members also passes ``epoch_groups`` (keyword, ``matchmaking.EpochGroups``): our
                declaration and the other live declarations of the epoch, read when the result is checked.
            patience_s: while an expected peer is not ready, the group waits this long past the matchmaking window
                for it (at least the grace a DHT store takes to show), seconds, in [0, ``timeout_s``): the caller's
                estimate of what a slow expected peer still needs, e.g. one inner step of a starved volunteer.
                A peer that never comes costs the group this much at most.

        Returns:
            The committed round.

        Raises:
            RoundFailed: no round committed (no peers, a member died or stalled, bad data, timeout, a member's
                ``accept`` refused the result). If a member dies mid-call, the survivors go on without it where
                the engine can and is asked to (``GroupAverager``'s butterfly round with ``drop_failed``);
                otherwise the round aborts on every survivor; a failed round is applied nowhere.
            ValueError: bad local input (non-finite tensors or weight, wrong dtype).
        """
        ...

    @property
    def data_address(self) -> str | None:
        """``host:port`` others dial for our data plane once started (None: no data port, or not started yet)."""
        ...

    def ban(self, peer_ids: Iterable[str], reason: str) -> None:
        """Never group with these peers again in this process's lifetime (an hour at least): the caller caught them
        lying outside a round (``reason`` is for logs)."""
        ...

    def banned(self) -> frozenset[str]:
        """Peer ids left out of our groups now (peers caught sending bad data in a round, and those given to
        ``ban``)."""
        ...

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop serving rounds and release sockets; idempotent."""
        ...
