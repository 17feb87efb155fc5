"""The two-stage all-reduce: one mean for an epoch with more participants than one group (issue 23).

Before, an epoch with more ready peers than ``target_group_size`` split into independent butterfly groups, each of
which averaged its members only, so the swarm ended the epoch holding one state per group: the smaller groups forked
and downloaded (39% of the computed samples thrown away at 20 peers in groups of 12), and with 3 or more groups no
state had a majority and the states drifted apart for good.

Now every peer ready at the epoch joins one declaration (matchmaking agrees on the participants once, as Moshpit's
does), ``groups.hierarchy`` cuts them into R rows of at most ``target_group_size`` and as many columns, each with one
member per row, and the round runs in three stages (the row/column all-reduce of datacenter collectives, e.g. the
2-D torus all-reduce; Moshpit SGD, Ryabinin et al. 2021, Sec. 3.1, shows the same two-level averaging is exact on a
full grid):

1. **Rows**: each row runs the butterfly round (``allreduce.ButterflyRound``: validation, the codec with error
   feedback, robust aggregation, the two-phase commit) on its members' contributions: every row member holds its
   row's sample-weighted mean m_r and total weight W_r.
2. **Columns**: each column runs the butterfly round on its members' m_r weighted by W_r, summing in row order with
   one bucketing seed for all columns (``ButterflyRound(order=..., seed_tag=...)``). Every column holds all R row
   means, cut into the same R slices, so every column computes the same bytes: Σ_r W_r m_r / Σ_r W_r, the epoch's
   sample-weighted mean, bit-identical on every participant. The update bound (``accept``) is checked here.
3. **Confirm**: each row runs the butterfly round (fp32, plain mean) on k x 16 numbers: member i writes the BLAKE3
   digest of the result its column committed (16 uint16 words; -1s for a column that failed) at its own 16 places and
   zeros elsewhere, so the mean times k gives back every member's digest exactly (rounded to integers). A member
   commits only if its whole row holds its digest.

All-or-nothing per attempt: every column holds a member of every row, so one failed column (a refusal, too few
members) shows as a -1 in every row's confirm and nobody applies anything; a failed row refuses its columns, so every
column fails. A row goes on without a member that dies or stalls (``allreduce``), but columns and confirms are
all-or-nothing (``drop_failed=False``): a column going on without a member would lack that member's row and compute
another mean, and columns that all went on without a whole row late to them (its members still in their row round)
computed the same mean without it, so the grid committed while that row failed (chaos rows-and-columns-kill beside 2
CPU hogs, 2026-11-29). A confirm also needs the whole row. So a member lost at any stage still fails the grid's
attempt everywhere; making the grid keep the survivors (a row-mate standing in for a dead column member) is issue
23's next step. The caller's
retry matches again without the dead peer, with the survivors' contributions (their samples are carried, not lost:
there is no other group's state to be behind). The two-phase-commit gap of one column round (a member that voted and
then missed a vote) fails that member's row while the others commit; the row's members then follow the committed
state as today (``sync_policy``).

Bytes per participant: the row round's plus the column round's, 2(k−1)/k + 2(R−1)/R times the encoded vector for
rows of k, i.e. at most about twice a single group's (a member standing in two columns sends its column share twice),
plus 64 B for the confirm. Compression and robust aggregation apply at both stages; error feedback at the row stage
only (our own contribution); the column stage's codec error is not fed back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Callable

import blake3
import torch

from hivetrain.averaging.base import RoundFailed
from hivetrain.averaging.config import AveragingConfig
from hivetrain.averaging.groups import hierarchy
from hivetrain.averaging.reduce import RoundOutcome

DIGEST_WORDS = 16  # a 32-byte digest as 16 uint16 values, each exact in fp32
FAILED = -1.0

RunRound = Callable[..., RoundOutcome]
"""``run(round_id, members, flat, weight, out, residual_out, **ButterflyRound kwargs)``: one butterfly round among
``members`` (peer ids) of the epoch's declaration; raises ``RoundFailed``."""


def stage_id(round_id: str, stage: str, index: int) -> str:
    """The round id of one row, column or confirm round of the declaration ``round_id`` (the same on every member)."""
    return hashlib.sha256(f"{round_id}|{stage}|{index}".encode()).hexdigest()[:32]


def digest_words(flat: torch.Tensor | None) -> torch.Tensor:
    """fp32 (16,): BLAKE3 of ``flat``'s bytes as uint16 words, or all -1 for a failed column (``flat`` None)."""
    if flat is None:
        return torch.full((DIGEST_WORDS,), FAILED)
    digest = blake3.blake3(flat.contiguous().numpy().tobytes()).digest()
    return torch.tensor([int.from_bytes(digest[i : i + 2], "little") for i in range(0, 32, 2)], dtype=torch.float32)


def two_stage(
    me: str,
    round_id: str,
    ids: list[str],
    config: AveragingConfig,
    run: RunRound,
    flat: torch.Tensor,
    weight: float,
    *,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
    accept: Callable[[torch.Tensor, tuple[str, ...]], str] | None,
) -> RoundOutcome:
    """Average ``flat`` (fp32 (n,), our contribution, weight ``weight`` samples) with every participant ``ids`` of the
    declaration ``round_id`` (more than ``config.target_group_size`` of them) in the three stages of the module
    docstring.

    Args:
        out: fp32 (n,) the result is written to.
        residual_out: fp32 (n,) or None: receives what the codec dropped from our row-stage contribution.
        accept: the caller's check of the result (``base.Averager.average``), at the column stage; its contributors
            are the declaration's participants (a member lost anywhere fails the grid's attempt anyway).

    Returns:
        The result: the epoch's sample-weighted mean in ``out``, bit-identical on every participant that commits;
        contributors and excluded peers over all rows; total weight Σ W_r; the bytes of all three stages.

    Raises:
        RoundFailed: any stage failed, on us or anywhere in the grid ("aborted" when our row's confirm shows another
            column failed); nothing is applied. If a participant dies mid-call, every other fails within about
            ``part_timeout_s`` per stage left.
    """
    rows, columns = hierarchy(ids, config.target_group_size, round_id)
    r = next(i for i, row in enumerate(rows) if me in row)
    ours = [c for c, column in enumerate(columns) if column[r] == me]  # one column, two in a short row
    seed_tag = hashlib.sha256(f"{round_id}|columns".encode()).digest()[:16]
    participants = tuple(sorted(ids))
    everyone = None if accept is None else (lambda result, _: accept(result, participants))
    max_weight = config.max_samples_per_round * config.target_group_size

    def refuse(c: int, why: str) -> None:
        """Take part in column ``c`` only to refuse it at the vote: it fails at once ("aborted") for its members,
        instead of after a connect timeout waiting for us (a dead member cannot, of course)."""
        try:
            run(stage_id(round_id, "column", c), columns[c], torch.zeros_like(flat), 0.0, None, None,
                order=columns[c], seed_tag=seed_tag, max_weight=max_weight, accept=lambda *_: why,
                drop_failed=False)  # fmt: skip
        except RoundFailed:
            pass

    try:
        if len(rows[r]) == 1:  # a row of one (3 peers in rows of 2): our contribution is its mean, nothing encoded
            row = RoundOutcome(flat.clone(), (me,), (), float(weight), 0, 0)
            if residual_out is not None:
                residual_out.zero_()
        else:
            row = run(stage_id(round_id, "row", r), rows[r], flat, weight, None, residual_out)
    except RoundFailed as exc:
        # our row has no mean to give: refuse our columns on a thread of their own, so that we are free to match for
        # the retry at once (a 9-peer run: a member that refused in line was 10 s late and missed it)
        why = f"row {r} failed: {exc.reason}"
        threading.Thread(target=lambda: [refuse(c, why) for c in ours], name="hivetrain-avg-refuse",
                         daemon=True).start()  # fmt: skip
        raise
    result: RoundOutcome | None = None
    failure: RoundFailed | None = None
    sent, received = row.bytes_sent, row.bytes_received
    for c in ours:  # ascending on every member: two members sharing two columns never wait on each other
        if failure is not None:
            refuse(c, f"column {ours[0]} of ours failed: {failure.reason}")
            continue
        try:
            got = run(stage_id(round_id, "column", c), columns[c], row.flat, row.total_weight,
                      out if result is None else None, None, order=columns[c], seed_tag=seed_tag,
                      max_weight=max_weight, accept=everyone, drop_failed=False)  # fmt: skip
        except RoundFailed as exc:
            failure = exc
            continue
        sent, received = sent + got.bytes_sent, received + got.bytes_received
        if result is not None and not torch.equal(result.flat, got.flat):
            failure = RoundFailed("aborted", f"columns {ours} computed different results")
        result = result or got
    words = digest_words(None if failure is not None else out)
    k, i = len(rows[r]), rows[r].index(me)
    mine = torch.zeros(k * DIGEST_WORDS)
    mine[i * DIGEST_WORDS : (i + 1) * DIGEST_WORDS] = words
    plain = dataclasses.replace(config, compression="none", aggregation="mean", error_feedback=False)
    if k == 1:  # nobody to confirm with: our column's outcome is our row's
        confirm = RoundOutcome(mine, (me,), (), 1.0, 0, 0)
    else:
        confirm = run(stage_id(round_id, "confirm", r), rows[r], mine, 1.0, None, None, config=plain,
                      drop_failed=False)  # fmt: skip
    if failure is not None:
        raise failure
    if len(confirm.contributors) != k:
        # A row member missing from the confirm (it died or stalled: the butterfly round went on without it) leaves
        # its column unconfirmed: that column may have gone on without our row, so another row may abort while
        # ours would commit. Only a whole row confirms (the grid stays all-or-nothing per attempt).
        raise RoundFailed("aborted", f"row {r}: {sorted(set(rows[r]) - set(confirm.contributors))} did not confirm")
    digests = torch.round(confirm.flat * k).view(k, DIGEST_WORDS)  # x (1/k) (k) is x within an ulp: exact rounded
    if not bool((digests == words).all()):
        raise RoundFailed("aborted", "another column of our row failed: nobody applies this round")
    assert result is not None
    excluded = tuple(sorted(set(row.excluded) | set(result.excluded)))
    contributors = tuple(sorted(p for p in ids if p not in excluded))
    return RoundOutcome(out, contributors, excluded, result.total_weight, sent + confirm.bytes_sent,
                        received + confirm.bytes_received)  # fmt: skip
