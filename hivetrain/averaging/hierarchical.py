"""The two-stage all-reduce: one mean for an epoch with more participants than one group (issue 23).

Before, an epoch with more ready peers than ``target_group_size`` split into independent butterfly groups, each of
which averaged its members only, so the swarm ended the epoch holding one state per group: the smaller groups forked
and downloaded (39% of the computed samples thrown away at 20 peers in groups of 12), and with 3 or more groups no
state had a majority and the states drifted apart for good.

Now every peer ready at the epoch joins one declaration (matchmaking agrees on the participants once, as Moshpit's
does), ``groups.hierarchy`` cuts them into R rows of at most ``target_group_size`` and as many columns, each with one
member per row, and the round runs in stages (the row/column all-reduce of datacenter collectives, e.g. the 2-D torus
all-reduce; Moshpit SGD, Ryabinin et al. 2021, Sec. 3.1, shows the same two-level averaging is exact on a full grid):

1. **Rows**: each row runs the butterfly round (``allreduce.ButterflyRound``: validation, the codec with error
   feedback, robust aggregation, the two-phase commit) on its members' contributions: every row member holds its
   row's sample-weighted mean m_r and total weight W_r.
2. **Columns**: each column runs the butterfly round on its members' m_r weighted by W_r, summing in row order with
   one bucketing seed for all columns (``ButterflyRound(order=..., seed_tag=...)``). Every column holds all R row
   means, cut into the same R slices, so every column computes the same bytes: Σ_r W_r m_r / Σ_r W_r, the epoch's
   sample-weighted mean, bit-identical on every participant. Every column computes the whole result, so one column
   that succeeds is enough for the grid. The update bound (``accept``) is checked here. Columns are all-or-nothing:
   a column going on without a member would lack that member's row and compute another mean.
3. **Confirm**: each row runs the butterfly round (fp32, plain mean) on k x 16 numbers: member i writes the BLAKE3
   digest of the result its column committed (16 uint16 words; -1s for a column that failed) at its own 16 places and
   zeros elsewhere, so the mean times the number of parts gives back every member's digest exactly (rounded to
   integers). ``settle`` decides from these digests. A member whose column committed keeps its result if the
   confirm fails (its row-mates died: a row of 2 that lost one has no strict majority), as a row of one does.
4. **Fetch** (only in a row where a column failed): the members whose column failed (a dead or stalled column-mate,
   a refusal) receive the result from the first row-mate that holds it (``settle``'s source), in one more butterfly
   round of the source and them (the source's vector at weight 1, theirs zeros at weight 0: the mean is the source's
   bytes exactly), and check it against the digest their row confirmed.

**Failure semantics** with ``averaging.drop_failed`` (the default; issue 23 item 2): a member that dies or stalls in
its row round is dropped there (its row commits the others' mean); its column then fails at once (its data port
refuses connections) or after ``part_timeout_s`` of silence, and so does a column one of whose members dies in the
column round; the confirm goes on without members that died, and the row-mates of a failed column fetch the result.
So one leaver costs its own pseudo-gradient (if it left before its row committed) and one more vector for its
column-mates, not the attempt. The attempt fails everywhere only when no column succeeds (a whole row failed, since
every column needs every row; or every column lost a member), and it fails in a row whose confirm shows two
different results (a member fed its column another row mean: that column has a member in every row, so every row
sees it) or no result at all. A member that commits always holds the bytes some column computed, so no two members
commit different results; a member whose column failed and whose fetch fails (its source died, or it was later than
its row's confirm) applies nothing and follows the committed state (``sync_policy``), as a member in the two-phase-
commit gap does. With ``drop_failed = false`` the grid is all-or-nothing per attempt, as before: every row and confirm
needs every member and a row commits only if every member's column committed the same bytes. The caller's retry
matches again without the dead peer, with the survivors' contributions.

Bytes per participant: the row round's plus the column round's, 2(k−1)/k + 2(R−1)/R times the encoded vector for
rows of k, i.e. at most about twice a single group's (a member standing in two columns sends its column share twice),
plus 64 B for the confirm; in a row where a column failed, the fetch moves about one fp32 vector more between the
source and each of its fetchers. Compression and robust aggregation apply at the row and column stages; error
feedback at the row stage only (our own contribution); the column stage's codec error is not fed back. With "topk"
a column part is a row mean, so it keeps k x (the largest row's size) elements per chunk at 8 bits (the row's whole
support): the column stage then moves about a row's worth of sparse vectors per member, not one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import blake3
import torch

from hivetrain.averaging.base import RoundFailed
from hivetrain.averaging.config import AveragingConfig
from hivetrain.averaging.groups import hierarchy
from hivetrain.averaging.reduce import RoundOutcome

logger = logging.getLogger(__name__)

DIGEST_WORDS = 16  # a 32-byte digest as 16 uint16 values, each exact in fp32
FAILED = -1.0

RunRound = Callable[..., RoundOutcome]
"""``run(round_id, members, flat, weight, out, residual_out, **ButterflyRound kwargs)``: one butterfly round among
``members`` (peer ids) of the epoch's declaration; raises ``RoundFailed``."""

Digest = tuple[int, ...]


def stage_id(round_id: str, stage: str, index: int) -> str:
    """The round id of one row, column, confirm or fetch round of the declaration ``round_id`` (the same on every
    member)."""
    return hashlib.sha256(f"{round_id}|{stage}|{index}".encode()).hexdigest()[:32]


def digest_words(flat: torch.Tensor | None) -> torch.Tensor:
    """fp32 (16,): BLAKE3 of ``flat``'s bytes as uint16 words, or all -1 for a failed column (``flat`` None)."""
    if flat is None:
        return torch.full((DIGEST_WORDS,), FAILED)
    digest = blake3.blake3(flat.contiguous().numpy().tobytes()).digest()
    return torch.tensor([int.from_bytes(digest[i : i + 2], "little") for i in range(0, 32, 2)], dtype=torch.float32)


def read_confirm(confirm: RoundOutcome, members: Sequence[str]) -> dict[str, Digest | None]:
    """Every confirming member's digest from a committed confirm round among ``members`` (in the round's order of
    places: member i wrote its 16 words at [16 i, 16 i + 16) and zeros elsewhere, weight 1 each).

    Returns:
        member -> its 16 words, or None for a member whose column failed; members not among the round's contributors
        (dropped: died or stalled) are absent. A slice reduced before a member was dropped holds one more part
        (``RoundOutcome.slice_members``): each slice is scaled back by its own count of parts.
    """
    scale = torch.full((len(members) * DIGEST_WORDS,), float(len(confirm.contributors)))
    for start, end, used in confirm.slice_members:
        scale[start:end] = float(len(used))
    words = torch.round(confirm.flat * scale).view(len(members), DIGEST_WORDS)  # x (1/c) (c) is x within an ulp
    out: dict[str, Digest | None] = {}
    for i, p in enumerate(members):
        if p in confirm.contributors:
            w = tuple(int(v) for v in words[i].tolist())
            out[p] = None if all(v == int(FAILED) for v in w) else w
    return out


@dataclasses.dataclass(frozen=True)
class Settlement:
    """What a row member does after its row's confirm (``settle``).

    Attributes:
        action: "commit" (our column's result is the grid's), "fetch" (our column failed: receive the result from
            ``source``) or "abort" (apply nothing).
        digest: the result's digest the row confirmed (None on "abort").
        source: the row-mate that serves the fetch (the first holder in the confirm's order), or None.
        fetchers: the row members whose column failed, in the confirm's order (empty: no fetch round).
        reason: for people and logs only.
    """

    action: Literal["commit", "fetch", "abort"]
    digest: Digest | None
    source: str | None
    fetchers: tuple[str, ...]
    reason: str


def settle(digests: Mapping[str, Digest | None], order: Sequence[str], me: str, *, strict: bool) -> Settlement:
    """Decide from a row's confirmed digests (``read_confirm``) whether ``me`` commits, fetches or aborts. Pure.

    Args:
        digests: confirming member -> the digest of its column's result, None if its column failed.
        order: the confirm round's members in order (the row's; ``me`` among them).
        strict: ``averaging.drop_failed`` off: the row commits only if every member of ``order`` confirmed the same
            digest (all-or-nothing per attempt).

    Returns:
        The settlement. Tolerant: abort if no member holds a result, or two hold different ones (a column computed
        other bytes: every row sees it, since that column has a member in every row); otherwise the holders commit
        and the members whose column failed fetch from the first holder.
    """
    missing = [p for p in order if p not in digests]
    holders = [p for p in order if digests.get(p) is not None]
    fetchers = tuple(p for p in order if p in digests and digests[p] is None)
    if strict and (missing or fetchers):
        why = f"{missing} did not confirm" if missing else f"the columns of {list(fetchers)} failed"
        return Settlement("abort", None, None, (), f"{why}: nobody applies this round (drop_failed is off)")
    if not holders:
        return Settlement("abort", None, None, (), "every column of our row failed: nobody in it holds the result")
    if len({digests[p] for p in holders}) > 1:
        return Settlement("abort", None, None, (), "columns computed different results: nobody applies this round")
    digest = digests[holders[0]]
    if me in fetchers:
        return Settlement("fetch", digest, holders[0], fetchers, f"our column failed: fetching from {holders[0]}")
    why = f"{len(holders)} of {len(order)} confirmed"
    if fetchers:
        why += f"; {len(fetchers)} fetch from {holders[0]}"
    return Settlement("commit", digest, holders[0], fetchers, why)


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
    declaration ``round_id`` (more than ``config.target_group_size`` of them) in the stages of the module docstring.

    Args:
        out: fp32 (n,) the result is written to.
        residual_out: fp32 (n,) or None: receives what the codec dropped from our row-stage contribution.
        accept: the caller's check of the result (``base.Averager.average``), at the column stage (and on a fetched
            result); its contributors are the declaration's participants.

    Returns:
        The result: the epoch's sample-weighted mean in ``out``, bit-identical on every participant that commits;
        total weight Σ W_r (samples); contributors and excluded peers as far as we know them (our row's and our
        column's: a member that fetched the result knows only its row's); the bytes of every stage.

    Raises:
        RoundFailed: our row failed (we have no row mean), our row's confirm failed or settled on "abort" (module
            docstring), or our column failed and the fetch failed; nothing is applied. If a participant dies
            mid-call, the others go on without it (``drop_failed``) or fail within about ``part_timeout_s`` per
            stage left.
    """
    rows, columns = hierarchy(ids, config.target_group_size, round_id)
    r = next(i for i, row in enumerate(rows) if me in row)
    grid = _Grid(me, round_id, ids, config, run, rows, columns, r, accept, flat.numel())
    row = grid.row_stage(flat, weight, residual_out)
    result, failure = grid.column_stage(row, out)
    order = list(row.contributors) if grid.tolerant else rows[r]
    held = None if failure is not None else out
    try:
        confirm = grid.confirm(order, held)
    except RoundFailed as exc:
        if not grid.tolerant or held is None:
            raise
        # our row-mates are gone or stalled (a row of 2 that lost one cannot confirm: no strict majority): our column
        # committed the grid's result, so we keep it, as a row of one does; nobody of our row is left to fetch it
        logger.warning("two-stage round %s: row %d's confirm failed (%s): keeping our column's result", round_id[:8],
                       r, exc)  # fmt: skip
        order = [me]
        confirm = grid.confirm(order, held)
    plan = settle(read_confirm(confirm, order), order, me, strict=not grid.tolerant)
    sent = row.bytes_sent + grid.sent + confirm.bytes_sent
    received = row.bytes_received + grid.received + confirm.bytes_received
    if plan.action == "abort":
        if failure is not None and not grid.tolerant:
            raise failure
        raise RoundFailed("aborted", f"row {r}: {plan.reason}")
    if plan.action == "fetch":
        logger.info("two-stage round %s: %s", round_id[:8], plan.reason)
        total, fetched = grid.fetch(plan, out)
        contributors = tuple(sorted(p for p in ids if p not in row.excluded))
        return RoundOutcome(
            out, contributors, tuple(row.excluded), total, sent + fetched[0], received + fetched[1], weights=row.weights
        )
    if plan.fetchers and plan.source == me:
        served = grid.serve(plan, out, result.total_weight)
        sent, received = sent + served[0], received + served[1]
    excluded = tuple(sorted(set(row.excluded) | set(result.excluded)))
    contributors = tuple(sorted(p for p in ids if p not in excluded))
    return RoundOutcome(out, contributors, excluded, result.total_weight, sent, received, weights=row.weights)


class _Grid:
    """One participant's stages of one two-stage round (``two_stage``); holds what the stages share."""

    def __init__(self, me, round_id, ids, config: AveragingConfig, run: RunRound, rows, columns, r: int, accept, n):
        self.me, self.round_id, self.config, self.run, self.n = me, round_id, config, run, n
        self.rows, self.columns, self.r = rows, columns, r
        # a column's contributions are row means: a "topk" column part carries a whole row's support
        self.fan_in = max(len(row) for row in rows)
        self.ours = [c for c, column in enumerate(columns) if column[r] == me]  # one column, two in a short row
        self.seed_tag = hashlib.sha256(f"{round_id}|columns".encode()).digest()[:16]
        self.participants = tuple(sorted(ids))
        self.accept = accept
        self.everyone = None if accept is None else (lambda result, _: accept(result, self.participants))
        self.max_weight = config.max_samples_per_round * config.target_group_size
        self.tolerant = config.drop_failed
        # the confirm and fetch rounds: plain fp32 means of a few members, whatever the run's quorum size
        self.plain = dataclasses.replace(config, compression="none", aggregation="mean", error_feedback=False,
                                         min_group_size=1)  # fmt: skip
        self.sent = self.received = 0

    def refuse(self, c: int, why: str) -> None:
        """Take part in column ``c`` only to refuse it at the vote: it fails at once ("aborted") for its members,
        instead of after a connect timeout waiting for us (a dead member cannot, of course)."""
        try:
            self.run(stage_id(self.round_id, "column", c), self.columns[c], torch.zeros(self.n), 0.0, None, None,
                     order=self.columns[c], seed_tag=self.seed_tag, max_weight=self.max_weight,
                     accept=lambda *_: why, drop_failed=False, stage="column", fan_in=self.fan_in)  # fmt: skip
        except RoundFailed:
            pass

    def row_stage(self, flat: torch.Tensor, weight: float, residual_out: torch.Tensor | None) -> RoundOutcome:
        """Our row's mean m_r and weight W_r (stage 1). Raises RoundFailed (then our columns are refused)."""
        me, r = self.me, self.r
        try:
            if len(self.rows[r]) == 1:  # a row of one (3 peers in rows of 2): our contribution is its mean
                if residual_out is not None:
                    residual_out.zero_()
                return RoundOutcome(flat.clone(), (me,), (), float(weight), 0, 0, weights=((me, float(weight)),))
            return self.run(stage_id(self.round_id, "row", r), self.rows[r], flat, weight, None, residual_out,
                            stage="row")  # fmt: skip
        except RoundFailed as exc:
            # our row has no mean to give: refuse our columns on a thread of their own, so that we are free to match
            # for the retry at once (a 9-peer run: a member that refused in line was 10 s late and missed it)
            why = f"row {r} failed: {exc.reason}"
            threading.Thread(target=lambda: [self.refuse(c, why) for c in self.ours], name="hivetrain-avg-refuse",
                             daemon=True).start()  # fmt: skip
            raise

    def column_stage(self, row: RoundOutcome, out: torch.Tensor) -> tuple[RoundOutcome | None, RoundFailed | None]:
        """Our column's result in ``out`` (stage 2): (the outcome, None), or (None, why) if no column of ours
        committed. A member standing in two columns holds the result if either commits (tolerant); two that commit
        different bytes are a failure."""
        result: RoundOutcome | None = None
        failure: RoundFailed | None = None
        for c in self.ours:  # ascending on every member: two members sharing two columns never wait on each other
            if failure is not None and not self.tolerant:
                self.refuse(c, f"column {self.ours[0]} of ours failed: {failure.reason}")
                continue
            try:
                got = self.run(stage_id(self.round_id, "column", c), self.columns[c], row.flat, row.total_weight,
                               out if result is None else None, None, order=self.columns[c], seed_tag=self.seed_tag,
                               max_weight=self.max_weight, accept=self.everyone, drop_failed=False,
                               stage="column", fan_in=self.fan_in)  # fmt: skip
            except RoundFailed as exc:
                logger.info("two-stage round %s: column %d failed: %s", self.round_id[:8], c, exc)
                failure = exc
                continue
            self.sent, self.received = self.sent + got.bytes_sent, self.received + got.bytes_received
            if result is not None and not torch.equal(result.flat, got.flat):
                return None, RoundFailed("aborted", f"columns {self.ours} computed different results")
            result = result or got
        if result is not None and self.tolerant:
            return result, None
        return (result, None) if failure is None else (None, failure)

    def confirm(self, order: list[str], held: torch.Tensor | None) -> RoundOutcome:
        """Our row's confirm (stage 3) among ``order``: every member's digest of its column's result (``held``; None
        if our column failed). Tolerant, it goes on without members that died; raises RoundFailed if it fails."""
        k, i = len(order), order.index(self.me)
        mine = torch.zeros(k * DIGEST_WORDS)
        mine[i * DIGEST_WORDS : (i + 1) * DIGEST_WORDS] = digest_words(held)
        if k == 1:  # nobody to confirm with: our column's outcome is our row's
            return RoundOutcome(mine, (self.me,), (), 1.0, 0, 0)
        return self.run(stage_id(self.round_id, "confirm", self.r), order, mine, 1.0, None, None, config=self.plain,
                        drop_failed=self.tolerant, stage="confirm")  # fmt: skip

    def _fetch_round(self, plan: Settlement, x: torch.Tensor, weight: float, dest: torch.Tensor) -> RoundOutcome:
        members = [plan.source, *plan.fetchers]
        return self.run(stage_id(self.round_id, "fetch", self.r), members, x, weight, dest, None, config=self.plain,
                        order=members, drop_failed=True, stage="fetch")  # fmt: skip

    def serve(self, plan: Settlement, result: torch.Tensor, total_weight: float) -> tuple[int, int]:
        """Give our result to the row-mates whose column failed (stage 4, we are ``plan.source``); its failure is
        theirs, not ours (we commit either way). Returns (bytes sent, bytes received)."""
        n = result.numel()
        x = torch.empty(n + 2)
        x[:n] = result
        x[n:] = torch.tensor(_split(total_weight))
        try:
            got = self._fetch_round(plan, x, 1.0, torch.empty_like(x))
        except RoundFailed as exc:
            logger.warning("two-stage round %s: serving %s the result failed: %s", self.round_id[:8],
                           list(plan.fetchers), exc)  # fmt: skip
            return 0, 0
        return got.bytes_sent, got.bytes_received

    def fetch(self, plan: Settlement, out: torch.Tensor) -> tuple[float, tuple[int, int]]:
        """Receive the result from ``plan.source`` into ``out`` (stage 4) and check it against the row's confirmed
        digest and our ``accept``. Returns (total weight, (bytes sent, bytes received)); raises RoundFailed."""
        n = out.numel()
        dest = torch.empty(n + 2)
        got = self._fetch_round(plan, torch.zeros(n + 2), 0.0, dest)
        if plan.source not in got.contributors:
            raise RoundFailed("aborted", f"the source of our fetch, {plan.source}, was dropped from it")
        out.copy_(dest[:n])
        if tuple(int(v) for v in digest_words(out).tolist()) != plan.digest:
            raise RoundFailed("aborted", f"the result fetched from {plan.source} is not the one our row confirmed")
        if self.accept is not None:
            refusal = self.accept(out, self.participants)
            if refusal:
                raise RoundFailed("refused", refusal)
        return float(dest[n]) + float(dest[n + 1]), (got.bytes_sent, got.bytes_received)


def _split(value: float) -> tuple[float, float]:
    """``value`` as two fp32 numbers whose float64 sum is ``value`` to about 2^-48 relative (a sample count past
    2^24 is not exact in one fp32)."""
    hi = float(torch.tensor(value, dtype=torch.float32))
    return hi, value - hi
