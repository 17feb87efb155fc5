"""A peer whose epoch's round is under way without it waits for that round instead of computing a phase the round
cannot take (``round_wait.RoundWait``, through ``DilocoTrainer._wait_out_round``; issue 23: joiners arriving during a
round dropped their first phase)."""

import threading
from types import SimpleNamespace

from hivemind.utils import get_dht_time

from hivetrain.diloco.round_wait import RoundWait
from hivetrain.diloco.trainer import DilocoTrainer
from tests.records import peer_record


def _rec(peer: str, epoch: int, done_epoch: int) -> object:
    r = peer_record(peer, epoch, get_dht_time(), phase_epoch=epoch)
    return r.model_copy(update={"done_epoch": done_epoch, "done_samples": 80 if done_epoch == epoch else 0})


def _trainer(records: list, later: list, *, overlap: str = "off", pending=None) -> SimpleNamespace:
    """A trainer at epoch 3 whose view shows ``records`` first, then ``later`` from the second refresh on, with a real
    ``RoundWait`` (``t.round_wait``; its ``round_timeout_s`` is 20 s)."""
    reads = iter([records] + [later] * 1000)
    t = SimpleNamespace(
        state=SimpleNamespace(epoch=3),
        _overlap=overlap,
        _pending=pending,
        _committed_epoch=-1,  # epoch 3 was reached by a download (or a join), not by committing epoch 2's round
        background=SimpleNamespace(in_flight=False),
        events=[],
        waiting_for=[],
        checks=[],
    )
    t.view = SimpleNamespace(records=records, refresh=lambda: next(reads), request_publish=lambda: None)
    t.round_wait = RoundWait(
        "me",
        t.view,
        SimpleNamespace(wait_for=t.waiting_for.append),
        record_ttl_s=30.0,
        round_timeout_s=20.0,
        min_group_size=1,
        stop=threading.Event(),
        emit=lambda event, **fields: t.events.append(event),
        check_dht=lambda: t.checks.append(1),
    )
    return t


def test_a_peer_waits_while_its_epochs_round_is_under_way_then_once_it_is_over_goes_on():
    under_way = [_rec("a", 3, 3), _rec("b", 3, 3)]
    committed = [_rec("a", 4, 3), _rec("b", 4, 3)]  # the round committed: they hold epoch 4
    t = _trainer(under_way, committed)
    assert DilocoTrainer._wait_out_round(t) is True
    assert t.events == ["round_wait"] and t.waiting_for == [4]  # it shows epoch 4's phase, computing nothing yet
    # once per epoch: back at epoch 3 (the download has not happened yet), it trains rather than wait again
    t.view.records = under_way
    assert DilocoTrainer._wait_out_round(t) is False and t.events == ["round_wait"]


def test_a_peer_behind_waits_for_the_round_of_the_newest_epoch_before_downloading_it():
    # a joiner still at epoch 0: the swarm's epoch 3 round is under way, so its state is about to be replaced
    under_way = [_rec("a", 3, 3), _rec("b", 3, 3)]
    t = _trainer(under_way, [_rec("a", 4, 3), _rec("b", 4, 3)])
    t.state.epoch = 0
    assert DilocoTrainer._wait_out_round(t) is True and t.waiting_for == [4]
    # while they still compute for epoch 3 it downloads at once
    computing = [_rec("a", 3, 2), _rec("b", 3, 2)]
    t = _trainer(computing, computing)
    t.state.epoch = 0
    assert DilocoTrainer._wait_out_round(t) is False


def test_the_wait_is_bounded_by_the_round_timeout():
    under_way = [_rec("a", 3, 3), _rec("b", 3, 3)]
    t = _trainer(under_way, under_way)
    t.round_wait.round_timeout_s = 1.2
    DilocoTrainer._wait_out_round(t)
    assert 1 <= len(t.checks) <= 3  # ~2 looks at 0.5 s intervals, then it stops waiting


def test_the_wait_ends_when_a_member_of_the_round_publishes_a_failed_attempt():
    """Chaos nan-peer: two peers that started 1 s after the others waited 32 s for a round that failed 2 s in (its
    members then matched again for the same epoch, which the waiters could have trained for and joined)."""
    under_way = [_rec("a", 3, 3), _rec("b", 3, 3)]
    failed = [under_way[0].model_copy(update={"rounds_failed": 1}), under_way[1]]
    t = _trainer(under_way, failed)
    t.round_wait.round_timeout_s = 10.0
    assert DilocoTrainer._wait_out_round(t) is True
    assert len(t.checks) == 1  # left at its second look (the first shows no failure), not after ~20 at the 10 s bound
    # a failure that was there before the wait began is no news
    t = _trainer(failed, failed)
    t.round_wait.round_timeout_s = 1.2
    DilocoTrainer._wait_out_round(t)
    assert len(t.checks) >= 1


def test_a_peer_that_committed_into_the_epoch_joins_its_round_rather_than_wait_it_out():
    """Its round's members expect it (they committed the last round together, and their group waits one step of its
    for it); waiting it out cost a starved peer the epoch (chaos cpu-starve beside 2 hogs)."""
    under_way = [_rec("a", 3, 3), _rec("b", 3, 3)]
    t = _trainer(under_way, under_way)
    t._committed_epoch = 3
    assert DilocoTrainer._wait_out_round(t) is False and t.events == []
    t.state.epoch, t._committed_epoch = 2, 2  # behind the swarm's epoch 3: that round is not ours to join
    t.round_wait.round_timeout_s = 0.6  # (the round stays under way in this view: the wait ends at its bound)
    assert DilocoTrainer._wait_out_round(t) is True and t.waiting_for == [4]


def test_no_wait_while_others_compute_for_our_epoch_with_overlap_or_with_a_contribution_pending():
    computing = [_rec("a", 3, 2), _rec("b", 3, 2)]  # they committed epoch 2 and compute for 3
    assert DilocoTrainer._wait_out_round(_trainer(computing, computing)) is False
    alone = [_rec("a", 3, 3)]  # a run of two: the other ended its phase and waits for us in matchmaking
    assert DilocoTrainer._wait_out_round(_trainer(alone, alone)) is False
    under_way = [_rec("a", 3, 3), _rec("b", 3, 3)]
    # with overlap our phase is for epoch 4 already (``_phase_epoch``); with a pending contribution for epoch 3, the
    # round policy decides (retry, carry or resync) and the phase adds to it
    assert DilocoTrainer._wait_out_round(_trainer(under_way, under_way, overlap="eager")) is False
    assert DilocoTrainer._wait_out_round(_trainer(under_way, under_way, pending=object())) is False
