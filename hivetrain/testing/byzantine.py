"""Misbehaving peers for the fault harness (``join-swarm --byzantine MODE``, hidden from normal help).

Each mode changes what an otherwise normal peer sends: its pseudo-gradient and weight before an averaging round, the
state it serves to joiners, or the record it publishes. Honest peers must never commit a result influenced by these
(validation, exclusion, robust aggregation) and must never adopt a corrupted state (hash checks, the quorum rule).

State and record modes (issue 12, findings 1 and 3):

    bad_donor    serves θ with noise added under the genuine (epoch, hash)
    nan_donor    advertises its honest manifest, serves NaN chunks (``hostile_donors.NaNChunks``)
    drip_donor   serves its honest state one byte every 3 s (``hostile_donors.Dripper``)
    epoch_liar   publishes a signed record claiming epoch ``LIE_EPOCH`` with the hash of random weights, and serves
                 those weights under that claim (a takeover attempt by one valid identity)

Admission mode (issue 12 item 6):

    uninvited    a valid identity without a join token in an invite-only run that ignores its own refusal
                 (``join-swarm`` skips its exit): it trains, publishes its record without a token, tries to group
                 with anyone and serves its state to anyone (``AnyoneServer``), logging every state stream it gets
                 (``SERVED_MARKER``) so the harness can tell whether an honest node ever asked it for state
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import torch

from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_sync import StateServer
from hivetrain.faults import Fault, FaultInjector
from hivetrain.peers.records import PeerRecord
from hivetrain.testing.hostile_donors import Dripper, NaNChunks

MODES = (
    "nan", "inf", "sign_flip", "huge_norm", "inflated_weight", "negative_weight", "wrong_shape", "bad_donor",
    "nan_donor", "drip_donor", "epoch_liar", "uninvited",
)  # fmt: skip

logger = logging.getLogger(__name__)

SERVED_MARKER = "byzantine uninvited: state stream from"
"""What an ``uninvited`` peer logs, followed by the requester's peer ID, for every state stream opened to it."""

CHUNK_BYTES_ENV = "HIVETRAIN_TEST_STATE_CHUNK_BYTES"
"""Fault harness only: the state chunk size every peer of a chaos scenario serves (``Scenario.state_chunk_bytes``),
so that a small model's state spans several chunks and a joiner asks every donor, hostile ones included."""

LIE_EPOCH = 100_000
"""The epoch an ``epoch_liar`` claims: far past any run's age, yet under ``RecordBounds.max_epoch`` (10^6), so its
record passes every DHT node's guard and reaches every reader: refusing it is the quorum rule's job. (The issue's
10^9 is refused by the guard before any reader sees it; scenario far-future-record covers that.)"""


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


class _LieState:
    """The state an ``epoch_liar`` claims and serves: θ replaced by random weights (of the honest θ's shapes and
    scale), zero momentum, epoch ``LIE_EPOCH``; built once from the first honest state seen."""

    def __init__(self, get_state: Callable[[], TrainingState | None]):
        self._get_state, self._lock = get_state, threading.Lock()
        self._built: tuple[TrainingState, str] | None = None

    def get(self) -> tuple[TrainingState, str] | None:
        """(the lie state, its hash), or None while the peer holds no state yet."""
        with self._lock:
            if self._built is None:
                honest = self._get_state()
                if honest is None:
                    return None
                gen = torch.Generator().manual_seed(12)
                params = {n: torch.randn(p.shape, generator=gen) * 3.0 for n, p in honest.params.items()}
                lie = TrainingState(LIE_EPOCH, params, {n: torch.zeros_like(p) for n, p in params.items()})
                self._built = (lie, lie.state_hash())
            return self._built


class AnyoneServer(StateServer):
    """A state server that answers anyone (its peer has no roster, so ``admits`` stays None) and logs each requester
    (``SERVED_MARKER``)."""

    async def _handle(self, info, reader, writer) -> None:
        logger.warning("%s %s", SERVED_MARKER, getattr(info, "peer_id", ""))
        await super()._handle(info, reader, writer)


def hostile_state_server(
    mode: str, get_state: Callable[[], TrainingState | None], faults: FaultInjector
) -> tuple[StateServer, Callable[[Callable[[], PeerRecord]], Callable[[], PeerRecord]]]:
    """The state server a peer in ``mode`` runs, and a wrapper for its record builder (identity for most modes).
    Its chunk size is ``$HIVETRAIN_TEST_STATE_CHUNK_BYTES`` when set (chaos scenarios), else the default.

    Returns:
        (server, wrap_record): ``wrap_record(make_record)`` returns the record builder the peer publishes with; for
        ``epoch_liar`` it claims ``LIE_EPOCH`` and the random state's hash, which the server serves.
    """
    kwargs = {"faults": faults}
    if os.environ.get(CHUNK_BYTES_ENV):
        kwargs["chunk_bytes"] = int(os.environ[CHUNK_BYTES_ENV])
    if mode == "epoch_liar":
        lie = _LieState(get_state)

        def served() -> TrainingState | None:
            built = lie.get()
            return None if built is None else built[0]

        def wrap(make_record: Callable[[], PeerRecord]) -> Callable[[], PeerRecord]:
            def lying() -> PeerRecord:
                record, built = make_record(), lie.get()
                if built is None:
                    return record
                claim = {"epoch": LIE_EPOCH, "state_hash": built[1], "param_sketch": ""}
                return record.model_copy(update={**claim, "phase_epoch": LIE_EPOCH, "done_epoch": LIE_EPOCH})

            return lying

        return StateServer(served, **kwargs), wrap
    server_class = {"nan_donor": NaNChunks, "drip_donor": Dripper, "uninvited": AnyoneServer}.get(mode, StateServer)
    return server_class(corrupt_served_state(mode, get_state), **kwargs), lambda make_record: make_record


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
