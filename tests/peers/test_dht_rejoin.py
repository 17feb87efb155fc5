"""The rejoin watchdog (``peers/dht_rejoin.py``): a node whose neighbours all forgot it, and which forgot them (a
SIGSTOP: every request in flight outlives its timeout), finds the swarm again; without the watchdog it stays cut off
and reads only its own storage."""

from __future__ import annotations

import time
from functools import partial

import pytest
from hivemind.utils import get_dht_time

from hivetrain.peers.dht_rejoin import RejoinWatch
from hivetrain.peers.node import NodeConfig, start_node

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


def test_it_pings_missing_initial_peers_always_and_remembered_neighbours_only_when_the_table_is_small():
    clock = [0.0]
    watch = RejoinWatch(["boot"], min_neighbours=2, remember_s=60.0, max_pings=3, clock=lambda: clock[0])
    assert watch.to_ping(["boot", "a", "b"], me="me") == []  # all there
    clock[0] = 10.0
    assert watch.to_ping(["a", "b"], me="me") == ["boot"]  # an initial peer is pinged back even in a full table
    clock[0] = 20.0
    assert watch.to_ping(["a"], me="me") == ["boot", "b"]  # one neighbour left: the remembered one too
    clock[0] = 30.0
    watch.last_seen["c"] = 25.0
    assert watch.to_ping([], me="me") == ["boot", "c", "a"]  # most recently seen first, at most max_pings
    clock[0] = 200.0
    assert watch.to_ping([], me="me") == ["boot"]  # neighbours gone for longer than remember_s are forgotten
    assert RejoinWatch(["me"]).to_ping([], me="me") == []  # never ourselves


async def _forget(_dht, node, peers: tuple[str, ...] | None) -> list[str]:
    """Runs in the DHT process: drop ``peers`` (all if None) from the routing table, as unanswered requests do; returns
    the peers left in it, read in the same step (no await between: the node's own watchdog cannot refill it first)."""
    table = node.protocol.routing_table
    for peer_id, node_id in list(table.peer_id_to_uid.items()):
        if peers is None or peer_id.to_base58() in peers:
            del table[node_id]
    return [peer_id.to_base58() for peer_id in table.peer_id_to_uid]


def _fresh_value_seen(reader, key: str, subkey: str, since: float) -> bool:
    found = reader.dht.get(key, latest=True)
    if found is None or subkey not in found.value:
        return False
    return found.value[subkey].value >= since


def _cut_off_and_store(nodes):
    """Cut the last node off (it forgets everyone, everyone forgets it), then have the second store a new value.
    The sleeper's table is read in the same step as its forgetting: with its own watchdog every 0.5 s, a check made
    after the others' forgetting found it already rejoined on a loaded machine (2026-12-01, beside 2 CPU hogs)."""
    boot, writer, sleeper = nodes
    assert sleeper.dht.run_coroutine(_forget_call(None), return_future=True).result(timeout=10) == []
    for node in (boot, writer):
        node.dht.run_coroutine(_forget_call((sleeper.peer_id,)), return_future=True).result(timeout=10)
    stamp = get_dht_time()
    assert writer.dht.store("rejoin", subkey="writer", value=stamp, expiration_time=stamp + 60)
    return stamp


def _forget_call(peers):
    return partial(_forget, peers=peers)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("sleeper_interval_s", "others_interval_s", "rejoins"),
    [(0.5, 3600.0, True), (3600.0, 0.5, True), (3600.0, 3600.0, False)],
    ids=["its-own-watchdog", "the-others-watchdogs", "no-watchdog"],
)
def test_a_node_cut_off_from_every_neighbour_rejoins_within_a_few_intervals(
    sleeper_interval_s, others_interval_s, rejoins
):
    """The sleeper pings its initial peer back; the awake nodes ping back the neighbour they remember (each side
    alone is enough); with neither (an interval of an hour), it stays cut off."""
    nodes = []
    try:
        others = dict(host_maddrs=LOOPBACK, startup_timeout_s=30, rejoin_interval_s=others_interval_s)
        nodes.append(start_node(NodeConfig(**others)))
        initial = tuple(a for a in nodes[0].visible_maddrs() if "127.0.0.1" in a)
        nodes.append(start_node(NodeConfig(**others, initial_peers=initial)))
        sleeper = dict(host_maddrs=LOOPBACK, startup_timeout_s=30, rejoin_interval_s=sleeper_interval_s)
        nodes.append(start_node(NodeConfig(**sleeper, initial_peers=initial)))
        assert not nodes[2].cut_off()
        time.sleep(1.5)  # the awake nodes' watchdogs look every 0.5 s: one look must find the sleeper, to remember it
        stamp = _cut_off_and_store(nodes)
        deadline = time.monotonic() + (15.0 if rejoins else 5.0)
        seen = False
        while time.monotonic() < deadline and not seen:
            seen = _fresh_value_seen(nodes[2], "rejoin", "writer", stamp)
            time.sleep(0.25)
        assert seen == rejoins and nodes[2].cut_off() != rejoins
    finally:
        for node in nodes:
            node.shutdown()
