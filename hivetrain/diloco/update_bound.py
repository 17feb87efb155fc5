"""Every outer step is bounded: an averaged pseudo-gradient far larger than the run's recent ones is refused.

DiLoCo (Douillard et al. 2023, Algorithm 1) applies the averaged pseudo-gradient Δ̄ with outer SGD; with the default
outer lr 1 a Δ̄ several times the usual size moves θ several times as far. Issue 22 found one: two peers that could
not meet for six inner phases summed the six phases' Δ (19,200 samples) and applied it at once, and the eval loss
went from 5.54 to 55 on both, bit-identical, with every check passing. ``rounds.Contribution`` now merges carried
phases into their sample-weighted mean, so a carried contribution is no larger than one phase's; this bound is the
second line: whatever the cause (a bug, a peer's corrupted or hostile contribution that the aggregation let through),
an outer step whose ‖Δ̄‖₂ exceeds ``max_ratio`` x the median of the last committed steps' norms is not applied.

The decision is a pure function of the norm and our history (``update_bound``). ``RoundRunner`` keeps the history
(``UpdateNorms``: the norms of the last ``averaging.update_norm_window`` committed Δ̄) and, with the butterfly
strategy, hands the check to the averaging round's two-phase commit (``Averager.average(accept=...)``): every member
holding the full result checks it before voting, and one member that refuses makes the round abort on every member,
so nobody applies it (members' histories may differ: a peer that just joined has none). A state download keeps the
history: the scale of the run's updates does not change with it.

Norms are computed in fp64 over fp32 tensors (``l2_norm``), in fixed chunks, so members that hold the same bytes get
the same norm up to fp64 rounding (1e-16 relative), far below any bound worth setting.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_file import StateFile, theta_pieces

NORM_CHUNK_ELEMENTS = 1 << 20  # elements converted to fp64 at a time (8 MiB of scratch memory)


def l2_norm(tensors: Iterable[torch.Tensor]) -> float:
    """‖x‖₂ of the concatenation of ``tensors`` (fp32, any shapes), accumulated in fp64.

    Returns:
        The norm (units of the tensors); inf if any element is non-finite.
    """
    partials: list[float] = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        for start in range(0, flat.numel(), NORM_CHUNK_ELEMENTS):
            chunk = flat[start : start + NORM_CHUNK_ELEMENTS].to(torch.float64)
            partials.append(float(torch.dot(chunk, chunk)))
    total = math.fsum(partials)
    return math.sqrt(total) if math.isfinite(total) else math.inf


def update_bound(norm: float, history: Sequence[float], max_ratio: float, min_history: int) -> tuple[bool, str]:
    """May an outer step whose averaged Δ̄ has L2 norm ``norm`` be applied, given the norms of recent committed ones?

    Args:
        norm: ‖Δ̄‖₂ of the step (butterfly: the averaged pseudo-gradient; moshpit/gossip: ‖θ_new − θ_old‖₂).
        history: the same norms of the last committed steps (``UpdateNorms.history``), oldest first.
        max_ratio: k; the step is refused if ``norm > k x median(history)``. 0 = no bound.
        min_history: the bound applies once ``history`` holds at least this many norms (the first steps of a run
            have no scale to compare with; a peer that just joined has none yet, and its group's others decide).

    Returns:
        (ok, reason): ok False = refuse the step; ``reason`` names the numbers (for people and the logs only).
    """
    if not math.isfinite(norm):
        return False, f"the update's norm is {norm}"
    if max_ratio <= 0:
        return True, "no bound (averaging.max_update_ratio = 0)"
    if len(history) < min_history:
        return True, f"{len(history)} committed update norm(s) known, the bound needs {min_history}"
    median = statistics.median(history)
    if median <= 0:
        return True, "recent updates were 0: no scale to bound by"
    ratio = norm / median
    if ratio > max_ratio:
        return False, (
            f"update norm {norm:.4g} is {ratio:.1f}x the median {median:.4g} of the last {len(history)} committed "
            f"updates (bound: averaging.max_update_ratio = {max_ratio:g})"
        )
    return True, f"update norm {norm:.4g} is {ratio:.2f}x the recent median {median:.4g}"


class UpdateNorms:
    """The norms of the last ``window`` committed outer steps, oldest first (``RoundRunner``'s history).

    Args:
        window: how many are kept (``averaging.update_norm_window``).
    """

    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._norms: deque[float] = deque(maxlen=window)

    @property
    def history(self) -> tuple[float, ...]:
        return tuple(self._norms)

    def add(self, norm: float) -> None:
        """A step with this norm was committed (and applied)."""
        if math.isfinite(norm):
            self._norms.append(float(norm))


def step_norm(old: TrainingState | StateFile, new: TrainingState | StateFile) -> float:
    """‖θ_new − θ_old‖₂ per epoch between two states of one model (fp64 accumulation; ``new.epoch == old.epoch``, a
    fork resolved, counts as one epoch). The unit the per-epoch step histories (``step_check``) hold.

    States on disk (``state_file.StateFile``, the coordinator's follower) are read a piece at a time, in flat order
    (the sum's order differs from the in-memory one's by fp64 rounding, 1e-16 relative)."""
    jumped = max(1, new.epoch - old.epoch)
    if isinstance(old, TrainingState) and isinstance(new, TrainingState):
        return l2_norm(torch.sub(new.params[n], old.params[n]) for n in old.params) / jumped
    partials = []
    for a, b in zip(theta_pieces(old), theta_pieces(new), strict=True):
        diff = (b - a).astype(np.float64)  # the difference in fp32, as torch.sub gives it in memory
        partials.append(float(np.dot(diff, diff)))
    total = math.fsum(partials)
    return (math.sqrt(total) if math.isfinite(total) else math.inf) / jumped


def step_check(
    current: TrainingState | StateFile,
    new: TrainingState | StateFile,
    steps: UpdateNorms,
    max_ratio: float,
    min_history: int,
) -> tuple[bool, str]:
    """May a peer move from the state it trusts, ``current``, to a downloaded ``new`` it did not help produce? Yes if
    the per-epoch step (``step_norm``) is within ``max_ratio`` x the median of the per-epoch steps in ``steps``
    (``update_bound``). On yes, the step is added to ``steps``.

    The first of issue 28's checks on evidence the donors cannot fake: a state one outer step from ours moves θ by
    about one applied update; random weights move it by the norm of θ itself, orders of magnitude more (2 identities
    one epoch ahead served random weights x5 and took over an open run). What it cannot catch: a jump with no history
    to bound it (a joiner, a restarted coordinator: the loss check covers those) or one within the bound.

    Args:
        current, new: states of one model (same parameter names and shapes; fp32).
        steps: the per-epoch step norms of the last committed or followed steps.
        max_ratio: k (the run's ``averaging.max_update_ratio``); 0 = no bound.
        min_history: the bound applies once ``steps`` holds this many norms.

    Returns:
        (ok, reason): the reason names the numbers, for people and the logs.
    """
    norm = step_norm(current, new)
    ok, why = update_bound(norm, steps.history, max_ratio, min_history)
    if ok:
        steps.add(norm)
    return ok, f"per-epoch step to epoch {new.epoch}: {why}"
