"""Configuration of the averaging engine (a table ``[averaging]`` of the run's TOML file)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

_STRICT = ConfigDict(extra="forbid")


@dataclass(frozen=True, config=_STRICT)
class AveragingConfig:
    """How pseudo-gradients are averaged across the peers of an epoch.

    Args:
        strategy: "butterfly" = one group of all ready peers, butterfly all-reduce (Moshpit SGD with a single group);
            "moshpit" = ``moshpit_rounds`` rounds of groups on a virtual grid (Ryabinin et al. 2021, "Moshpit SGD",
            Alg. 1); "gossip" = random pairs, ``moshpit_rounds`` rounds (approximate average).
        target_group_size: the largest group matched for one all-reduce.
        min_group_size: rounds with fewer peers fail (1 = a lone peer applies its own pseudo-gradient).
        matchmaking_time_s: how long the first ready peer of an epoch waits for others, seconds.
        round_timeout_s: the whole round (matchmaking + all-reduce) must finish within this, seconds.
        max_retries: failed rounds retried (by the caller) before the peer falls back to a state download.
        max_samples_per_round: the largest weight (samples) a peer may claim for one round.
        connect_timeout_s: dialing a member and the authentication handshake, seconds.
        part_timeout_s: a member that sends no byte for this long while we wait on it is declared failed (stall
            detection; it bounds how long a stalled or vanished member holds the others), seconds.
        commit_timeout_s: votes are awaited until the round's deadline plus this grace (members' deadlines differ by
            their matchmaking skew, and a vote may queue behind results on a slow uplink), seconds.
        declare_grace_s: followers wait this long past the group deadline for the leader's declaration, seconds.
        poll_interval_s: DHT polling period during matchmaking, seconds.
        matchmaking_read_kib_s: the matchmaking reads' budget, KiB per second: after reading B bytes of its round
            key a waiting peer starts its next read no sooner than B / this (``matchmaker.Matchmaker``). The key holds
            every ready peer's entry, so it binds from ~20 ready peers on; pushes between data ports carry the
            urgent records. Default 256 KiB/s (2 Mbit/s, a fifth of a 10 Mbit/s home downlink): at 1,000 simulated
            peers with 1 h sessions (``dp-1000-churn``, 8 outer steps) matchmaking reads fell from 3.0 GB to 139 MB
            per peer per outer step, and from 74 to 1.4 MB without churn (dev/LOG.md, 2026-12-01 session 30).
        compression: wire codec of parts and results ("none" = fp32 bit-exact inputs; "fp16", "int8", "int4"
            quantize what is sent; "topk" sparsifies it, ``codecs`` module docstring; every member still ends
            bit-identical).
        codec_block_size: elements per quantization block for int8/int4.
        topk_density: "topk": the fraction of each chunk a member sends (k = ceil(density x chunk) elements per
            chunk, largest magnitude first; the rest stays in its error-feedback residual). A reducer's result keeps
            every element any contributor sent (k x contributors per chunk, capped at the chunk), with 8-bit values:
            its re-quantization is not fed back. Default 0.1 with 2-bit values: the learning-per-byte bench's best
            top-k arm (tiny preset, 1,200 steps, 4 workers, with ``error_feedback_decay`` 0.8 and ``diloco.outer_lr``
            1.5: 1.6 points behind fp32 DiLoCo at 471x fewer bytes than DDP, 3 seeds; 3%, 5% and 4-bit values did
            worse: dev/LOG.md, 2026-12-03 session 41).
        topk_value_bits: "topk": bits per sent value, 2 (ternary: -a, 0, +a per chunk), 4 or 8.
        topk_chunk: "topk": elements per chunk (64..65536; positions travel as uint16 offsets or, where smaller, as a
            bitmap of the chunk: ``codecs.topk_bitmap``).
        error_feedback: keep what the codec dropped from our contribution (fp32, one value per averaged element) and
            add it to the next round's contribution (EF-SGD, Karimireddy et al. 2019, "Error Feedback Fixes SignSGD",
            Alg. 2), for quantized pseudo-gradients as in Streaming DiLoCo (Douillard et al. 2025, 4-bit outer
            gradients). Only what we send is corrected; the reducers' re-encoding of the averaged slice is not. A
            failed round keeps the residual unchanged. Costs 4 bytes of memory per averaged element. Needs
            ``compression`` other than "none".
        error_feedback_decay: β in (0, 1]: each round adds β x the residual, not all of it (SparseLoCo's decayed
            accumulator, Sarfi et al. 2025, Alg. 1): what stayed unsent for many rounds fades instead of arriving
            stale. 1 = plain error feedback. Needs ``error_feedback`` when below 1.
        bandwidth_slices: cut each butterfly round into slices proportional to the members' upload rates (the
            closed-form optimum of hivemind's load-balancing LP, ``groups.butterfly_partition``; each claim bounded to
            4x the group's median, ``groups.slice_bandwidths``), so a slow link reduces less and no longer sets the
            round's time. Equal slices while no member's rate is known. False = always equal slices.
        upload_mbps: our upload rate, Mbit/s, as published to our groups; 0 (default) = measured from our committed
            rounds once one sends at least 4 socket buffers per link (bytes sent over the time our links were
            sending). Set it on a link whose rate you know (e.g. a metered uplink).
        aggregation: "mean" = sample-weighted mean; "centered_clip" = contributions compared at one size, the
            shift test, collusion discount, rejection of far contributions and weighted CenteredClip with a
            data-driven radius (``bucketing.robust_aggregate``;
            Karimireddy et al. 2021 and 2022), robust to a minority of attackers; exactly the mean when no
            contribution is an outlier.
        clip_tau: CenteredClip radius, an L2 norm per part (the slice one reducer aggregates), in the units of the
            averaged tensors; contributions farther than it from the coordinate median are rejected. 0 (default) =
            data-driven: ``clip_tau_factor`` x the median distance of the contributions to their coordinate median,
            which follows the run's scale (the old fixed 1.0 clipped honest tiny-model parts: 1.7-2.6% error with no
            attacker).
        clip_tau_factor: the data-driven radius in median distances (when ``clip_tau`` is 0). 1.75: no honest peer was
            rejected or clipped in scripts/bench/robust_aggregation.py (error 0.0000 with no attacker; honest real
            pseudo-gradients lie within 1.1x the median distance, sign flips at 1.7-1.9x; dev/LOG.md, 2026-11-25).
        clip_iters: CenteredClip fixed-point iterations.
        bucket_size: contributions averaged per bucket before CenteredClip (Karimireddy, He, Jaggi 2022, Alg. 1);
            1 = no bucketing (default: with groups of 8, buckets of 2 broke down at 2 attackers). f attackers can
            reach f buckets: keep bucket_size * f below half the group.
        duplicate_ratio: contributions closer to each other than this fraction of the median pairwise distance
            form one colluding group that weighs as much as one member (ALIE/IPM attackers send one vector); 0 = off.
        shift_threshold: contributions on one side of most others in more than this fraction of coordinates, beyond
            the honest ones' imbalance (paired sign test, ``bucketing`` step 1b), get weight 0; catches "a little is
            enough" attackers that distance cannot; 0 = off. 0.2: honest real pseudo-gradients scored at most 0.07,
            ALIE 0.38 or more (dev/LOG.md, 2026-11-25).
        size_exponent: robust aggregation compares contributions as x_i (w_mean / w_i)^p (``bucketing`` step 0),
            so honest peers that ran more inner steps are not taken for outliers. "auto" (default): p estimated from
            the contributions (a repeated median; 0.56 measured for pseudo-gradients); a number in [0, 1] fixes p
            (0 = compare as sent). With 0, a 16x spread of inner steps cost 0.45 relative error with no attacker
            (dev/LOG.md, 2026-11-25).
        ban_time_s: a peer caught sending bad data is left out of our rounds for this long, seconds.
        drop_failed: a butterfly group goes on without a member that dies or stalls and commits the others' mean in
            the same round (``allreduce``; issue 23 item 2): the leaver's contribution is lost, the survivors' kept.
            An attempt still needs a strict majority of its declared members, and nothing is half-applied. On by
            default since 2026-11-29 session 16 (the loaded suite and demo pass with it; dev/LOG.md). False = any
            member lost fails the attempt everywhere and the survivors retry. In the two-stage grid
            (``hierarchical``) it also lets the grid go on without a failed column (its members fetch the result from
            row-mates) and confirms go on without members that died; each column is all-or-nothing either way.
        moshpit_rounds: averaging rounds per outer step for "moshpit" and "gossip".
        socket_buffer_bytes: SO_SNDBUF/SO_RCVBUF of data-plane sockets, bytes (0 = the OS default).
        libp2p_fallback: when a member's data port cannot be dialed over TCP (NAT, firewall), carry the link over a
            libp2p stream of the DHT's p2pd instead (relays, hole punching; slower). False = such members fail.
        max_update_ratio: k, the bound on every outer step (``diloco.update_bound``): a round whose averaged
            pseudo-gradient has an L2 norm above k x the median of the last ``update_norm_window`` committed ones is
            refused by its members before they vote, so it aborts everywhere and nothing is applied (a failed round:
            retried, then carried). With "moshpit"/"gossip" the norm is that of a peer's own applied step,
            ‖θ_new − θ_old‖₂, checked by each peer for itself. 0 = no bound. Default 5: in six honest local swarms
            (tiny and small models, 2-3 peers, uneven and fixed schedules, eager overlap, groups of 1-3) the largest
            ratio per run was 0.84-1.39x, 1.39x during a warmup over 8 outer steps (dev/LOG.md, 2026-11-28 session
            10): a 3.6x margin; a long warmup (up to ~2.3x) or a group shrinking from 8 to 1 with noisy pseudo-gradients
            (up to ~2.8x) stays under it, while six phases' Δ summed from one θ (issue 22) come to √6-6x (2.4x if they
            were pure noise, 6x if pure signal).
        update_norm_window: how many recent committed update norms the bound's median is taken over.
        update_norm_min_history: the bound applies once this many committed norms are known (a peer that just
            joined has none: the others of its group decide for it).
    """

    strategy: Literal["butterfly", "moshpit", "gossip"] = "butterfly"
    target_group_size: int = Field(default=64, ge=1, le=4096)
    min_group_size: int = Field(default=1, ge=1)
    matchmaking_time_s: float = Field(default=5.0, gt=0.0, le=600.0)
    round_timeout_s: float = Field(default=60.0, gt=0.0, le=3600.0)
    max_retries: int = Field(default=2, ge=0, le=100)
    max_samples_per_round: int = Field(default=1_000_000, ge=1)
    connect_timeout_s: float = Field(default=5.0, gt=0.0, le=600.0)
    part_timeout_s: float = Field(default=10.0, gt=0.0, le=3600.0)
    commit_timeout_s: float = Field(default=5.0, gt=0.0, le=600.0)
    declare_grace_s: float = Field(default=1.5, gt=0.0, le=60.0)
    poll_interval_s: float = Field(default=0.1, gt=0.0, le=10.0)
    matchmaking_read_kib_s: float = Field(default=256.0, gt=0.0, le=1e7)
    compression: Literal["none", "fp16", "int8", "int4", "topk"] = "none"
    codec_block_size: int = Field(default=64, ge=1, le=1 << 20)
    topk_density: float = Field(default=0.1, gt=0.0, le=0.5)
    topk_value_bits: Literal[2, 4, 8] = 2
    topk_chunk: int = Field(default=4096, ge=64, le=1 << 16)
    error_feedback: bool = False
    error_feedback_decay: float = Field(default=1.0, gt=0.0, le=1.0)
    aggregation: Literal["mean", "centered_clip"] = "mean"
    clip_tau: float = Field(default=0.0, ge=0.0)
    clip_tau_factor: float = Field(default=1.75, gt=0.0, le=100.0)
    clip_iters: int = Field(default=5, ge=1, le=100)
    bucket_size: int = Field(default=1, ge=1, le=64)
    duplicate_ratio: float = Field(default=0.1, ge=0.0, lt=1.0)
    shift_threshold: float = Field(default=0.2, ge=0.0, le=1.0)
    size_exponent: Literal["auto"] | Annotated[float, Field(ge=0.0, le=1.0)] = "auto"
    ban_time_s: float = Field(default=300.0, ge=0.0)
    drop_failed: bool = True
    bandwidth_slices: bool = True
    upload_mbps: float = Field(default=0.0, ge=0.0, le=1e6)
    moshpit_rounds: int = Field(default=2, ge=1, le=32)
    socket_buffer_bytes: int = Field(default=4 * 2**20, ge=0, le=1 << 30)
    libp2p_fallback: bool = True
    max_update_ratio: float = Field(default=5.0, ge=0.0, le=1e6)
    update_norm_window: int = Field(default=16, ge=1, le=1024)
    update_norm_min_history: int = Field(default=3, ge=1, le=1024)

    @property
    def exact_average(self) -> bool:
        """Whether a committed epoch leaves every member on one state: "butterfly" averages the epoch's ready peers in
        one all-reduce (the exact sample-weighted mean); "moshpit" and "gossip" average approximately, so peers'
        states differ by design (a hash mismatch is no fork)."""
        return self.strategy == "butterfly"

    def __post_init__(self) -> None:
        if self.min_group_size > self.target_group_size:
            raise ValueError(
                f"averaging.min_group_size ({self.min_group_size}) must not exceed "
                f"averaging.target_group_size ({self.target_group_size})"
            )
        if self.round_timeout_s <= self.matchmaking_time_s:
            raise ValueError(
                f"averaging.round_timeout_s ({self.round_timeout_s}) must exceed "
                f"averaging.matchmaking_time_s ({self.matchmaking_time_s})"
            )
        for name in ("connect_timeout_s", "part_timeout_s", "commit_timeout_s"):
            if getattr(self, name) >= self.round_timeout_s:
                raise ValueError(
                    f"averaging.{name} ({getattr(self, name)}) must be smaller than "
                    f"averaging.round_timeout_s ({self.round_timeout_s})"
                )
        if self.poll_interval_s >= self.matchmaking_time_s:
            raise ValueError(
                f"averaging.poll_interval_s ({self.poll_interval_s}) must be smaller than "
                f"averaging.matchmaking_time_s ({self.matchmaking_time_s})"
            )
        if self.error_feedback and self.compression == "none":
            raise ValueError(
                "averaging.error_feedback needs averaging.compression (fp16, int8, int4 or topk): none is exact"
            )
        if self.error_feedback_decay < 1.0 and not self.error_feedback:
            raise ValueError(
                f"averaging.error_feedback_decay = {self.error_feedback_decay:g} decays an error-feedback residual: "
                "set averaging.error_feedback = true, or leave the decay at 1"
            )
        if self.compression == "topk" and not self.error_feedback:
            raise ValueError(
                f"averaging.compression='topk' sends {self.topk_density:g} of each pseudo-gradient; without "
                "error feedback the rest would never be sent: set averaging.error_feedback = true"
            )
        if self.compression == "topk" and self.aggregation != "mean":
            raise ValueError(
                "averaging.compression='topk' with averaging.aggregation='centered_clip': sparse contributions share "
                "few coordinates, so their coordinate median is mostly 0 and every honest contribution looks like an "
                "outlier; use aggregation='mean' with topk, or a dense codec (int8, int4) for robust aggregation"
            )
        if self.update_norm_min_history > self.update_norm_window:
            raise ValueError(
                f"averaging.update_norm_min_history ({self.update_norm_min_history}) must not exceed "
                f"averaging.update_norm_window ({self.update_norm_window})"
            )
        if self.strategy != "butterfly" and self.target_group_size < 2:
            raise ValueError(f"averaging.strategy={self.strategy!r} needs averaging.target_group_size >= 2")
