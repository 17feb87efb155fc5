"""The run's start (anchor of the run-age bound): the earliest plausible value, never later, saved atomically."""

import math

import pytest

from hivetrain.coordinator.run_clock import earliest_start, load_start, save_start, start_for_epoch

NOW = 10_000.0


def test_the_earliest_plausible_candidate_wins_and_implausible_ones_are_ignored():
    assert earliest_start([NOW - 500, NOW - 100, None], NOW, 60.0) == NOW - 500
    assert earliest_start([NOW + 30], NOW, 60.0) == NOW  # within the skew allowance: now is still earlier
    assert earliest_start([NOW + 3600, math.nan, math.inf, -5.0, 0.0], NOW, 60.0) == NOW
    assert earliest_start([], NOW, 60.0) == NOW


def test_a_followed_epoch_past_the_bound_moves_the_start_earlier_never_later():
    assert start_for_epoch(NOW - 100, 5000, NOW, 0.1) == NOW - 500
    assert start_for_epoch(NOW - 100, 10, NOW, 0.1) == NOW - 100


def test_saved_start_round_trips_per_run_and_a_damaged_file_loses_nothing(tmp_path):
    path = tmp_path / "run_clock.json"
    assert load_start(path, "r") is None
    save_start(path, "r", NOW - 42)
    assert load_start(path, "r") == NOW - 42
    assert load_start(path, "another-run") is None
    assert not list(tmp_path.glob("*.tmp"))
    path.write_text('{"run_id": "r", "run_started_at": ')
    assert load_start(path, "r") is None
    path.write_text('{"run_id": "r", "run_started_at": "yesterday"}')
    assert load_start(path, "r") is None
    save_start(tmp_path / "missing-dir" / "run_clock.json", "r", NOW)  # logged, not raised


@pytest.mark.slow
def test_coordinator_publishes_the_start_and_a_restart_never_moves_it_later(make_node, tmp_path):
    import time

    from hivemind.utils import get_dht_time

    from hivetrain.cli.join_swarm import run_authority
    from hivetrain.config import RunConfig
    from hivetrain.coordinator.coordinator import Coordinator, CoordinatorOptions
    from hivetrain.peers.records import RunConfigRecord, fetch_run_config, publish_run_config

    coord = make_node()
    joiner = make_node(coord.visible_maddrs())
    clock = tmp_path / "run_clock.json"
    config = RunConfig(run_id="clock")
    before = get_dht_time()
    first = Coordinator(coord, config, "fp", CoordinatorOptions(run_clock_path=clock))
    first.publish()
    assert before <= first.run_started_at <= get_dht_time()
    assert load_start(clock, "clock") == first.run_started_at
    assert run_authority(joiner, coord.visible_maddrs()) == (coord.peer_id, first.run_started_at)

    # a restart that lost its file still finds its own earlier record in the DHT
    time.sleep(0.05)
    clock.unlink()
    second = Coordinator(coord, config, "fp", CoordinatorOptions(run_clock_path=clock))
    second.publish()
    assert second.run_started_at == first.run_started_at
    # one whose file remembers an earlier start takes that
    save_start(clock, "clock", first.run_started_at - 500)
    third = Coordinator(coord, config, "fp", CoordinatorOptions(run_clock_path=clock))
    third.publish()
    assert fetch_run_config(joiner.dht, {coord.peer_id}).run_started_at == first.run_started_at - 500

    # a start in the joiner's future (a skewed or hostile clock) gives no bound rather than a wrong one
    record = RunConfigRecord(
        run_config=config.to_dict(), version="0", coordinator_id=coord.peer_id, published_at=get_dht_time() + 1,
        run_started_at=get_dht_time() + 3600,
    )  # fmt: skip
    publish_run_config(coord.dht, coord.owner_marker, record, 7200)  # outlives the copies above
    assert run_authority(joiner, coord.visible_maddrs()) == (coord.peer_id, None)
