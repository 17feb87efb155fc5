"""SwarmView: the record heartbeat runs off the train loop, and asking for a publish never blocks the caller."""

import time

from hivemind.utils import get_dht_time

from hivetrain.diloco.swarm_view import SwarmView
from tests.records import peer_record


class SlowDht:
    """A DHT whose stores take ``store_s`` (a stalled replica) and whose reads find nothing."""

    def __init__(self, store_s: float):
        self.store_s, self.stores = store_s, []

    def store(self, key, value, expiration, subkey=None):
        time.sleep(self.store_s)
        self.stores.append(value)
        return True

    def get(self, key, latest=True):
        return None


class Node:
    def __init__(self, dht):
        self.dht, self.peer_id, self.owner_marker = dht, "me", b"me"

    def cut_off(self):
        return False


def record():
    return peer_record("me", 0, get_dht_time(), throughput=0.0)


def _view(**kwargs) -> SwarmView:
    """A view of run "r" over a DHT that stores at once, every 5 s, records living 30 s."""
    return SwarmView(Node(SlowDht(0.0)), None, "r", "f", record, record_ttl_s=30.0, record_interval_s=5.0, **kwargs)


def test_request_publish_returns_at_once_and_the_heartbeat_publishes_soon():
    dht = SlowDht(store_s=0.5)
    view = SwarmView(Node(dht), None, "r", "f", record, record_ttl_s=30.0, record_interval_s=60.0)
    view._thread.start()  # the heartbeat alone (start() would also publish and read once, synchronously)
    try:
        started = time.monotonic()
        view.request_publish()
        assert time.monotonic() - started < 0.05  # the caller (the train loop) never waits for the DHT
        deadline = time.monotonic() + 5.0
        while not dht.stores and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(dht.stores) == 1  # published long before the 60 s period
    finally:
        view.stop(timeout_s=5.0)
    assert not view._thread.is_alive()


def test_a_view_without_our_own_record_is_not_real_and_ages():
    clock = [100.0]
    view = _view(clock=lambda: clock[0])
    clock[0] = 130.0
    assert view.refresh() == [] and not view.view_ok
    assert view.view_age_s == 30.0  # the lost-DHT timer runs on: an empty answer is not an empty swarm


def test_the_heartbeat_period_follows_the_hint_within_bounds():
    view = _view(next_interval_s=lambda: 0.01)
    assert view._interval_s() == 0.5
    view.next_interval_s = lambda: float("inf")
    assert view._interval_s() == 5.0
    view.next_interval_s = lambda: 1 / 0
    assert view._interval_s() == 5.0


def test_banned_peers_leave_the_view_for_every_reader_and_come_back_when_the_ban_ends(monkeypatch):
    now = get_dht_time()
    found = [record(), peer_record("honest", 6, now), peer_record("liar1", 7, now), peer_record("liar2", 7, now)]
    monkeypatch.setattr(
        "hivetrain.diloco.swarm_view.fetch_records_at", lambda dht, keys, run_id, timeout: {k: found for k in keys}
    )
    banned = {"liar1", "liar2"}
    view = _view(ignored=lambda: frozenset(banned))
    assert sorted(r.peer_id for r in view.refresh()) == ["honest", "me"] and view.view_ok
    assert sorted(r.peer_id for r in view.records) == ["honest", "me"]  # the schedule's and the rounds' reads
    banned.clear()  # a ban that ran out (the averager's are timed)
    assert sorted(r.peer_id for r in view.records) == ["honest", "liar1", "liar2", "me"]
