"""Credit a volunteer can trust: samples counted from what its group's members saw, not from what it claims.

A peer record's ``samples_total`` is the peer's own claim. A committed round, though, fixes every member's weight (its
samples) in the group's agreement (``averaging.agreement.agree_contributors``: the reducers' results name each
contributor's weight, and every member checks them before it votes), so every member *saw* the others' samples.
Each member publishes what it saw of a few of them, and the run's coordinator counts a peer's samples only from
those witnesses:

- **Who witnesses whom** (``witnesses_for``): the round's contributors in the order of sha256(round id | peer id),
  a ring nobody picks (the round id comes from the group's declaration); each member witnesses the ``WITNESSES``
  members after it. In a group of up to ``WITNESSES + 1`` everyone witnesses everyone; in a larger one each member is
  witnessed by ``WITNESSES`` others, and its record grows by ``WITNESSES`` entries whatever the group size. The
  two-stage round witnesses within rows (members see their row-mates' weights).
- **What is published**: ``PeerRecord.witnessed`` ((peer id, samples), ...) and ``witnessed_epoch`` (the epoch the
  round committed into), until our next commit replaces them.
- **What is counted** (``CreditLedger``, in the coordinator): per (epoch, peer), the median of its witnesses' values
  (one lying witness among three moves nothing), each capped at ``max_samples_per_round``; a peer never witnesses
  itself. An epoch's credit is final once the newest epoch seen is ``window_epochs`` past it.

What it does not prove: two identities in one group can witness each other's inflated weights, but those weights are
the ones the group averaged with, so inflating them costs the inflater the same as lying to the round does
(``averaging.max_samples_per_round`` bounds both). Moshpit and gossip agree no member weights: no witnesses, and the
dashboard shows only the claimed figure there.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Iterable, Sequence

from hivetrain.peers.records import PeerRecord

WITNESSES = 3
"""Members each member witnesses (and, in a group larger than this, each member's number of witnesses)."""


def witnesses_for(
    round_id: str, weights: Sequence[tuple[str, float]], me: str, k: int = WITNESSES
) -> tuple[tuple[str, int], ...]:
    """The members we witness in the round ``round_id`` and their samples: ((peer id, samples), ...), at most ``k``,
    none of them us. ``weights``: the round's agreed (peer id, samples) (``RoundResult.weights``); empty if we are not
    among them (we witnessed nothing)."""
    members = [p for p, _ in weights]
    if me not in members or len(members) < 2:
        return ()
    ring = sorted(members, key=lambda p: hashlib.sha256(f"{round_id}|{p}".encode()).digest())
    at = ring.index(me)
    samples = dict(weights)
    chosen = [ring[(at + i) % len(ring)] for i in range(1, min(k, len(ring) - 1) + 1)]
    return tuple((p, max(0, int(round(samples[p])))) for p in chosen)


class CreditLedger:
    """The coordinator's count of witnessed samples per peer (module docstring). Not thread-safe (the observer holds
    its lock around it); memory bounded by ``window_epochs`` x the peers witnessed per epoch x ``WITNESSES``.

    Args:
        max_samples_per_round: the run's ``averaging.max_samples_per_round``: no witness counts more per epoch.
        window_epochs: epochs a (epoch, peer) count stays open for more witnesses before it is final.
    """

    def __init__(self, max_samples_per_round: int, window_epochs: int = 4):
        self.max_samples, self.window = int(max_samples_per_round), int(window_epochs)
        self.final: dict[str, int] = {}  # peer id -> samples of epochs closed
        self.open: dict[tuple[int, str], dict[str, int]] = {}  # (epoch, peer) -> witness id -> samples
        self.newest = 0

    def observe(self, records: Iterable[PeerRecord]) -> None:
        """Fold one poll of the run's records (trainers' witnesses; anything else is ignored)."""
        for r in records:
            if r.role != "trainer" or not r.witnessed or r.witnessed_epoch <= 0:
                continue
            if r.witnessed_epoch < self.newest - self.window:
                continue  # an epoch already closed: its count is final
            self.newest = max(self.newest, r.witnessed_epoch)
            for peer, samples in r.witnessed:
                if peer != r.peer_id:
                    seen = self.open.setdefault((r.witnessed_epoch, peer), {})
                    seen[r.peer_id] = min(max(int(samples), 0), self.max_samples)
        for key in [k for k in self.open if k[0] < self.newest - self.window]:
            epoch, peer = key
            self.final[peer] = self.final.get(peer, 0) + _count(self.open.pop(key))

    def credited(self) -> dict[str, int]:
        """peer id -> witnessed samples: closed epochs plus the open epochs' current counts."""
        out = dict(self.final)
        for (_, peer), seen in self.open.items():
            out[peer] = out.get(peer, 0) + _count(seen)
        return out


def _count(seen: dict[str, int]) -> int:
    """One (epoch, peer)'s credit from its witnesses' values: their lower median."""
    return int(statistics.median_low(seen.values())) if seen else 0
