"""The pieces of a butterfly all-reduce round that hold no connection: members, the plan of slices and who reduces them,
what a committed round returns, wire sizes, the finite check, the in-place weighted mean, a reducer's aggregate and
the buffer pools (work buffers, and result buffers recycled once the caller let go of them).

Used by ``allreduce.ButterflyRound`` (the round), ``transport.RoundTransport`` (its links and inbox) and
``receive.RoundReceiver`` (its receive path).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hivetrain.averaging import codecs
from hivetrain.averaging.base import RoundFailed
from hivetrain.averaging.bucketing import robust_aggregate, robust_options
from hivetrain.averaging.config import AveragingConfig
from hivetrain.averaging.robust import NoValidContribution


@dataclass(frozen=True)
class Member:
    """A group member's data-plane endpoint (from its signed ready entry)."""

    peer_id: str
    host: str
    port: int
    kx_public: bytes
    upload_mbps: float | None = None  # its claimed upload rate (``ReadyEntry.upload_mbps``): sizes its slice


@dataclass(frozen=True)
class RoundOutcome:
    """What a committed round returns to the engine.

    Attributes:
        flat: the result, fp32, shape (n,); bit-identical on every member that committed.
        contributors: peer ids whose contributions are in the result, sorted.
        excluded: members of the round whose contributions are not in the result, sorted: they sent bad data (or a
            reducer said so), died or stalled.
        total_weight: sum of the contributors' weights, samples.
        slice_members: per slice of the round's cut, (start, end, members): elements [start, end) of ``flat`` average
            the parts of ``members`` (in the round's order); empty when every slice averages ``contributors``. A
            slice reduced before a member was dropped keeps that member's part (``allreduce``: slices are kept across
            attempts), so after a drop some slices hold more contributions than ``contributors`` lists.
        send_busy_s: seconds during which at least one of our links was sending (``RoundTransport.send_busy_s``):
            ``bytes_sent`` over it estimates our upload rate when the round moved enough bytes.
        weights: (peer id, weight in samples) of each contributor of the group we averaged in ourselves (the two-stage
            round: our row), as every member of it agreed them (``agreement.agree_contributors``); sorted by peer id.
            Empty where no member-level weights are agreed (moshpit/gossip).
    """

    flat: torch.Tensor
    contributors: tuple[str, ...]
    excluded: tuple[str, ...]
    total_weight: float
    bytes_sent: int
    bytes_received: int
    slice_members: tuple[tuple[int, int, tuple[str, ...]], ...] = ()
    send_busy_s: float = 0.0
    weights: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Plan:
    """The round's fixed cut: the members in the order every member agrees on, one contiguous slice each.

    Who reduces a slice depends on who is left: slice i is reduced by ``order[i]`` while it contributes, else by the
    next contributor after it in ``order`` (cyclically), so the slices of members that died, stalled or were
    excluded are reassigned without re-cutting the others (``ButterflyRound``).
    """

    order: tuple[str, ...]
    bounds: list[tuple[int, int]]
    tag: bytes  # hash of the round id and ``order``, carried in every PART so members notice a disagreement

    def index(self, peer_id: str) -> int:
        return self.order.index(peer_id)

    def owner(self, i: int, contributors: frozenset[str] | set[str]) -> str:
        """Who reduces slice ``i`` while ``contributors`` (a non-empty subset of ``order``) take part."""
        k = len(self.order)
        for step in range(k):
            p = self.order[(i + step) % k]
            if p in contributors:
                return p
        raise ValueError("no contributor left")

    def slices_of(self, peer_id: str, contributors: frozenset[str] | set[str]) -> list[int]:
        return [i for i in range(len(self.order)) if self.owner(i, contributors) == peer_id]


@dataclass
class Inbox:
    """What arrived from the other members of a round (guarded by ``transport.RoundTransport``'s lock).

    Attributes:
        parts: (slice index, sender) -> (fp32 part or None if bad, weight in samples, why it is bad or "").
        haves: reducer -> its HAVE metadata (whose parts of its own slice it holds, and their weights).
        results: (removed set, slice index) -> (ok, why not, BLAKE3 digest of the bytes, RESULT metadata, reducer).
        claims: member -> the largest set of removed members its frames named (``ButterflyRound``).
        votes: voter -> (subround, full-result hash, or b"bad-mac").
        errors: member -> why its link failed.
    """

    parts: dict[tuple[int, str], tuple[torch.Tensor | None, float, str]] = field(default_factory=dict)
    haves: dict[str, dict] = field(default_factory=dict)
    results: dict[tuple[frozenset, int], tuple[bool, str, bytes, dict, str]] = field(default_factory=dict)
    claims: dict[str, frozenset] = field(default_factory=dict)
    votes: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def wire_num_bytes(codec: codecs.CodecConfig, num_elements: int) -> int:
    """Exact bytes of one part or result of ``num_elements`` elements in ``codec`` on the wire."""
    return codec.frame_num_bytes(num_elements)


def part_codec(config: AveragingConfig, fan_in: int = 1) -> codecs.CodecConfig:
    """The codec of the parts a member sends in a round of ``config`` (``averaging.compression`` and its settings).

    ``fan_in``: how many members' sparse pseudo-gradients each contribution already averages (the two-stage round's
    column stage sends row means: ``hierarchical``); a "topk" part then keeps ``k x fan_in`` elements per chunk at 8
    bits, so the row mean's support travels whole. Other codecs ignore it."""
    if config.compression == "topk":
        k = math.ceil(config.topk_density * config.topk_chunk)
        bits = config.topk_value_bits if fan_in == 1 else 8
        return codecs.CodecConfig("topk", config.topk_chunk, "fp32", min(config.topk_chunk, k * fan_in), bits)
    block = config.codec_block_size if config.compression in ("int8", "int4") else 64
    return codecs.CodecConfig(config.compression, block)


def result_codec(part: codecs.CodecConfig, num_members: int) -> codecs.CodecConfig:
    """The codec of a reducer's averaged slice in a round of ``num_members`` whose parts use ``part``: the same, except
    for "topk", whose result keeps every element any contributor sent (at most ``k x num_members`` per chunk) with
    8-bit values (its re-quantization error is not fed back, so it gets the finest grid)."""
    if part.name != "topk":
        return part
    return dataclasses.replace(part, k=min(part.block_size, part.k * num_members), value_bits=8)


def tensor_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B") if t.numel() else memoryview(b"")


def all_finite(x: torch.Tensor) -> bool:
    """Whether every element of ``x`` is finite: one summation pass (~30 GB/s) in the common case; NaN and Inf
    propagate into the sum. A sum that overflows from finite values falls back to an exact min/max pass."""
    if x.numel() == 0 or math.isfinite(float(x.sum())):
        return True
    lo, hi = torch.aminmax(x)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def weighted_mean_into(out: torch.Tensor, parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``out = sum_i w_i parts_i / sum_i w_i`` in fp32, in list order, in place: one pass per part and no allocation
    (``robust.weighted_mean`` does two passes per part and allocates, to be bit-reproducible across machines; here
    only the reducer computes, everyone else receives its bytes). Weights finite, >= 0, with a positive sum; they are
    normalized first (w_i / sum), which saves the final division pass. Parts of weight 0 are skipped (adding 0 x a
    part would only turn a -0.0 into +0.0), so a single part of positive weight comes back bit for bit: the two-stage
    round's fetch relies on it (``hierarchical``)."""
    total = math.fsum(weights)
    if total > 0 and 0.0 in weights:
        kept = [(p, w) for p, w in zip(parts, weights, strict=True) if w != 0.0]
        parts, weights = [p for p, _ in kept], [w for _, w in kept]
    torch.mul(parts[0], weights[0] / total, out=out)
    for p, w in zip(parts[1:], weights[1:], strict=True):
        out.add_(p, alpha=w / total)
    return out


def aggregate_into(
    out: torch.Tensor, parts: Sequence[torch.Tensor], weights: Sequence[float], seed: int, config: AveragingConfig
) -> None:
    """A reducer's aggregate of ``parts`` (fp32 (m,) each, in the round's order) with ``weights`` (samples) into
    ``out`` (fp32 (m,)): the weighted mean, or with ``aggregation = "centered_clip"`` and more than 2 parts
    ``bucketing.robust_aggregate`` (``seed``: its buckets, the same on every member). Weights that sum to 0 count
    equally.

    Raises:
        RoundFailed: "aborted": no part, or no valid contribution to the robust aggregate.
    """
    if not parts:
        raise RoundFailed("aborted", "no valid contribution to our slice")
    if not math.fsum(weights) > 0:
        weights = [1.0] * len(weights)
    if config.aggregation == "centered_clip" and len(parts) > 2:
        try:
            out.copy_(robust_aggregate(parts, weights, seed=seed, **robust_options(config)).value)
        except NoValidContribution as exc:
            raise RoundFailed("aborted", str(exc)) from None
        return
    weighted_mean_into(out, parts, weights)


class BufferPool:
    """Reusable fp32 buffers, by size. Fresh memory costs a page fault per 4 KiB on first touch (~2 GB/s, slower
    than the network on loopback), so receive buffers are kept between rounds. Thread-safe."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, num_elements: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(num_elements)
            if free:
                return free.pop()
        return torch.empty(num_elements, dtype=torch.float32)

    def give(self, tensor: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(tensor.numel(), []).append(tensor)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


def _storage_users(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class OutputBuffers:
    """Result buffers, recycled once the caller holds no view of them any more.

    Fresh memory costs a page fault per 4 KiB on first touch (~0.06 s of CPU per 200 MB). A result handed to the
    caller is reused only when its storage has no user but us (any tensor or view the caller keeps counts), so a
    caller never sees its result change. Otherwise a new buffer is allocated and touched on a background thread
    while matchmaking waits on the DHT."""

    _BASELINE = _storage_users(torch.empty(1))  # storage users of a tensor nobody else shares

    def __init__(self, num_kept: int = 2):
        self._kept: list[torch.Tensor] = []
        self._num_kept = num_kept
        self._box: list[torch.Tensor] = []
        self._thread: threading.Thread | None = None

    def prepare(self, num_elements: int) -> None:
        """Pick a free kept buffer of ``num_elements``, or start allocating one in the background."""
        self._box = [t for t in self._kept if t.numel() == num_elements and _storage_users(t) == self._BASELINE][:1]
        self._thread = None
        if not self._box:
            self._thread = threading.Thread(target=lambda: self._box.append(torch.zeros(num_elements)), daemon=True)
            self._thread.start()

    def get(self) -> torch.Tensor:
        """The buffer chosen by ``prepare``; it is kept for reuse by a later call."""
        if self._thread is not None:
            self._thread.join()
        out = self._box[0]
        self._kept = [out, *[t for t in self._kept if t is not out]][: self._num_kept]
        return out
