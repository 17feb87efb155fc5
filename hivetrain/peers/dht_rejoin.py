"""Keep a DHT node joined to the swarm after its neighbours forgot it: the rejoin watchdog.

hivemind's Kademlia routing table (Maymounkov & Mazieres 2002, section 2.2) drops a neighbour at its first request
that goes unanswered within ``wait_timeout`` (3 s), and only learns neighbours from requests. A laptop lid or a
SIGSTOP of 15 s breaks both sides at once: the others drop the sleeper at their first request to it, and when it
wakes, every request it had in flight has outlived its timeout, so it drops them all. Nobody is left who would ever
ask anyone: the sleeper's reads return only what its own storage holds (its own fresh record and the others' stale
ones), and it believes it is alone. Seen in CI, 2026-11-30 (chaos ``pause-twice``): 40 s after peer2 woke from a
15 s SIGSTOP, a fresh read showed it no live trainer while two trained on at epochs 10-19, and it committed 17 solo
outer steps (a fork). ``tests/peers/test_dht_rejoin.py`` shows the mechanism: a node cut off this way is still cut
off 5 s later without the watchdog, and back within a few intervals with it.

hivemind's own bucket refresh (``refresh_timeout``) starts its lookups from the routing table, so an empty table
stays empty. ``RejoinWatch`` runs in the DHT process, as libp2p's Kademlia does its bootstrap refresh: every
``interval_s`` it pings each initial peer missing from the table, and, while the table holds fewer than
``min_neighbours`` nodes, the neighbours it knew in the last ``remember_s`` that are missing. A ping that is answered
puts the peer back into our table and, as a ping carries our node info, us into its table; the next lookup finds
the rest of the swarm through it. Bounded: at most ``max_pings`` concurrent pings per period, each within the
protocol's ``wait_timeout``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

logger = logging.getLogger(__name__)

REJOIN_INTERVAL_S = 5.0
"""How often the watchdog looks at the routing table, seconds (one trainer record heartbeat)."""


class RejoinWatch:
    """The rejoin watchdog of one DHT node (module docstring). Lives in the DHT process (``start_rejoin_watch``).

    Args:
        initial_peers: the peer IDs (base58) the node bootstrapped from: always pinged while missing.
        interval_s: seconds between looks.
        min_neighbours: below this many nodes in the table, remembered neighbours are pinged too.
        remember_s: a neighbour last seen in the table this long ago (seconds) is forgotten (it left for good).
        max_pings: the most pings one look sends.
        clock: monotonic seconds (tests inject one).
    """

    def __init__(
        self,
        initial_peers: Iterable[str],
        *,
        interval_s: float = REJOIN_INTERVAL_S,
        min_neighbours: int = 3,
        remember_s: float = 600.0,
        max_pings: int = 8,
        clock=time.monotonic,
    ):
        self.initial_peers = tuple(dict.fromkeys(initial_peers))
        self.interval_s, self.min_neighbours, self.remember_s = interval_s, min_neighbours, remember_s
        self.max_pings, self.clock = max_pings, clock
        self.last_seen: dict[str, float] = {}  # peer ID (base58) -> when we last saw it in the table
        self.rejoined = 0  # pings answered by a peer that was missing from our table

    def to_ping(self, in_table: Iterable[str], me: str) -> list[str]:
        """The peers (base58 IDs) to ping now, given the peer IDs in our routing table (pure but for the clock and
        ``last_seen``, which it updates): missing initial peers first, then, if the table is small, the most recently
        seen missing neighbours; at most ``max_pings``."""
        now, present = self.clock(), set(in_table)
        for peer in present:
            self.last_seen[peer] = now
        for peer, seen in list(self.last_seen.items()):
            if now - seen > self.remember_s:
                del self.last_seen[peer]
        wanted = [p for p in self.initial_peers if p not in present and p != me]
        if len(present) < self.min_neighbours:
            recent = sorted((p for p in self.last_seen if p not in present), key=lambda p: -self.last_seen[p])
            wanted += [p for p in recent if p not in wanted and p != me]
        return wanted[: self.max_pings]

    async def run(self, node) -> None:
        """Look every ``interval_s`` until the node stops (``node.is_alive`` false); never raises."""
        from hivemind.p2p import PeerID

        me = node.peer_id.to_base58()
        while node.is_alive:
            try:
                table = node.protocol.routing_table
                peers = self.to_ping((p.to_base58() for p in list(table.peer_id_to_uid)), me)
                if peers:
                    answers = await asyncio.gather(
                        *(node.protocol.call_ping(PeerID.from_base58(p), validate=False, strict=False) for p in peers),
                        return_exceptions=True,
                    )
                    answered = [a is not None and not isinstance(a, BaseException) for a in answers]
                    back = [p for p, ok in zip(peers, answered, strict=True) if ok]
                    if back:
                        self.rejoined += len(back)
                        logger.warning(
                            "DHT: %d neighbour(s) were missing from our routing table and answered a ping: rejoined "
                            "(%s)", len(back), ", ".join(p[:12] for p in back),
                        )  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - a watchdog must outlive any one failed look
                logger.debug("DHT rejoin watch: %r", exc)
            await asyncio.sleep(self.interval_s)


async def start_rejoin_watch(_dht, node, initial_peers: tuple[str, ...], interval_s: float) -> None:
    """Runs in the DHT process (``hivemind.DHT.run_coroutine``): start the watchdog as a task of the node's loop and
    return at once. The task is kept on the node (``node.hivetrain_rejoin``) so it is not collected."""
    watch = RejoinWatch(initial_peers, interval_s=interval_s)
    node.hivetrain_rejoin = (watch, asyncio.create_task(watch.run(node)))


async def routing_table_peers(_dht, node) -> list[str]:
    """Runs in the DHT process: the peer IDs (base58) in the node's routing table now."""
    return [p.to_base58() for p in list(node.protocol.routing_table.peer_id_to_uid)]
