"""Simulated volunteers: compute speed, links, reachability and session length, drawn from a scenario's laws.

Every draw comes from one ``numpy.random.Generator`` that the simulation seeds, in a fixed order, so a scenario and
seed give the same swarm. Units: samples/s, bytes/s (links are given in Mbit/s = 10^6 bit/s and converted here),
seconds.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from hivetrain.sim.config import ChurnConfig, PeerDistribution

_Z95 = 1.6448536269514722  # standard normal quantile of 0.95


@dataclass(frozen=True)
class PeerDraw:
    """One volunteer's hardware and session (all units in the names)."""

    peer_id: str
    samples_per_s: float
    upload_bytes_per_s: float
    download_bytes_per_s: float
    latency_s: float
    behind_nat: bool
    session_s: float


def peer_id_for(seed: int, index: int) -> str:
    """A stable, random-looking id (hex of blake2b), so sorted-id leaders and placements are not the join order."""
    return hashlib.blake2b(f"sim\x00{seed}\x00{index}".encode(), digest_size=10).hexdigest()


def _log_uniform(rng: np.random.Generator, low: float, high: float) -> float:
    return float(math.exp(rng.uniform(math.log(low), math.log(high)))) if high > low else float(low)


def draw_samples_per_s(rng: np.random.Generator, dist: PeerDistribution, index: int = 0) -> float:
    """Compute speed of peer number ``index``: log-normal with p95/p5 = ``compute_spread`` around the median, a GPU
    class, or the ``index``-th of a given list (no draw: the other draws of a seed stay the same)."""
    if dist.compute == "list":
        return float(dist.samples_per_s[index % len(dist.samples_per_s)])
    if dist.compute == "classes":
        return float(dist.gpu_classes[int(rng.choice(len(dist.gpu_classes), p=dist.gpu_shares))])
    sigma = math.log(dist.compute_spread) / (2 * _Z95)
    return float(dist.samples_per_s_median * math.exp(sigma * rng.standard_normal()))


def draw_session_s(rng: np.random.Generator, churn: ChurnConfig) -> float:
    """Session length, seconds (inf without churn). Weibull is scaled so its mean is ``mean_session_s``."""
    if churn.session == "none":
        return math.inf
    if churn.session == "exponential":
        return float(rng.exponential(churn.mean_session_s))
    k = churn.weibull_shape
    scale = churn.mean_session_s / math.gamma(1 + 1 / k)
    return float(scale * rng.weibull(k))


def draw_peer(rng: np.random.Generator, seed: int, index: int, dist: PeerDistribution, churn: ChurnConfig) -> PeerDraw:
    """Draw peer number ``index`` (the draws' order is fixed: speed, link class, links, latency, NAT, session)."""
    speed = draw_samples_per_s(rng, dist, index)
    datacenter = rng.random() < dist.datacenter_share
    up, down, lat = (
        (dist.dc_upload_mbps, dist.dc_download_mbps, dist.dc_latency_s)
        if datacenter
        else (dist.home_upload_mbps, dist.home_download_mbps, dist.home_latency_s)
    )
    up_bps = _log_uniform(rng, *up) * 1e6 / 8
    down_bps = _log_uniform(rng, *down) * 1e6 / 8
    latency_s = float(rng.uniform(*lat))
    nat = bool(rng.random() < dist.nat_share)
    if nat:
        up_bps *= dist.relay_efficiency
        down_bps *= dist.relay_efficiency
    return PeerDraw(peer_id_for(seed, index), speed, up_bps, down_bps, latency_s, nat, draw_session_s(rng, churn))
