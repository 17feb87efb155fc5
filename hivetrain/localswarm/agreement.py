"""Whether the peers' state hashes agree, counted against the peers that were running at each epoch.

"The hashes agree" means little when only one peer was left to agree. So each epoch is counted against the peers
that should hold a state at it: the peers that had joined the run by then and had not yet left when the swarm
reached it. ``epoch_agreement`` returns one row per epoch (pure: spans and times in, rows out) and
``describe_agreement`` the sentence the summary prints, which says "yes" only when every peer of the run held the
same state at every epoch, and otherwise says how many did and why the others did not (they left, or were still
running but skipped the epoch, e.g. by downloading a later state).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby


@dataclass(frozen=True)
class PeerSpan:
    """One peer's presence in the run.

    Attributes:
        name: e.g. "peer1".
        state_hashes: epoch -> sha256 of its state at that epoch.
        joined_epoch: the first epoch it belongs to (0 for peers started with the swarm; a late joiner's first
            state).
        last_epoch: the last epoch it reached; -1 = none (it never got as far as its first state).
        left: it left before the run ended (it exited with an error, was killed or stopped); False for peers that
            finished or were still running at the end.
        left_at: unix time (s) it left; None = unknown (then ``last_epoch`` alone decides).
    """

    name: str
    state_hashes: dict[int, str]
    joined_epoch: int = 0
    last_epoch: int = -1
    left: bool = False
    left_at: float | None = None

    def running_at(self, epoch: int, reached_at: float | None) -> bool:
        """Whether this peer was part of the run when the swarm reached ``epoch`` (at unix time ``reached_at``,
        None = unknown): it had joined, and it had not left before (a peer that left while lagging behind, after
        the swarm reached the epoch, was still running then)."""
        if epoch < self.joined_epoch:
            return False
        if not self.left or self.last_epoch >= epoch:
            return True
        return self.left_at is not None and reached_at is not None and self.left_at >= reached_at


@dataclass(frozen=True)
class EpochAgreement:
    """The state hashes of one epoch.

    Attributes:
        epoch: the epoch.
        num_hashes: distinct hashes reported (1 = they agree; more = a fork).
        num_reported: peers that reported a hash.
        num_running: peers running when the swarm was at this epoch (see ``PeerSpan.running_at``).
        num_peers: peers that had joined by this epoch (running or already left).
    """

    epoch: int
    num_hashes: int
    num_reported: int
    num_running: int
    num_peers: int

    @property
    def num_left(self) -> int:
        return self.num_peers - self.num_running

    @property
    def num_skipped(self) -> int:
        """Peers running at this epoch that did not hold its state (e.g. they downloaded a later one)."""
        return max(0, self.num_running - self.num_reported)

    @property
    def complete(self) -> bool:
        """Every peer of the run holds the same state at this epoch."""
        return self.num_hashes == 1 and self.num_reported >= self.num_peers


def epoch_agreement(spans: list[PeerSpan], reached_at: dict[int, float]) -> list[EpochAgreement]:
    """One row per epoch that any peer reported a hash for, oldest first.

    Args:
        spans: every peer of the run, including those that left.
        reached_at: epoch -> unix time (s) the first peer committed it; epochs missing here are decided by the
            peers' ``last_epoch`` alone.
    """
    epochs = sorted({epoch for span in spans for epoch in span.state_hashes})
    rows = []
    for epoch in epochs:
        hashes = [span.state_hashes[epoch] for span in spans if epoch in span.state_hashes]
        rows.append(
            EpochAgreement(
                epoch=epoch,
                num_hashes=len(set(hashes)),
                num_reported=len(hashes),
                num_running=sum(span.running_at(epoch, reached_at.get(epoch)) for span in spans),
                num_peers=sum(span.joined_epoch <= epoch for span in spans),
            )
        )
    return rows


def verdict(rows: list[EpochAgreement]) -> str:
    """ "yes" (every peer of the run, same state, every epoch), "partial" (those that held a state agree, but not
    every peer held one), "no" (two different states at one epoch) or "n/a" (no hashes)."""
    if not rows:
        return "n/a"
    if any(row.num_hashes > 1 for row in rows):
        return "no"
    return "yes" if all(row.complete for row in rows) else "partial"


def _epochs_text(epochs: list[int]) -> str:
    return f"epoch {epochs[0]}" if len(epochs) == 1 else f"epochs {epochs[0]}-{epochs[-1]}"


def describe_agreement(rows: list[EpochAgreement], max_items: int = 4) -> str:
    """The summary's sentence for ``rows``; never a plain "yes" unless every peer agreed at every epoch.

    Examples: ``yes (3 of 3 peers at each of 11 epochs)``; ``NO: epoch 4: 2 hashes among 3 peers``;
    ``only 1 of 3 peers at epochs 2-10 (2 left); 3 of 3 at epochs 0-1``.
    """
    result = verdict(rows)
    if result == "n/a":
        return "n/a (no state hashes reported)"
    if result == "no":
        forks = [row for row in rows if row.num_hashes > 1]
        items = [f"epoch {r.epoch}: {r.num_hashes} hashes among {r.num_reported} peers" for r in forks[:max_items]]
        more = f"; and {len(forks) - max_items} more epochs" if len(forks) > max_items else ""
        return "NO: " + "; ".join(items) + more
    if result == "yes":
        sizes = {row.num_peers for row in rows}
        if len(sizes) == 1:
            n = sizes.pop()
            return f"yes ({n} of {n} peers at each of {len(rows)} epochs)"
        return f"yes (every peer at each of {len(rows)} epochs, {min(sizes)}-{max(sizes)} peers)"
    # partial: consecutive epochs with the same counts form one item; the incomplete ones come first
    key = lambda r: (r.num_reported, r.num_peers, r.num_left, r.num_skipped)  # noqa: E731
    runs = [(k, [r.epoch for r in group]) for k, group in groupby(rows, key=key)]
    partial = []
    for (reported, peers, left, skipped), epochs in runs:
        if reported >= peers:
            continue
        why = [f"{left} left"] if left else []
        why += [f"{skipped} running without that state"] if skipped else []
        partial.append(f"{reported} of {peers} peers at {_epochs_text(epochs)} ({', '.join(why) or 'not reported'})")
    items = partial[:max_items] + ([f"and {len(partial) - max_items} more"] if len(partial) > max_items else [])
    full = [row for row in rows if row.complete]
    if full:
        sizes = {row.num_peers for row in full}
        who = f"{sizes.pop()} of {full[0].num_peers}" if len(sizes) == 1 else "every peer"
        contiguous = full[-1].epoch - full[0].epoch == len(full) - 1
        items.append(
            f"{who} at {_epochs_text([r.epoch for r in full])}"
            if contiguous
            else f"{who} at the other {len(full)} epochs"
        )
    return "only " + "; ".join(items)
