"""A network partition of the simulated swarm, and what the report says about it (``[partition]`` in a scenario).

From ``at_s`` until ``heal_s`` the peers of side 1 (a random ``share``; peers that join during the split are drawn
with the same probability) and side 0 cannot reach each other:

- the DHT: each side reads only its own side's records (``SideBoard``: the record board with the other side masked
  out) and its own side's matchmaking entries and declarations (``visible_key``); records stored before the split
  by the other side vanish from view, as they would once the DHT nodes of the other side are unreachable;
- the data plane: a group that spans both sides when the split begins fails at ``at_s`` (its all-reduce cannot
  finish), as does a state download whose donors are across; new groups and downloads form from visible records only,
  so within one side.

At ``heal_s`` every record is visible again and nothing else changes: what happens next is what the production
decision functions (``decide_phase_end``, ``matchmaking.decide``, ``decide_after_round``, ``decide_sync``) make of
the two histories. To measure it, each peer's *lineage* is tracked: at the split a peer holds its side's model; a
download copies the donor's lineage; averaging never changes it (butterfly, Moshpit and gossip average
pseudo-gradients, and each member applies them to its own parameters). The swarm has reconverged when every live peer
holding a model holds one lineage (``reconverged_s_after_heal``; ``reconverged95_s_after_heal``: 95% of them).
Peers that start from a fresh model during or after the split (no donor) count in their side's lineage.

What is simplified: the cut is total (no peer is reachable from both sides), instantaneous, and the DHT of each side
is complete at once (no routing tables to repair).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hivetrain.peers.records import PeerRecord
from hivetrain.sim.config import PartitionSettings
from hivetrain.sim.dht import RecordBoard

NO_LINEAGE = -1  # joined before the split or holds no model yet


class SideBoard:
    """The record board as one side of a split sees it: the board with the other side's slots masked out.

    Offers what the decision code reads of a ``RecordBoard``: ``records()``, ``cols``, ``published``, ``peer_ids``,
    ``state_hash`` (``sim.schedule_model`` reads the columns). It follows the board: a record published between
    ticks (``DataParallelSim.publish_now``) is seen at once, as on the board itself."""

    def __init__(self, board: RecordBoard, sides: Callable[[], np.ndarray], side: int):
        self.board = board
        self._sides = sides  # the side of every slot so far (grows with the swarm)
        self.side = side
        self.cols = board.cols
        self.peer_ids = board.peer_ids
        self.state_hash = board.state_hash
        self._source: list[PeerRecord] | None = None  # the board's list our filtered copy was built from
        self._records: list[PeerRecord] = []

    @property
    def published(self) -> np.ndarray:
        sides = self._sides()
        visible = np.zeros(len(self.board.published), bool)
        n = min(len(sides), len(visible))
        visible[:n] = sides[:n] == self.side
        return self.board.published & visible

    def records(self) -> list[PeerRecord]:
        everyone = self.board.records()  # the same list object until a record is published or expires
        if everyone is not self._source:
            self._records = [self.board.record(s) for s in np.flatnonzero(self.published).tolist()]
            self._source = everyone
        return self._records


@dataclass
class PartitionTracker:
    """Sides, lineages and the per-tick history of a split (see the module docstring).

    ``side`` and ``lineage`` are (capacity,) int8/int64 per slot. ``history`` holds (time, side-0 median epoch,
    side-1 median epoch, share of live peers with lineage 0, drift over all live peers) per sampled tick."""

    settings: PartitionSettings
    seed: int
    side: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    lineage: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    history: list[tuple[float, float, float, float, float]] = field(default_factory=list)
    split_epochs: tuple[float, float] | None = None
    split_sizes: tuple[int, int] | None = None
    heal_epochs: tuple[float, float] | None = None
    reconverged_at: float | None = None
    mostly_at: float | None = None  # first time after the heal that one lineage holds >= 95% of the live models
    cut_groups: int = 0
    cut_downloads: int = 0
    heal_downloads: list[int] = field(default_factory=list)  # lineage of each download's donor after the heal

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed + 7919)  # its own stream: other draws are the same with or without

    @property
    def enabled(self) -> bool:
        return self.settings.share > 0

    def active(self, now: float) -> bool:
        return self.settings.active(now)

    def add(self, slot: int) -> None:
        """Draw the side of a new slot (every slot, so sides do not depend on when the split starts)."""
        if slot >= len(self.side):
            grow = max(2 * len(self.side), slot + 1) - len(self.side)
            self.side = np.concatenate([self.side, np.zeros(grow, np.int8)])
            self.lineage = np.concatenate([self.lineage, np.full(grow, NO_LINEAGE, np.int64)])
        self.side[slot] = int(self.rng.random() < self.settings.share)

    def views(self, board: RecordBoard, now: float) -> dict[int, SideBoard] | None:
        """Each side's view of ``board`` while split, else None (everyone reads the whole board)."""
        if not self.active(now):
            return None
        return {s: SideBoard(board, lambda: self.side, s) for s in (0, 1)}

    def same_side(self, slots: np.ndarray) -> bool:
        sides = self.side[np.asarray(slots, np.int64)]
        return bool((sides == sides[0]).all()) if len(sides) else True

    def cut_s(self, slots: np.ndarray, start_s: float) -> float:
        """When a transfer among ``slots`` begun at ``start_s`` is cut by the split: ``at_s`` if it spans both sides
        and began before, ``start_s`` if it began during the split, else inf (seconds)."""
        p = self.settings
        if not self.enabled or self.same_side(slots):
            return float("inf")
        if start_s < p.at_s:
            return p.at_s
        return start_s if start_s < p.heal_s else float("inf")

    def visible_ids(self, ids: list[str], index_of: dict[str, int], side: int) -> list[bool]:
        """Which of ``ids`` (peer ids) side ``side`` can see."""
        return [self.side[index_of[p]] == side for p in ids]

    # ---- measurement ---------------------------------------------------------------------------------------------
    def sample(self, now: float, alive: np.ndarray, holding: np.ndarray, epochs: np.ndarray, drift: float) -> None:
        """One tick: ``alive`` slots, which of them hold a model (``holding``, bool), their ``epochs``; ``drift`` is
        max_p ||θ_p − θ̄|| / ||θ̄|| over the holders."""
        p = self.settings
        if not self.enabled or now < p.at_s:
            return
        if self.split_epochs is None:
            self.lineage[alive[holding]] = self.side[alive[holding]]
        sides = self.side[alive]
        med = [float(np.median(epochs[sides == s])) if (sides == s).any() else float("nan") for s in (0, 1)]
        if self.split_epochs is None:
            self.split_epochs = (med[0], med[1])
            self.split_sizes = (int((sides == 0).sum()), int((sides == 1).sum()))
        if now >= p.heal_s and self.heal_epochs is None:
            self.heal_epochs = (med[0], med[1])
        lin = self.lineage[alive[holding]]
        known = lin[lin != NO_LINEAGE]
        share0 = float((known == 0).mean()) if len(known) else float("nan")
        self.history.append((now, med[0], med[1], share0, drift))
        one = len(known) > 0 and (share0 in (0.0, 1.0)) and len(known) == len(lin)
        if now >= p.heal_s and self.reconverged_at is None and one:
            self.reconverged_at = now
        if now >= p.heal_s and self.mostly_at is None and len(known) and max(share0, 1 - share0) >= 0.95:
            self.mostly_at = now

    def on_download(self, slot: int, donor: int, now: float) -> None:
        """``slot`` took ``donor``'s state: it now holds the donor's lineage (or its side's, if the donor had none)."""
        if not self.enabled or now < self.settings.at_s:
            return
        lin = self.lineage[donor]
        self.lineage[slot] = lin if lin != NO_LINEAGE else self.side[donor]
        if now >= self.settings.heal_s:
            self.heal_downloads.append(int(self.lineage[slot]))

    def on_fresh_model(self, slot: int, now: float) -> None:
        """``slot`` started training without a download (its own fresh model): its side's lineage while split."""
        if self.enabled and now >= self.settings.at_s and self.lineage[slot] == NO_LINEAGE:
            self.lineage[slot] = self.side[slot]

    def summary(self, end_s: float) -> dict[str, object] | None:
        """The report's ``partition`` figures (None without a partition). Epochs are medians per side."""
        if not self.enabled:
            return None
        p = self.settings
        split, heal = self.split_epochs, self.heal_epochs
        steps = None if split is None or heal is None else [heal[0] - split[0], heal[1] - split[1]]
        last = self.history[-1] if self.history else None
        wins = None
        if last is not None and last[3] == last[3]:  # not NaN
            wins = 0 if last[3] >= 0.5 else 1
        return {
            "share": p.share,
            "at_s": p.at_s,
            "heal_s": p.heal_s,
            "side_sizes_at_split": list(self.split_sizes) if self.split_sizes else None,
            "median_epoch_at_split": list(split) if split else None,
            "median_epoch_at_heal": list(heal) if heal else None,
            "outer_steps_during_split": steps,
            "diverged_outer_steps": min(steps) if steps else None,
            "both_sides_trained": bool(steps and min(steps) > 0),
            "cut_groups": self.cut_groups,
            "cut_downloads": self.cut_downloads,
            "downloads_after_heal": len(self.heal_downloads),
            "downloads_after_heal_by_lineage": [self.heal_downloads.count(0), self.heal_downloads.count(1)],
            "lineage0_share_end": last[3] if last else None,
            "winning_lineage": wins,
            "reconverged_s_after_heal": None if self.reconverged_at is None else self.reconverged_at - p.heal_s,
            "reconverged95_s_after_heal": None if self.mostly_at is None else self.mostly_at - p.heal_s,
            "drift_all_end": last[4] if last else None,
            "sim_end_s": end_s,
        }
