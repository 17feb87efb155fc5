"""A peer that finished the run's last epoch stays (serving its state) while someone may still need it: a live trainer
behind it, or the run's coordinator, which downloads and checkpoints the final state (issue 26)."""

import threading
import time
from types import SimpleNamespace

from hivemind.utils import get_dht_time

from hivetrain.diloco.resync import Resync
from hivetrain.diloco.sync_policy import SyncTrust
from tests.records import peer_record


class View:
    """The records a lingering peer reads: the run's coordinator moves to ``then`` epoch from the ``at``-th read on."""

    def __init__(self, coordinator: str, epoch: int, then: int, at: int, role: str = "coordinator", age: float = 0.0):
        self.coordinator, self.epoch, self.then, self.at, self.role, self.age = coordinator, epoch, then, at, role, age
        self.reads = 0

    def refresh(self):
        self.reads += 1
        epoch = self.then if self.reads >= self.at else self.epoch
        return [peer_record(self.coordinator, epoch, get_dht_time() - self.age, role=self.role)]


def linger(view: View, coordinator_id: str = "coord", wait_s: float = 20.0, exact_average: bool = True) -> float:
    evidence = SimpleNamespace(trust=SyncTrust(coordinator_id=coordinator_id))
    resync = Resync("me", view, evidence, None, exact_average=exact_average, stale_after_s=30.0, record_interval_s=1.0,
                    stop=threading.Event(), emit=lambda *a, **k: None)  # fmt: skip
    started = time.monotonic()
    resync.linger(3, frozenset, wait_s)
    return time.monotonic() - started


def test_a_finished_peer_waits_until_the_runs_coordinator_holds_the_last_epoch():
    view = View("coord", 2, then=3, at=3)
    linger(view)
    assert view.reads == 3  # it left at the first read that showed the coordinator at epoch 3


def test_only_the_runs_live_coordinator_is_waited_for_and_never_past_the_bound():
    for view, coordinator_id in [
        (View("other", 2, then=2, at=1), "coord"),  # a record claiming the role, not the run's coordinator
        (View("coord", 2, then=2, at=1, age=40.0), "coord"),  # the coordinator's record went stale: it is gone
        (View("coord", 2, then=2, at=1), ""),  # no coordinator known (no run config signer)
    ]:
        linger(view, coordinator_id)
        assert view.reads == 1
    assert linger(View("coord", 2, then=2, at=1), wait_s=2.5) < 4.0  # it never gets there: bounded


def test_a_moshpit_or_gossip_peer_does_not_wait_for_a_coordinator_that_follows_no_state():
    """Their peers hold different states by design, so the coordinator never holds the last epoch: every such run
    waited out the whole bound at its end (60 s in the moshpit e2e run)."""
    view = View("coord", 0, then=0, at=1)
    linger(view, exact_average=False, wait_s=20.0)
    assert view.reads == 1  # it left at its first read: waiting would have read once a second for 20 s
