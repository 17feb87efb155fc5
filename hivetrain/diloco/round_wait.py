"""Waiting out the swarm's round that a peer cannot join, instead of computing a phase the round would not take.

Without overlap, a peer whose epoch's round is under way without it (its members ended their phases and are matching
or averaging: ``schedule.round_under_way``), or that is behind the newest epoch a live trainer holds while that
epoch's round is under way, waits until the round is over, then downloads its result and trains for the next epoch
(issue 23: joiners arriving during a round dropped their first phase; a joiner that downloads the state a round is
about to replace arrives one epoch behind again). The wait is bounded: at most ``averaging.round_timeout_s``, once
per epoch of ours (a claim of being done only delays us), and no longer than until one of the round's members
publishes a failed attempt (its members then match again for the same epoch, which we can train for and join).

``DilocoTrainer`` owns one; the simulator asks the same question through ``schedule.round_to_wait_for``
(``sim.state_sync``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from hivemind.utils import get_dht_time

from hivetrain.diloco.schedule import failed_rounds, round_failed_since, round_to_wait_for, round_under_way
from hivetrain.peers.records import PeerRecord

logger = logging.getLogger(__name__)


class _View(Protocol):
    records: list[PeerRecord]

    def refresh(self) -> list[PeerRecord]: ...

    def request_publish(self) -> None: ...


class _Phases(Protocol):
    def wait_for(self, epoch: int) -> None: ...


class RoundWait:
    """Waits out a round under way without us (module docstring), at most once per epoch of ours.

    Args:
        peer_id: our peer ID (base58).
        view: the swarm's records (``records``, ``refresh()`` reads them afresh, ``request_publish()``).
        phases: the inner phases; ``wait_for(epoch)`` makes our record show the phase we will compute next.
        record_ttl_s: records older than this do not count, seconds.
        round_timeout_s: the longest wait, seconds (``averaging.round_timeout_s``: no round outlives it).
        min_group_size: ``averaging.min_group_size`` (a round needs this many members).
        stop: set when the peer stops; ends the wait at once.
        emit: the trainer's event sink; a ``round_wait`` event (``round_epoch``) starts each wait.
        check_dht: raises ``DhtLost`` when the swarm could not be read for too long; called every 0.5 s while waiting.
    """

    def __init__(
        self,
        peer_id: str,
        view: _View,
        phases: _Phases,
        *,
        record_ttl_s: float,
        round_timeout_s: float,
        min_group_size: int,
        stop: threading.Event,
        emit: Callable[..., None],
        check_dht: Callable[[], None],
    ):
        self.peer_id, self.view, self.phases = peer_id, view, phases
        self.record_ttl_s, self.round_timeout_s, self.min_group_size = record_ttl_s, round_timeout_s, min_group_size
        self.stop, self.emit, self.check_dht = stop, emit, check_dht
        self.waited_epoch = -1  # our epoch when we last waited (once per epoch)

    def under_way(self, epoch: int, records: Sequence[PeerRecord]) -> bool:
        """Whether ``epoch``'s round is under way without us in ``records`` (``schedule.round_under_way``)."""
        return round_under_way(self.peer_id, epoch, records, get_dht_time(), self.record_ttl_s, self.min_group_size)

    def wait_out(self, my_epoch: int, committed_epoch: int) -> bool:
        """Wait for the round of the swarm's epoch (ours, or the newest a live trainer holds when we are behind) if it
        is under way without us, once per ``my_epoch``. Returns whether we waited: the caller then downloads the
        round's result if the records show it.

        ``committed_epoch``: the epoch our last own commit brought us to. Reached by committing its previous round
        with the others, we are expected at this epoch's round (their group waits for us: ``rounds.patience_for``),
        so we join it rather than wait it out (chaos cpu-starve beside 2 hogs: the 20%-CPU peer looked 5 s after
        its commit, saw the others' round under way, waited, and downloaded the next state: the epoch was lost).
        """
        if self.waited_epoch == my_epoch:
            return False
        records, now = self.view.records, get_dht_time()
        epoch = round_to_wait_for(self.peer_id, my_epoch, records, now, self.record_ttl_s, self.min_group_size)
        if epoch is None or (epoch == my_epoch and committed_epoch == my_epoch):
            return False
        self.waited_epoch = my_epoch
        logger.info("epoch %d's round is under way without us: waiting for it, then training for the next", epoch)
        self.emit("round_wait", round_epoch=epoch)
        self.phases.wait_for(epoch + 1)
        self.view.request_publish()
        until, failures = time.monotonic() + self.round_timeout_s, failed_rounds(records)
        while not self.stop.wait(0.5) and time.monotonic() < until:
            records = self.view.refresh()
            if not self.under_way(epoch, records) or round_failed_since(failures, epoch, records):
                break  # over, or its attempt failed: its members match again for the epoch, with us if we train
            self.check_dht()
        return True
