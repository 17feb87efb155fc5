"""State download that routes around bad donors: a late or lagging peer fetches θ, outer momentum and epoch.

1. Offers (``state_offers``). Every donor is asked for its manifest (``state_wire.Manifest``). A donor whose current
   state is not the one peers published for its epoch may still serve an older published one (donors keep their last
   few epochs): the joiner then asks for that one. The first manifest starts a short grace
   (``FetchConfig.meta_grace_s``) for the others (or as long again as the first answer took), so a donor that drips
   its reply cannot hold everyone up.
2. Manifests. A manifest is never taken from one donor on trust. The state hash is one sequential sha256 over the
   whole state (``TrainingState.state_hash``), so a list of chunk hashes can only be checked against it with the
   data in hand; what is checked, and when: before use, every bound against our own model (``parse_manifest``: the
   size is ours, chunk size and count follow); while downloading, each chunk against its manifest hash and for
   finite values (a NaN or Inf chunk that matches its manifest proves the manifest false at once); at the end, the
   assembled state against the published hash. Manifests are tried most-offered first (``rank_candidates``); one
   that fails is refuted, every donor that offered it is reported, and the next one is used, keeping every chunk
   whose hash both manifests agree on (a lie about one chunk costs one chunk).
3. Chunks come from every donor of the manifest in parallel, each with its own deadline (``state_routing``): a chunk
   that fails its hash, errors or stalls is re-requested from another donor at once. A donor that served a chunk
   contradicting its own manifest is dropped and reported as bad (``FetchResult.bad_donors``: the caller may ban
   it); a slow, unreachable or no longer serving donor is only dropped for this download.

Memory: one buffer of our model's flat size (allocated from our own model, never from a claim), which becomes the
state's tensors without a copy, plus one chunk per attempt in flight, read as it arrives.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hivemind.p2p import P2P

from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_file import StateFile, StateFileWriter
from hivetrain.diloco.state_offers import collect_offers, open_stream
from hivetrain.diloco.state_reuse import KnownChunks
from hivetrain.diloco.state_routing import (
    Attempt,
    FetchConfig,
    Offer,
    judge_transfer,
    pick_chunk,
    rank_candidates,
)
from hivetrain.diloco.state_wire import (
    Manifest,
    ProtocolError,
    chunk_is_finite,
    layout_num_bytes,
    parse_manifest,
    recv_control,
    send_control,
    unflatten,
)
from hivetrain.faults import NO_FAULTS, FaultInjector, HookPoint

logger = logging.getLogger(__name__)

WHOLE_DOWNLOAD_FLOOR_BYTES_PER_S = 2**20
"""A whole download may average no less than this (1 MiB/s) beyond 4 timeouts: its chunks have their own deadlines."""
PROGRESS_EVERY_S = 5.0  # seconds between a download's progress lines (a GB-sized state takes minutes on home links)
READ_BYTES = 256 * 2**10
Expected = dict[int, str] | Callable[[], dict[int, str]]


def download_bound_s(timeout_s: float, num_bytes: int) -> float:
    """Seconds a caller gives one whole download of ``num_bytes``: 4 network timeouts plus the state at
    ``WHOLE_DOWNLOAD_FLOOR_BYTES_PER_S`` (4 x ``timeout_s`` alone never fetched a 1.2 GB state below 80 Mbit/s)."""
    return 4 * timeout_s + num_bytes / WHOLE_DOWNLOAD_FLOOR_BYTES_PER_S


class StateDownloadFailed(RuntimeError):
    """No donor could provide a state with the expected hash.

    Attributes:
        bad_donors: peer ID -> what it did (served data that contradicts its own claims); the caller may ban them.
    """

    def __init__(self, message: str, bad_donors: dict[str, str] | None = None):
        super().__init__(message)
        self.bad_donors = dict(bad_donors or {})


@dataclass
class FetchResult:
    """A verified state and what each donor did.

    Attributes:
        state: the downloaded state; its hash is the published one.
        bad_donors: peer ID -> reason: served a chunk contradicting its manifest, or offered a refuted manifest.
        dropped_donors: peer ID -> reason: slow, stalled, unreachable or no longer serving (not evidence of malice).
        bytes_from: peer ID -> verified bytes it contributed.
        manifests_refuted: manifests that claimed the published hash and proved false.
    """

    state: TrainingState | StateFile | None = None
    bad_donors: dict[str, str] = field(default_factory=dict)
    dropped_donors: dict[str, str] = field(default_factory=dict)
    bytes_from: dict[str, int] = field(default_factory=dict)
    manifests_refuted: int = 0

    def bad(self, donor: str, reason: str) -> None:
        if donor not in self.bad_donors:
            logger.warning("state donor %s misbehaved: %s", donor[:12], reason)
            self.bad_donors[donor] = reason

    def drop(self, donor: str, reason: str) -> None:
        if donor not in self.bad_donors and donor not in self.dropped_donors:
            logger.info("state donor %s dropped: %s", donor[:12], reason)
            self.dropped_donors[donor] = reason


class _GroupDownload:
    """Chunks of one manifest from its donors in parallel into ``buffer``; ``have`` maps chunk index -> sha256 of
    the verified bytes at that index (kept across manifests)."""

    def __init__(self, p2p, protocol, candidate, donors, buffer, have, result, timeout_s, config, faults, clock):
        self.p2p, self.protocol, self.manifest = p2p, protocol, candidate.manifest
        self.donors, self.buffer, self.have, self.result = donors, buffer, have, result
        self.timeout_s, self.config, self.faults, self.clock = timeout_s, config, faults, clock
        hashes = self.manifest.chunk_hashes
        self.pending = deque(i for i in range(len(hashes)) if have.get(i) != hashes[i])
        self.done = {i for i in range(len(hashes)) if have.get(i) == hashes[i]}
        self.known_filled = 0  # bytes of chunks we held, written here (``fill_known_chunks``, before ``run``)
        self.in_flight: dict[int, list[Attempt]] = {}
        self.rates: dict[str, float] = {}
        self.refuted = ""
        self.changed = asyncio.Event()
        self.finished = asyncio.Event()
        self.live = 0
        self.started_s = self.last_report_s = clock()
        self.bytes_at_start = sum(self.manifest.chunk_range(i)[1] - self.manifest.chunk_range(i)[0] for i in self.done)

    def fill_known_chunks(self, known: KnownChunks) -> int:
        """Write the chunks we hold already (``state_reuse``: all zeros, or the same bytes in our own state) without
        asking anyone; returns their bytes. The hash pins the content, and the state hash is checked at the end. Call
        it off the event loop, before ``run``: for a 7B model it hashes and writes GBs."""
        filled = 0
        for index in list(self.pending):
            start, end = self.manifest.chunk_range(index)
            data = known.get(start, end, self.manifest.chunk_hashes[index])
            if data is not None:
                self.buffer[start:end] = data
                self.have[index] = self.manifest.chunk_hashes[index]
                self.done.add(index)
                self.pending.remove(index)
                filled += end - start
        self.known_filled += filled
        self.bytes_at_start += filled
        return filled

    async def run(self) -> str:
        """ "complete", "refuted" (``self.refuted`` says why) or "exhausted" (every donor dropped)."""
        if len(self.done) == self.manifest.num_chunks:
            return "complete"
        if not self.donors:
            return "exhausted"
        self.live = len(self.donors)
        tasks = [asyncio.ensure_future(self._worker(d)) for d in self.donors]
        try:
            await self.finished.wait()
        finally:
            for task in tasks:
                task.cancel()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        for outcome in outcomes:  # a fault injected at a hook point, or a bug: surface it, never "exhausted"
            if isinstance(outcome, Exception):
                raise outcome
        if self.refuted:
            return "refuted"
        return "complete" if len(self.done) == self.manifest.num_chunks else "exhausted"

    def _requeue(self, index: int) -> None:
        if index not in self.done and not self.in_flight.get(index) and index not in self.pending:
            self.pending.appendleft(index)
            self.changed.set()  # an idle donor takes it at once

    def _rate(self, donor: str) -> float | None:
        if donor in self.rates:
            return self.rates[donor]
        return statistics.median(self.rates.values()) if self.rates else None

    async def _worker(self, donor: str) -> None:
        stream = None
        try:
            while not self.finished.is_set():
                self.changed.clear()
                pick = pick_chunk(donor, self.clock(), self.pending, self.in_flight, self._rate(donor), self.config)
                if pick.index is None:
                    try:
                        await asyncio.wait_for(self.changed.wait(), self.config.poll_s)
                    except asyncio.TimeoutError:
                        pass
                    continue
                index = pick.index
                if index in self.pending:
                    self.pending.remove(index)
                start, end = self.manifest.chunk_range(index)
                now = self.clock()
                attempt = Attempt(donor, index, end - start, started_s=now, last_progress_s=now)
                self.in_flight.setdefault(index, []).append(attempt)
                try:
                    if stream is None:
                        stream = await open_stream(self.p2p, self.protocol, donor, self.timeout_s)
                    outcome, payload = await self._transfer(stream, attempt)
                except ProtocolError as exc:
                    outcome, payload = "bad", f"broke the protocol: {exc}"
                except Exception as exc:  # noqa: BLE001 - a network failure of this donor only
                    outcome, payload = "dropped", f"chunk {index} failed: {exc!r}"
                finally:
                    self.in_flight[index].remove(attempt)
                    if not self.in_flight[index]:
                        del self.in_flight[index]
                    self.changed.set()
                if outcome == "superseded":
                    stream[1].close()
                    stream = None
                    continue
                if outcome == "ok":
                    if not self._accept(donor, attempt, payload):
                        return
                    continue
                self._requeue(index)
                (self.result.bad if outcome == "bad" else self.result.drop)(donor, payload)
                return
        finally:
            if stream is not None:
                stream[1].close()
            self.live -= 1
            if self.live == 0:
                self.finished.set()

    def _accept(self, donor: str, attempt: Attempt, data: bytes) -> bool:
        """Verify and store a chunk. Returns False if this donor must stop (bad chunk, or manifest refuted)."""
        index = attempt.index
        if index in self.done:
            return True
        if hashlib.sha256(data).hexdigest() != self.manifest.chunk_hashes[index]:
            self._requeue(index)
            self.result.bad(donor, f"chunk {index} does not match the manifest it offered")
            return False
        if not chunk_is_finite(data):
            self.refuted = f"chunk {index} matches the manifest but holds NaN/Inf"
            self.finished.set()
            return False
        start, end = self.manifest.chunk_range(index)
        self.buffer[start:end] = data
        self.have[index] = self.manifest.chunk_hashes[index]
        self.done.add(index)
        self.result.bytes_from[donor] = self.result.bytes_from.get(donor, 0) + len(data)
        self.rates[donor] = len(data) / max(self.clock() - attempt.started_s, 1e-6)
        if len(self.done) == self.manifest.num_chunks:
            self.finished.set()
        elif self.clock() - self.last_report_s >= PROGRESS_EVERY_S:
            self._report_progress()
        self.faults.check(HookPoint.STATE_MID_DOWNLOAD, epoch=self.manifest.epoch, index=index)
        return True

    def _report_progress(self) -> None:
        """One log line: share of the state held, bytes, rate since this download began and time left at that rate."""
        now = self.clock()
        self.last_report_s = now
        total = self.manifest.num_bytes
        held = sum(self.manifest.chunk_range(i)[1] - self.manifest.chunk_range(i)[0] for i in self.done)
        rate = (held - self.bytes_at_start) / max(now - self.started_s, 1e-6)
        eta = f"{(total - held) / rate:,.0f} s left" if rate > 0 else "no rate yet"
        logger.info(
            "state download: epoch %d, %.0f%% (%.1f of %.1f MB) from %d donor(s) at %.2f MB/s, %s",
            self.manifest.epoch, 100 * held / total, held / 1e6, total / 1e6, self.live, rate / 1e6, eta,
        )  # fmt: skip

    async def _transfer(self, stream, attempt: Attempt) -> tuple[str, object]:
        """One chunk request: ("ok", bytes), ("superseded", None) or (outcome, reason) with outcome "bad",
        "dropped" (donor error, stall, below the rate floor, closed)."""
        reader, writer = stream
        index = attempt.index
        await send_control(
            writer,
            {"op": "chunk", "epoch": self.manifest.epoch, "state_hash": self.manifest.state_hash, "index": index},
        )
        try:
            header = await recv_control(reader, self.config.header_timeout_s)
        except asyncio.TimeoutError:
            return "dropped", f"no reply to the request of chunk {index} in {self.config.header_timeout_s:.1f} s"
        if "error" in header:
            return "dropped", f"says {str(header['error'])[:100]}"
        size = header.get("num_bytes")
        if header.get("ok") is not True or size != attempt.num_bytes or isinstance(size, bool):
            return "bad", f"chunk {index} header {str(header)[:100]} (expected {attempt.num_bytes} bytes)"
        pieces: list[bytes] = []
        while attempt.received_bytes < attempt.num_bytes:
            if index in self.done:
                return "superseded", None
            want = min(attempt.num_bytes - attempt.received_bytes, READ_BYTES)
            try:
                piece = await asyncio.wait_for(reader.read(want), self.config.poll_s)
            except asyncio.TimeoutError:
                piece = None
            now = self.clock()
            if piece == b"":
                return "dropped", f"closed the stream in chunk {index}"
            if piece:
                pieces.append(piece)
                attempt.received_bytes += len(piece)
                attempt.last_progress_s = now
            verdict = judge_transfer(attempt, now, self.config)
            if verdict.action != "continue" and attempt.received_bytes < attempt.num_bytes:
                return "dropped", verdict.reason
        return "ok", b"".join(pieces)


def _assemble(
    buffer: bytearray | StateFileWriter, manifest: Manifest, reference: TrainingState
) -> TrainingState | StateFile | None:
    """The state in ``buffer`` if its hash is the manifest's (off the event loop: hashes the whole state)."""
    if isinstance(buffer, StateFileWriter):
        return buffer.finish(manifest.epoch, manifest.state_hash)
    try:
        state = unflatten(buffer, manifest.epoch, reference)
    except ValueError:
        return None
    return state if state.state_hash() == manifest.state_hash else None


async def fetch_state(
    p2p: P2P,
    run_id: str,
    donors: Sequence[str],
    expected: Expected,
    reference: TrainingState,
    timeout_s: float,
    faults: FaultInjector = NO_FAULTS,
    config: FetchConfig | None = None,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
    admits: Callable[[str], bool] | None = None,
    into: Path | None = None,
    local: TrainingState | StateFile | None = None,
) -> FetchResult:
    """Download the newest state whose hash peers published, routing around donors that lie, fail or crawl.

    Args:
        p2p: our hivemind P2P (its event loop runs this coroutine).
        run_id: protocol prefix: donors serve ``"{run_id}.state"``.
        donors: base58 peer IDs to ask (e.g. peers at the newest epoch); duplicates are ignored.
        expected: epoch -> state hash that peers published for it (the quorum's hash), or a function that reads it
            afresh: donors that committed another outer step since the caller read the records offer a newer epoch
            than ``expected`` knows, and one fresh read lets the download take that newer state.
        reference: a state with our model's names and shapes (e.g. the local one); bounds every size a donor claims.
        timeout_s: limit of one stream opening or manifest request, seconds (chunks follow ``config`` instead).
        config: per-chunk deadlines; ``FetchConfig()`` by default.
        clock: monotonic seconds (injected in tests).
        rng: breaks ties between manifests offered by as many donors, and orders donors.
        admits: whether a donor is a member of the run (``peers.membership.MemberRoster.admits``); non-members are
            never asked (listed in ``dropped_donors``). None = an open run.
        into: download into this file (``state_file.StateFileWriter``) instead of memory: ``FetchResult.state`` is
            then a ``StateFile`` and the download holds a few chunks in memory, not the state (the coordinator of a
            model larger than its memory). The file is removed if the download fails.
        local: the state we hold, if any: chunks whose hash it has are copied from it (``state_reuse``).

    Returns:
        FetchResult with the verified state and a report per donor. The whole call is bounded by the caller (each
        chunk attempt is bounded by ``config``, but a large state on a slow link takes as long as it takes).

    Raises:
        StateDownloadFailed: no donor offered a state whose hash peers published, or every offered manifest failed or
            ran out of donors; ``bad_donors`` lists who lied. The local state is untouched in every case.
    """
    config = config or FetchConfig()
    rng = rng or random.Random()
    protocol = f"{run_id}.state"
    donors = list(dict.fromkeys(donors))
    outsiders = [d for d in donors if admits is not None and not admits(d)]
    if outsiders:
        logger.info("not asking %d state donor(s) that are not members of the run: %s", len(outsiders), outsiders[:3])
        donors = [d for d in donors if d not in outsiders]
    if outsiders and not donors:
        raise StateDownloadFailed(f"none of the {len(outsiders)} donor(s) is a member of the run")
    num_bytes = layout_num_bytes(reference)
    read_expected = expected if callable(expected) else (lambda: expected)
    loop = asyncio.get_running_loop()
    known = await loop.run_in_executor(None, read_expected)  # the caller's read may block (a DHT get)
    answers = await collect_offers(p2p, protocol, donors, known, num_bytes, timeout_s, config.meta_grace_s)
    newest_offered = max(
        (a.current["epoch"] for a in answers if a.current and isinstance(a.current.get("epoch"), int)), default=-1
    )
    if callable(expected) and newest_offered > max((o.manifest.epoch for a in answers for o in a.offers), default=-1):
        known = await loop.run_in_executor(None, read_expected)
        for answer in answers:  # a current state that is published now becomes an offer
            current = answer.current
            epoch = current.get("epoch") if current else None
            if isinstance(epoch, int) and known.get(epoch) == current.get("state_hash"):
                try:
                    answer.offers.insert(0, Offer(answer.donor, parse_manifest(current, num_bytes)))
                except ProtocolError as exc:
                    answer.problem, answer.lied = str(exc), True
    result = FetchResult()
    for outsider in outsiders:
        result.drop(outsider, "not a member of the run")
    for answer in answers:
        if answer.lied:
            result.bad(answer.donor, f"offered a manifest out of bounds: {answer.problem}")
        elif answer.problem:
            result.drop(answer.donor, answer.problem)
    candidates = rank_candidates([o for a in answers for o in a.offers], known, rng)
    if not candidates:
        raise StateDownloadFailed(
            f"none of {len(donors)} donor(s) offered a state whose hash peers published", result.bad_donors
        )
    buffer: bytearray | StateFileWriter
    buffer = StateFileWriter(into, reference) if into is not None else bytearray(num_bytes)
    try:
        held = KnownChunks(local, num_bytes)  # bytes we hold: written here, not asked for
        return await _fetch_candidates(
            p2p, protocol, candidates, buffer, reference, result, timeout_s, config, faults, clock, held
        )
    finally:
        if isinstance(buffer, StateFileWriter) and result.state is None:
            buffer.abandon()


async def _fetch_candidates(
    p2p, protocol, candidates, buffer, reference, result, timeout_s, config, faults, clock, held
):
    """Try the ranked manifests in turn into ``buffer`` (``fetch_state``'s steps 2 and 3)."""
    loop = asyncio.get_running_loop()
    have, have_chunk_bytes = {}, None
    for candidate in candidates:
        manifest = candidate.manifest
        members = [d for d in candidate.donors if d not in result.bad_donors and d not in result.dropped_donors]
        if not members:
            continue
        if manifest.chunk_bytes != have_chunk_bytes:
            have, have_chunk_bytes = {}, manifest.chunk_bytes
        group = _GroupDownload(
            p2p, protocol, candidate, members, buffer, have, result, timeout_s, config, faults, clock
        )
        await loop.run_in_executor(None, group.fill_known_chunks, held)
        zeros = f", {group.known_filled / 1e6:.1f} MB of it held here" if group.known_filled else ""
        logger.info(
            "downloading epoch %d state (%.1f MB%s) from %d donor(s)",
            manifest.epoch, len(buffer) / 1e6, zeros, len(members),
        )  # fmt: skip
        outcome = await group.run()
        if outcome == "complete":
            state = await loop.run_in_executor(None, _assemble, buffer, manifest, reference)
            if state is not None:
                result.state = state
                return result
            group.refuted = f"the assembled state's hash is not the published {manifest.state_hash[:12]}"
        if group.refuted:
            result.manifests_refuted += 1
            for donor in candidate.donors:
                result.bad(donor, f"offered a false manifest for epoch {manifest.epoch}: {group.refuted}")
    raise StateDownloadFailed(
        f"every manifest offered for the published state failed or ran out of donors "
        f"({len(result.bad_donors)} bad, {len(result.dropped_donors)} dropped: "
        f"{'; '.join(f'{d[:12]}: {r}' for d, r in list((result.bad_donors | result.dropped_donors).items())[:3])})",
        result.bad_donors,
    )


async def download_state(
    p2p: P2P,
    run_id: str,
    donors: list[str],
    expected: Expected,
    reference: TrainingState,
    timeout_s: float,
    faults: FaultInjector = NO_FAULTS,
    *,
    config: FetchConfig | None = None,
    on_bad_donor: Callable[[str, str], None] | None = None,
    admits: Callable[[str], bool] | None = None,
    into: Path | None = None,
    local: TrainingState | StateFile | None = None,
) -> TrainingState | StateFile:
    """``fetch_state`` returning only the state; ``on_bad_donor(peer_id, reason)`` is called for every donor that
    lied (on success and on failure) so the caller can ban it. Same arguments and errors as ``fetch_state``."""
    try:
        result = await fetch_state(
            p2p, run_id, donors, expected, reference, timeout_s, faults, config, admits=admits, into=into, local=local
        )
    except StateDownloadFailed as exc:
        for donor, reason in exc.bad_donors.items():
            if on_bad_donor is not None:
                on_bad_donor(donor, reason)
        raise
    for donor, reason in result.bad_donors.items():
        if on_bad_donor is not None:
            on_bad_donor(donor, reason)
    assert result.state is not None
    return result.state
