"""The simulated network: what an all-reduce or a state download costs in seconds and bytes on each peer's links.

No packets are simulated. Each peer has an upload and a download capacity (bytes/s) and a one-way latency; the
wide-area core is assumed not to be the bottleneck (home and datacenter access links are). A transfer's duration is
that of its busiest access link: each link carries its bytes at its full capacity, shared by the flows through it
(the bottleneck bound that hivemind's load-balancing LP, ``averaging/load_balancing.py``, also optimises). That is
max-min fair when every flow of a peer is limited by that peer's own link; when a peer's flows are limited elsewhere
it finishes earlier than modelled, so durations are upper bounds within that model.

Butterfly all-reduce of a vector of V bytes in a group of g with slice fractions f_i (``averaging.groups
.butterfly_partition``, the production function, called with the production arguments): member i sends its
contribution's other slices, (1 - f_i) V, and the reduced slice to the g - 1 others, (g - 1) f_i V; it receives as
much. Two phases (scatter-reduce, all-gather) cost two round trips of the slowest pair on top.

The two-stage all-reduce of an epoch with more participants than one group (``averaging.hierarchical``) runs the rows'
rounds in parallel, then the columns' rounds (each column averages the full vector of row means), then a confirm
round per row on 64 bytes: its duration is the slowest row plus the slowest column plus the slowest confirm, and a
member standing in two columns sends and receives its column share twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hivetrain.averaging.groups import MAX_SLICE_SHARES, butterfly_partition, hierarchy, slice_bandwidths

CONFIRM_BYTES = 64  # the confirm round's k x 16 fp32 words, per member: 16 words x 4 bytes of its own


@dataclass(frozen=True)
class Transfer:
    """One all-reduce or download: its duration and the bytes each participant sent and received."""

    duration_s: float
    sent_bytes: np.ndarray  # (g,) int64, per participant, in the order given
    received_bytes: np.ndarray  # (g,) int64


def allreduce_cost(
    peer_ids: Sequence[str],
    vector_bytes: int,
    upload_bytes_per_s: np.ndarray,
    download_bytes_per_s: np.ndarray,
    latency_s: np.ndarray,
    rate_sample_bytes: int = 0,
) -> Transfer:
    """Cost of one butterfly all-reduce among ``peer_ids`` (sorted, as the declaration lists them).

    Args:
        vector_bytes: bytes of the averaged vector (fp32: 4 per element; the partition is computed in elements).
        upload_bytes_per_s / download_bytes_per_s / latency_s: (g,) per member, in the order of ``peer_ids``.
        rate_sample_bytes: with ``averaging.bandwidth_slices``, the bytes per link a round must send before a member
            knows its upload rate (``UPLOAD_SAMPLE_BUFFERS`` socket buffers): rounds that send that much (about 2 x
            ``vector_bytes`` / (g - 1) per link) are cut by the members' upload rates as production cuts them
            (``slice_bandwidths``, at most 2 equal shares each), taking the measured rate for the true one; 0 =
            never (the equal cut).
    """
    g = len(peer_ids)
    if g < 2:
        return Transfer(0.0, np.zeros(g, np.int64), np.zeros(g, np.int64))
    num_elements = max(vector_bytes // 4, g)
    rates = None
    if rate_sample_bytes and 2 * vector_bytes >= rate_sample_bytes * (g - 1):
        rates = slice_bandwidths([float(b) for b in upload_bytes_per_s])
    bounds = butterfly_partition(num_elements, peer_ids, rates, max_share=MAX_SLICE_SHARES / g)
    fractions = np.array([(end - start) / num_elements for start, end in bounds])
    moved = ((1 - fractions) + (g - 1) * fractions) * vector_bytes
    busiest_s = float(np.max(np.maximum(moved / upload_bytes_per_s, moved / download_bytes_per_s)))
    rtt_s = 2 * 2 * float(np.max(latency_s))  # two phases, one round trip each, slowest member
    moved_bytes = moved.astype(np.int64)
    return Transfer(busiest_s + rtt_s, moved_bytes, moved_bytes.copy())


def download_cost(
    state_bytes: int,
    chunk_bytes: int,
    joiner_download_bytes_per_s: float,
    joiner_latency_s: float,
    donor_upload_bytes_per_s: np.ndarray,
    donor_latency_s: np.ndarray,
    donor_concurrent: np.ndarray,
) -> Transfer:
    """Cost of a joiner fetching ``state_bytes`` from donors in parallel (``diloco.state_fetch``).

    Each donor's upload is shared equally among the downloads it serves (``donor_concurrent``, this one included,
    counted when this download starts); the joiner takes at most its download capacity. Chunks go to whichever donor
    is idle (``state_routing.pick_chunk``), so each donor serves in proportion to its rate; at most one donor per
    chunk, so only the ``ceil(state_bytes / chunk_bytes)`` fastest donors are used.

    Returns:
        ``Transfer`` whose ``sent_bytes`` are per donor (in the order given) and ``received_bytes`` the joiner's (1,).
    """
    num_chunks = -(-state_bytes // chunk_bytes)
    rates = donor_upload_bytes_per_s / np.maximum(donor_concurrent, 1)
    used = np.zeros(len(rates), bool)
    used[np.argsort(-rates, kind="stable")[:num_chunks]] = True
    rate = float(rates[used].sum())
    if rate <= 0:
        raise ValueError("no donor can serve: every upload capacity is 0")
    total_rate = min(rate, joiner_download_bytes_per_s)
    served = np.where(used, rates / rate * state_bytes, 0.0).astype(np.int64)
    served[np.argmax(served)] += state_bytes - int(served.sum())  # rounding goes to the busiest donor
    rtt_s = 2 * (joiner_latency_s + float(np.max(donor_latency_s[used])))  # manifest request, then chunks
    return Transfer(state_bytes / total_rate + rtt_s, served, np.array([state_bytes], np.int64))


@dataclass(frozen=True)
class StageCosts:
    """The stages of one two-stage round (``averaging.hierarchical``), cut by the production ``groups.hierarchy``.

    Attributes:
        rows / columns: member indices (into the declaration's ``peer_ids``) of each row and column, in the
            production order (a member of a short row appears in two columns).
        row_s: (R,) seconds each row's round takes; column_s: (C,) each column's; confirm_s: (R,) each confirm's.
        sent_bytes / received_bytes: (g,) per member over the row, column and confirm rounds.
    """

    rows: list[np.ndarray]
    columns: list[np.ndarray]
    row_s: np.ndarray
    column_s: np.ndarray
    confirm_s: np.ndarray
    sent_bytes: np.ndarray
    received_bytes: np.ndarray


def two_stage_stages(
    peer_ids: Sequence[str],
    vector_bytes: int,
    upload_bytes_per_s: np.ndarray,
    download_bytes_per_s: np.ndarray,
    latency_s: np.ndarray,
    max_group_size: int,
    seed: str,
    rate_sample_bytes: int = 0,
) -> StageCosts | None:
    """Per-stage costs of the two-stage all-reduce among ``peer_ids`` (``two_stage_cost``'s arguments); None when
    they fit one group (no columns)."""
    rows, columns = hierarchy(peer_ids, max_group_size, seed)
    if not columns:
        return None
    index = {p: i for i, p in enumerate(peer_ids)}
    sent = np.zeros(len(peer_ids), np.int64)
    received = np.zeros(len(peer_ids), np.int64)
    durations = []
    confirm = CONFIRM_BYTES * max_group_size
    for groups, num_bytes, sample in ((rows, vector_bytes, rate_sample_bytes), (columns, vector_bytes,
                                      rate_sample_bytes), (rows, confirm, 0)):  # fmt: skip
        stage = np.zeros(len(groups))
        for j, group in enumerate(groups):
            # a column lists members in row order (its sum's order); the slice cut of its round sorts them
            idx = np.array([index[p] for p in sorted(group)])
            cost = allreduce_cost(sorted(group), num_bytes, upload_bytes_per_s[idx], download_bytes_per_s[idx],
                                  latency_s[idx], sample)  # fmt: skip
            np.add.at(sent, idx, cost.sent_bytes)
            np.add.at(received, idx, cost.received_bytes)
            stage[j] = cost.duration_s
        durations.append(stage)
    to_idx = lambda groups: [np.array([index[p] for p in g]) for g in groups]  # noqa: E731
    return StageCosts(to_idx(rows), to_idx(columns), durations[0], durations[1], durations[2], sent, received)


def two_stage_cost(
    peer_ids: Sequence[str],
    vector_bytes: int,
    upload_bytes_per_s: np.ndarray,
    download_bytes_per_s: np.ndarray,
    latency_s: np.ndarray,
    max_group_size: int,
    seed: str,
    rate_sample_bytes: int = 0,
) -> Transfer:
    """Cost of the two-stage all-reduce among ``peer_ids`` (the declaration's members), cut by the production
    ``groups.hierarchy(peer_ids, max_group_size, seed)`` (``seed``: the declaration's round id), when nobody leaves:
    the slowest row, then the slowest column, then the slowest confirm. With no more than ``max_group_size`` peers it
    is one butterfly round (``allreduce_cost``).

    Args:
        vector_bytes: bytes of the averaged vector on the wire (both stages send the same encoding).
        upload_bytes_per_s / download_bytes_per_s / latency_s: (g,) per member, in the order of ``peer_ids``.
    """
    links = (upload_bytes_per_s, download_bytes_per_s, latency_s)
    stages = two_stage_stages(peer_ids, vector_bytes, *links, max_group_size, seed, rate_sample_bytes)
    if stages is None:
        return allreduce_cost(peer_ids, vector_bytes, *links, rate_sample_bytes)
    duration_s = float(stages.row_s.max() + stages.column_s.max() + stages.confirm_s.max())
    return Transfer(duration_s, stages.sent_bytes, stages.received_bytes)
