"""The stranger pool's decisions, offline with made-up times: per-source and total caps evict the oldest, the byte
budget evicts the largest, the handshake deadline counts from accept whatever arrives, and sources group by IPv4
address, IPv6 /64 and libp2p."""

from __future__ import annotations

import pytest

from hivetrain.averaging.admission import DataPlaneLimits, StrangerPool, source_key


def _pool(**limits) -> StrangerPool:
    return StrangerPool(DataPlaneLimits(**limits), handshake_timeout_s=5.0)


def test_a_full_source_evicts_its_own_oldest_and_leaves_other_sources_alone() -> None:
    pool = _pool(max_strangers=10, max_strangers_per_source=3)
    pool.admit(100, "10.0.0.9", now=0.0)  # an honest peer from another address
    for i in range(3):
        assert pool.admit(i, "10.0.0.1", now=1.0 + i).evict == ()
    verdict = pool.admit(3, "10.0.0.1", now=5.0)
    assert verdict.evict == (0,) and "10.0.0.1" in verdict.reason
    assert pool.count("10.0.0.1") == 3 and 100 in pool and 0 not in pool


def test_a_full_pool_evicts_the_oldest_of_the_busiest_source() -> None:
    pool = _pool(max_strangers=4, max_strangers_per_source=3)
    pool.admit(1, "honest", now=0.0)  # the oldest overall, but its source holds one
    for i, t in ((2, 1.0), (3, 2.0), (4, 3.0)):
        pool.admit(i, "flood", now=t)
    assert pool.admit(5, "another", now=4.0).evict == (2,)
    assert 1 in pool and len(pool) == 4


def test_past_the_byte_budget_the_stranger_holding_most_is_dropped() -> None:
    pool = _pool(max_buffered_bytes=1000)
    pool.admit(1, "a", now=0.0)
    pool.admit(2, "a", now=0.0)
    assert pool.grow(1, 100).evict == ()
    verdict = pool.grow(2, 950)  # 1050 > 1000: the 950-byte one goes
    assert verdict.evict == (2,) and pool.buffered_num_bytes == 100 and 2 not in pool


def test_the_handshake_deadline_counts_from_accept_and_bytes_do_not_extend_it() -> None:
    pool = _pool()
    pool.admit(1, "a", now=10.0)
    pool.admit(2, "a", now=12.0)
    for t in (11.0, 12.0, 13.0, 14.0):  # connection 1 drips a byte every second
        pool.grow(1, 1)
        assert pool.expired(now=t).evict == ()
    assert pool.next_deadline() == 15.0
    assert pool.expired(now=15.0).evict == (1,)
    assert pool.expired(now=16.9).evict == () and pool.expired(now=17.0).evict == (2,)
    assert len(pool) == 0 and pool.buffered_num_bytes == 0 and pool.next_deadline() is None


def test_removed_connections_free_their_slot_and_bytes() -> None:
    pool = _pool(max_strangers=2, max_strangers_per_source=2)
    pool.admit(1, "a", now=0.0)
    pool.grow(1, 500)
    pool.remove(1)
    pool.remove(1)  # idempotent
    assert pool.buffered_num_bytes == 0 and pool.count("a") == 0
    assert pool.admit(2, "a", now=1.0).evict == () and pool.admit(3, "a", now=1.0).evict == ()


def test_sources_group_by_ipv4_address_ipv6_64_and_libp2p() -> None:
    assert source_key(("192.0.2.7", 5000)) == "192.0.2.7"
    assert source_key(("2001:db8:1:2:aaaa::1", 5000, 0, 0)) == source_key(("2001:db8:1:2:ffff::9", 1, 0, 0))
    assert source_key(("2001:db8:1:3::1", 1, 0, 0)) != source_key(("2001:db8:1:2::1", 1, 0, 0))
    assert source_key(("::ffff:192.0.2.7", 1, 0, 0)) == "192.0.2.7"
    assert source_key("") == "libp2p" and source_key(None) == "libp2p"


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError):
        DataPlaneLimits(max_strangers=4, max_strangers_per_source=5)
    with pytest.raises(ValueError):
        DataPlaneLimits(handshake_timeout_s=-1.0)
    with pytest.raises(ValueError):
        DataPlaneLimits(max_buffered_bytes=0)
    with pytest.raises(ValueError):
        StrangerPool(DataPlaneLimits(), handshake_timeout_s=0.0)
