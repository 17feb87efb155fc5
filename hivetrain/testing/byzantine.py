"""Misbehaving peers for the fault harness (``join-swarm --byzantine MODE``, hidden from normal help).

Each mode changes what an otherwise normal peer sends: its pseudo-gradient and weight before an averaging round, or
the state it serves to joiners. Honest peers must never commit a result influenced by these (validation, exclusion,
robust aggregation) and must never adopt a corrupted state (hash checks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hivetrain.diloco.state import TrainingState

MODES = ("nan", "inf", "sign_flip", "huge_norm", "inflated_weight", "negative_weight", "wrong_shape", "bad_donor")


def check_mode(mode: str) -> str:
    """Raises ValueError for an unknown mode."""
    if mode and mode not in MODES:
        raise ValueError(f"unknown byzantine mode {mode!r}; choose one of {', '.join(MODES)}")
    return mode


def corrupt_round_input(mode: str, tensors: list[torch.Tensor], weight: float) -> tuple[list[torch.Tensor], float]:
    """What a byzantine peer sends instead of (pseudo-gradient, weight in samples)."""
    if mode == "nan":
        tensors = [t.clone() for t in tensors]
        tensors[0].view(-1)[0] = float("nan")
    elif mode == "inf":
        tensors = [t.clone() for t in tensors]
        tensors[0].view(-1)[-1] = float("inf")
    elif mode == "sign_flip":
        tensors = [t * -100.0 for t in tensors]
    elif mode == "huge_norm":
        tensors = [t * 1e6 + 1e3 for t in tensors]
    elif mode == "inflated_weight":
        weight = weight * 1e6
    elif mode == "negative_weight":
        weight = -weight
    elif mode == "wrong_shape":
        tensors = [t.reshape(-1)[:-1].clone() if i == 0 else t for i, t in enumerate(tensors)]
    return tensors, weight


def corrupt_served_state(
    mode: str, get_state: Callable[[], TrainingState | None]
) -> Callable[[], TrainingState | None]:
    """A state provider that serves θ with noise added (but claims the genuine epoch) when mode is 'bad_donor'."""
    if mode != "bad_donor":
        return get_state

    def corrupted() -> TrainingState | None:
        state = get_state()
        if state is None:
            return None
        bad = state.clone()
        first = next(iter(bad.params))
        bad.params[first].add_(0.01)
        return bad

    return corrupted
