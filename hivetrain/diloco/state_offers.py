"""A state download's first phase: ask every donor which published states it serves (``{"op": "meta"}``) and collect
their manifests, bounded in time (``collect_offers``). The wire format is ``state_wire``'s; the chunks follow in
``state_fetch``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from hivemind.p2p import P2P, PeerID

from hivetrain.diloco.state_routing import Offer
from hivetrain.diloco.state_wire import ProtocolError, parse_manifest, parse_recent, recv_control, send_control


@dataclass
class Answer:
    """What one donor offered: ``offers`` (manifests of published states), or ``problem`` (and ``lied``: it claimed the
    published hash with an impossible manifest)."""

    donor: str
    current: dict | None = None  # the meta reply for the donor's current state
    offers: list[Offer] = field(default_factory=list)
    problem: str = ""
    lied: bool = False


async def open_stream(p2p: P2P, protocol: str, donor: str, timeout_s: float):
    """A stream to ``donor``'s state protocol: (reader, writer). Raises whatever dialing raises, or TimeoutError."""
    _, reader, writer = await asyncio.wait_for(
        p2p.call_binary_stream_handler(PeerID.from_base58(donor), protocol), timeout_s
    )
    return reader, writer


async def ask_donor(p2p: P2P, protocol: str, donor: str, known: dict[int, str], num_bytes: int, timeout_s: float):
    """One donor's offers: its current state's manifest if published, else a retained older one that is."""
    answer = Answer(donor)
    try:
        reader, writer = await open_stream(p2p, protocol, donor, timeout_s)
    except Exception as exc:  # noqa: BLE001 - any failure just disqualifies this donor
        answer.problem = f"unreachable: {exc!r}"
        return answer
    try:
        await send_control(writer, {"op": "meta"})
        reply = await recv_control(reader, timeout_s)
        if "error" in reply:
            answer.problem = f"says {str(reply['error'])[:100]}"
            return answer
        answer.current = reply
        if known.get(reply.get("epoch")) == reply.get("state_hash"):
            answer.offers.append(Offer(donor, parse_manifest(reply, num_bytes)))
            return answer
        for epoch, state_hash in sorted(parse_recent(reply), reverse=True):
            if known.get(epoch) == state_hash:
                await send_control(writer, {"op": "meta", "epoch": epoch, "state_hash": state_hash})
                older = await recv_control(reader, timeout_s)
                if "error" not in older and (older.get("epoch"), older.get("state_hash")) == (epoch, state_hash):
                    answer.offers.append(Offer(donor, parse_manifest(older, num_bytes)))
                break
    except ProtocolError as exc:  # claimed the published hash with an impossible manifest
        answer.problem, answer.lied = str(exc), True
    except Exception as exc:  # noqa: BLE001
        answer.problem = f"no manifest: {exc!r}"
    finally:
        writer.close()
    return answer


async def collect_offers(
    p2p: P2P, protocol: str, donors: Sequence[str], known: dict, num_bytes: int, timeout_s: float, grace_s: float
) -> list[Answer]:
    """Every donor's answer, waiting for all of them, at most ``timeout_s``, and once the first donor has answered
    (any meta reply), at most ``max(grace_s, the time that first answer took)`` more: honest donors answer at about
    the same time (they hash the same state), so the others get as long again as the first one needed (at least
    ``grace_s``) and a donor that drips its reply cannot hold the download up for a whole ``timeout_s``. Donors that
    had not answered by then get a ``problem``."""
    tasks = {asyncio.ensure_future(ask_donor(p2p, protocol, d, known, num_bytes, timeout_s)): d for d in donors}
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline, graced = started + timeout_s, False
    waiting = set(tasks)
    while waiting:
        remaining_s = max(deadline - loop.time(), 0.0)
        done, waiting = await asyncio.wait(waiting, timeout=remaining_s, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            break
        if not graced and any(t.result().current is not None for t in done):
            now = loop.time()
            deadline, graced = min(deadline, now + max(grace_s, now - started)), True
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    late = f"no manifest within the grace after the first donor's (or {timeout_s:.1f} s)"
    return [t.result() if t.done() and not t.cancelled() else Answer(d, problem=late) for t, d in tasks.items()]
