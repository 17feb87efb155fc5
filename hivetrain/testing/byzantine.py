"""Misbehaving peers for the fault harness (``join-swarm --byzantine MODE``, hidden from normal help).

Each mode changes what an otherwise normal peer sends: its pseudo-gradient and weight before an averaging round, or
the state it serves to joiners. Honest peers must never commit a result influenced by these (validation, exclusion,
robust aggregation) and must never adopt a corrupted state (hash checks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hivetrain.diloco.state import TrainingState
from hivetrain.faults import Fault, FaultInjector

MODES = ("nan", "inf", "sign_flip", "huge_norm", "inflated_weight", "negative_weight", "wrong_shape", "bad_donor")


def check_mode(mode: str) -> str:
    """Raises ValueError for an unknown mode."""
    if mode and mode not in MODES:
        raise ValueError(f"unknown byzantine mode {mode!r}; choose one of {', '.join(MODES)}")
    return mode


WIRE_MODES = ("nan", "inf", "inflated_weight", "negative_weight", "wrong_shape")
"""Modes applied to what goes on the wire (the engine validates local input, so these cannot go through average())."""


def arm_wire_corruption(mode: str, faults: FaultInjector) -> Fault | None:
    """Arm a fault at ``averaging.before_send`` that corrupts our parts after local validation, as a hostile peer's
    modified client would. Returns the armed fault (None for modes that are not wire modes)."""
    if mode not in WIRE_MODES:
        return None

    def corrupt(ctx: dict) -> None:
        flat, frames = ctx["flat"], ctx["frames"]
        if mode == "nan":
            flat.fill_(float("nan"))
        elif mode == "inf":
            flat.fill_(float("inf"))
        for meta_and_payload in frames.values():
            meta = meta_and_payload[0]
            if mode == "inflated_weight":
                meta["w"] = float(meta["w"]) * 1e6 + 1e9
            elif mode == "negative_weight":
                meta["w"] = -abs(float(meta["w"])) - 1.0
            elif mode == "wrong_shape":
                payload = b"".join(bytes(buf) for buf in meta_and_payload[1])
                meta_and_payload[1] = [memoryview(payload[:-4])]

    return faults.arm(Fault("averaging.before_send", "call", callback=corrupt, times=0))


def corrupt_round_input(mode: str, tensors: list[torch.Tensor], weight: float) -> tuple[list[torch.Tensor], float]:
    """What a byzantine peer averages instead of (pseudo-gradient, weight in samples): finite but hostile values
    that pass local validation (the wire modes are armed with ``arm_wire_corruption``)."""
    if mode == "sign_flip":
        tensors = [t * -100.0 for t in tensors]
    elif mode == "huge_norm":
        tensors = [t * 1e6 + 1e3 for t in tensors]
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
