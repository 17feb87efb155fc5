"""How far peers' parameters have drifted apart, measured from small published sketches of θ.

With butterfly averaging every peer of a committed outer step holds bit-identical θ (equal state hashes). With moshpit
or gossip groups (Moshpit SGD, Ryabinin et al. 2021, section 3.2) each round averages only inside small groups, so
peers at the same epoch hold slightly different θ, and the question an operator asks is whether that spread stays
bounded over a long run. The figure is the one ``scripts/bench/moshpit_drift.py`` computes exactly in one process:

    drift(epoch) = max_p ‖θ_p − θ̄‖ / ‖θ̄‖      over the peers p at that epoch, θ̄ their plain mean.

Across processes no one holds every θ, so each peer publishes a *sketch*: a count sketch (Charikar, Chen &
Farach-Colton 2002) of θ, s = Rθ with ``SKETCH_SIZE`` buckets, where every coordinate is added with a random sign to
one random bucket; R is the same on every peer (seeded by the run, computed by integer hashing, not by a library RNG,
so peers on different torch versions agree). R is linear, so s_p − s̄ is the sketch of θ_p − θ̄, and ‖Rx‖² is an
unbiased estimate of ‖x‖² for any x, including parameters whose norm is dominated by a few large coordinates (the
norm weights of a freshly initialised transformer, where sampling coordinates fails). With 512 buckets the ratio is
off by a few percent (``tests/diloco/test_param_sketch.py`` checks it against the exact value). A sketch is 2 KiB of
fp32, small enough for the peer record; computing it reads θ once (about 3 s per 100M parameters on one CPU core),
once per outer step. It is a monitoring figure: a lying peer can inflate it, never change anyone's θ.
"""

from __future__ import annotations

import base64
import hashlib
import math
from collections.abc import Collection, Iterable, Sequence

import torch

from hivetrain.peers.records import PeerRecord

SKETCH_SIZE = 512
SKETCH_NUM_BYTES = 4 * SKETCH_SIZE


def sketch_seed(run_id: str, seed: int) -> int:
    """The count-sketch seed every peer of a run derives the same way (63-bit)."""
    digest = hashlib.sha256(f"hivetrain.sketch:{run_id}:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


_PRIME = 2**31 - 1  # hash modulus: u·a < 2^62 fits int64
_CHUNK = 1 << 20  # coordinates hashed at a time (bounds the sketcher's temporary memory to ~30 MB)


def _hash_coefficients(seed: int) -> tuple[list[int], list[int]]:
    digest = hashlib.sha512(f"hivetrain.count-sketch:{seed}".encode()).digest()
    values = [int.from_bytes(digest[i : i + 8], "little") % _PRIME for i in range(0, 64, 8)]
    return values[:4], values[4:]


def _poly_hash(index: torch.Tensor, coefficients: list[int]) -> torch.Tensor:
    """(c0·u³ + c1·u² + c2·u + c3) mod p by Horner's rule (each product < 2^62: no int64 overflow)."""
    acc = torch.full_like(index, coefficients[0])
    for c in coefficients[1:]:
        acc = (acc * index + c) % _PRIME
    return acc


def sketch_buckets(start: int, count: int, seed: int, size: int = SKETCH_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Bucket (int64 in ``[0, size)``) and sign (float64, ±1) of flat coordinates ``start .. start+count-1``, both
    shape ``(count,)``. Each comes from a random degree-3 polynomial mod p = 2^31 − 1, a 4-wise independent hash
    family (what the count sketch's variance bound Var ‖Rx‖² ≤ 2‖x‖⁴/size needs; a linear hash is not enough: on
    runs of equal values, such as a norm layer's weights, it gave errors of 50%). Integer arithmetic only, so the
    same on every platform."""
    bucket_coefficients, sign_coefficients = _hash_coefficients(seed)
    index = torch.arange(start, start + count, dtype=torch.int64) % _PRIME
    bucket = _poly_hash(index, bucket_coefficients) % size
    sign = 1.0 - 2.0 * (_poly_hash(index, sign_coefficients) & 1).to(torch.float64)
    return bucket, sign


class ParamSketcher:
    """Count sketches of a model's θ, the same on every peer of the run.

    Args:
        shapes: parameter name -> shape, in ``named_parameters()`` order (the flattening order).
        seed: from ``sketch_seed`` (equal on every peer of the run, so sketches compare).
        size: buckets per sketch.
    """

    def __init__(self, shapes: dict[str, Sequence[int]], seed: int, size: int = SKETCH_SIZE) -> None:
        if size <= 0:
            raise ValueError(f"size must be > 0, got {size}")
        self.shapes = {name: tuple(shape) for name, shape in shapes.items()}
        if not sum(math.prod(shape) for shape in self.shapes.values()):
            raise ValueError("the model has no parameters to sketch")
        self.seed, self.size = seed, size
        self._cache: tuple[object, bytes] | None = None

    def sketch(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """Rθ: float32, shape ``(size,)`` (accumulated in float64, so equal θ give bit-equal sketches).

        Raises:
            KeyError: ``params`` lacks a parameter the sketcher was built for.
            ValueError: a parameter's shape differs from the one the sketcher was built for.
        """
        out = torch.zeros(self.size, dtype=torch.float64)
        offset = 0
        for name, shape in self.shapes.items():
            flat = params[name].detach().reshape(-1)
            if tuple(params[name].shape) != shape:
                raise ValueError(f"{name}: shape {tuple(params[name].shape)} != {shape}")
            for lo in range(0, flat.numel(), _CHUNK):
                chunk = flat[lo : lo + _CHUNK].to("cpu", torch.float64)
                bucket, sign = sketch_buckets(offset + lo, chunk.numel(), self.seed, self.size)
                out.index_add_(0, bucket, chunk * sign)
            offset += flat.numel()
        return out.to(torch.float32)

    def encode(self, state_key: object, params: dict[str, torch.Tensor]) -> bytes:
        """``sketch(params)`` as little-endian fp32 bytes, computed once per ``state_key`` (e.g. the state object)."""
        if self._cache is None or self._cache[0] is not state_key:
            self._cache = (state_key, encode_sketch(self.sketch(params)))
        return self._cache[1]


def encode_sketch(values: torch.Tensor) -> bytes:
    """A float32 sketch, shape ``(n,)``, as little-endian bytes (4n)."""
    return values.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()


def decode_sketch(data: bytes) -> torch.Tensor:
    """The inverse of ``encode_sketch``: float32, shape ``(len(data) // 4,)``.

    Raises:
        ValueError: empty, longer than ``SKETCH_NUM_BYTES``, not a whole number of fp32 values, or not finite.
    """
    if not data or len(data) > SKETCH_NUM_BYTES or len(data) % 4:
        raise ValueError(f"a sketch is 4..{SKETCH_NUM_BYTES} bytes in steps of 4, got {len(data)}")
    values = torch.frombuffer(bytearray(data), dtype=torch.float32)
    if not torch.isfinite(values).all():
        raise ValueError("sketch holds NaN or Inf")
    return values


def sketch_to_text(data: bytes) -> str:
    """Base64 of a sketch, for JSON files (peer summaries, events)."""
    return base64.b64encode(data).decode("ascii")


def sketch_from_text(text: str) -> bytes:
    """Raises ValueError on bad base64."""
    return base64.b64decode(text.encode("ascii"), validate=True)


def relative_drift(sketches: Sequence[torch.Tensor]) -> float:
    """max_p ‖s_p − s̄‖ / ‖s̄‖ over sketches of equal size (the drift estimate; 0.0 when all are equal).

    Raises:
        ValueError: fewer than 2 sketches, sizes differ, or the mean sketch is all zeros.
    """
    if len(sketches) < 2:
        raise ValueError(f"drift needs at least 2 sketches, got {len(sketches)}")
    if len({s.numel() for s in sketches}) != 1:
        raise ValueError("sketches have different sizes (peers of different models or hivetrain versions?)")
    stacked = torch.stack([s.to(torch.float64).reshape(-1) for s in sketches])
    mean = stacked.mean(dim=0)
    scale = float(mean.norm())
    if scale == 0.0:
        raise ValueError("the mean sketch is zero: relative drift is undefined")
    return float((stacked - mean).norm(dim=1).max()) / scale


def drift_by_epoch(sketches: dict[int, dict[str, bytes]]) -> dict[int, tuple[float, int]]:
    """epoch -> (drift estimate, number of peers) for every epoch with at least 2 valid sketches.

    ``sketches``: epoch -> peer id -> encoded sketch. Undecodable sketches (and sizes that disagree with the
    majority of that epoch) are left out rather than failing the whole figure.
    """
    out: dict[int, tuple[float, int]] = {}
    for epoch, by_peer in sorted(sketches.items()):
        decoded = []
        for data in by_peer.values():
            try:
                decoded.append(decode_sketch(data))
            except ValueError:
                continue
        if not decoded:
            continue
        sizes = [s.numel() for s in decoded]
        common = max(set(sizes), key=sizes.count)
        decoded = [s for s in decoded if s.numel() == common]
        if len(decoded) < 2:
            continue
        try:
            out[epoch] = (relative_drift(decoded), len(decoded))
        except ValueError:
            continue
    return out


def sketch_outlier(
    candidate: torch.Tensor,
    published: Sequence[torch.Tensor],
    *,
    spread_factor: float = 3.0,
    floor_fraction: float = 0.25,
    min_sketches: int = 3,
) -> str:
    """Why a downloaded θ is too far from the swarm's to adopt ("" = close enough, or no sketch to tell).

    With moshpit or gossip groups the peers of an epoch hold different states, so a joiner cannot check the state it
    downloads against a hash others hold too: the donor's own hash only says the donor served what it claimed, and
    one identity with a fabricated state at the current epoch could otherwise become every joiner's donor. The
    evidence from more than one source is the θ sketches (``ParamSketcher``) the epoch's other peers published.

    - ``min_sketches`` (3) or more: their coordinate-wise median m cannot be moved far by fewer than half of them
      lying, and the honest spread is the median of their distances to it. The candidate passes when
      ‖s − m‖ ≤ ``spread_factor`` × that spread + ``floor_fraction`` × ‖m‖.
    - 1 or 2 (a swarm of 2-3 trainers besides the donor): no median resists a liar, so the candidate passes when it
      lies within ``floor_fraction`` × ‖p‖ of at least one published sketch p: with one liar among the donor and
      two publishers, a lying donor is refused by both honest sketches and an honest donor is accepted by the honest
      one. With a single sketch, donor and publisher disagreeing says that one of them lies, not which: the caller
      refuses the state but bans nobody (``join_check.may_ban_refused_donor``).

    The floor is there because peers of one final moshpit group publish equal sketches, so the spread can be 0: real
    moshpit drift with θ averaged stayed at or below 0.084 of ‖θ̄‖ (``moshpit_drift.py``, dev/LOG.md 2026-11-21), 3x
    under the 0.25 floor, so an honest donor is not refused (and banned) for its drift; random weights (the
    ``hash_liar`` chaos peer's) were 48x ‖m‖ away.

    Args:
        candidate: sketch of the downloaded θ, shape ``(n,)``, any float dtype.
        published: sketches of the same epoch from other peers (the donors' own left out), shape ``(n,)`` each.
        min_sketches: from this many published sketches on, the median rule applies.

    Raises:
        ValueError: sketch sizes differ.
    """
    if not published:
        return ""
    if any(s.numel() != candidate.numel() for s in published):
        raise ValueError("sketches have different sizes (peers of different models or hivetrain versions?)")
    stacked = torch.stack([s.to(torch.float64).reshape(-1) for s in published])
    cand = candidate.to(torch.float64).reshape(-1)
    if len(published) < min_sketches:
        distances = (stacked - cand).norm(dim=1)
        bounds = floor_fraction * stacked.norm(dim=1)
        if bool((distances <= bounds).any()):
            return ""
        return (
            f"the downloaded state is {float(distances.min()):.4g} from the nearest of {len(published)} peers' "
            f"published θ sketches, more than {floor_fraction} x that sketch's norm"
        )
    median = stacked.median(dim=0).values
    spread = float((stacked - median).norm(dim=1).median())
    bound = spread_factor * spread + floor_fraction * float(median.norm())
    distance = float((cand - median).norm())
    if distance <= bound:
        return ""
    return (
        f"the downloaded state is {distance:.4g} from the median of {len(published)} peers' published θ sketches, "
        f"more than the bound {bound:.4g} ({spread_factor} x their spread {spread:.4g} + {floor_fraction} x its norm)"
    )


def epoch_sketches(records: Iterable[PeerRecord], epoch: int, exclude: Collection[str]) -> list[torch.Tensor]:
    """The θ sketches trainers published for ``epoch`` (``PeerRecord.param_sketch``), one per peer, the peers in
    ``exclude`` (ourselves, the donors, banned peers) left out; undecodable or non-finite sketches are skipped (a
    hostile record must not stop the check, only fail to count)."""
    out: dict[str, torch.Tensor] = {}
    for r in records:
        if r.role != "trainer" or r.epoch != epoch or not r.param_sketch or r.peer_id in exclude or r.left_reason:
            continue
        try:
            out[r.peer_id] = decode_sketch(sketch_from_text(r.param_sketch))
        except ValueError:
            continue
    return [out[p] for p in sorted(out)]
