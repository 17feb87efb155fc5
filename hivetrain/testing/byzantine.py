"""Misbehaving peers for the fault harness (``python -m hivetrain.testing.hostile_peer --byzantine MODE``).

Each mode changes what an otherwise normal peer sends: its pseudo-gradient and weight before an averaging round, the
state it serves to joiners, or the record it publishes. Honest peers must never commit a result influenced by these
(validation, exclusion, robust aggregation) and must never adopt a corrupted state (hash checks, the quorum rule).

A mode is a set of ``call`` faults that ``arm_byzantine`` arms on the peer's ``FaultInjector`` at hook points of
production code (``hivetrain.faults.HookPoint``); production code never imports this module:

    averaging.before_send    nan, inf, inflated_weight, negative_weight, wrong_shape: corrupt our parts on the wire,
                             after the engine validated them (``WIRE_MODES``)
    diloco.round_input       sign_flip, huge_norm: average hostile but finite values instead of our Δ (``INPUT_MODES``)
    diloco.state_server      bad_donor, nan_donor, drip_donor, epoch_liar, uninvited: run a hostile state server
                             (and, in a chaos scenario, every peer's server with ``$HIVETRAIN_TEST_STATE_CHUNK_BYTES``)
    diloco.record            epoch_liar: publish a record that lies about our epoch and state hash

Modes of the averaging round (issue 10):

    nan, inf         every element of our wire vector is NaN / +inf
    inflated_weight  our weight on the wire is ×10^6 + 10^9 samples
    negative_weight  our weight on the wire is negative
    wrong_shape      our payload to each reducer is 4 bytes short
    sign_flip        we average -100 Δ
    huge_norm        we average 10^6 Δ + 10^3

State and record modes (issue 12, findings 1 and 3):

    bad_donor    serves θ with noise added under the genuine (epoch, hash)
    nan_donor    advertises its honest manifest, serves NaN chunks (``hostile_donors.NaNChunks``)
    drip_donor   serves its honest state one byte every 3 s (``hostile_donors.Dripper``)
    epoch_liar   publishes a signed record claiming epoch ``LIE_EPOCH`` with the hash of random weights, and serves
                 those weights under that claim (a takeover attempt by one valid identity)
    hash_liar    claims its own, current epoch with the hash of random weights, drawn until the hash sorts first
                 (starts with "ff"), and serves them: in a moshpit or gossip run, where no two peers of an epoch
                 hold one hash, the quorum rule publishes the largest hash of the epoch, so without the joiners' θ
                 sketch check (``diloco.drift.sketch_outlier``) it was every joiner's only donor

    ahead_liar   claims one epoch past its honest one with the hash of random weights x5 (seeded by that epoch, so
                 colluding ``ahead_liar`` identities publish and serve the same poisoned state), and serves them:
                 two such identities beside two honest peers were "half of the live peers" ahead, and the quorum
                 rule took every honest peer, their joiner and the coordinator's checkpoints (issue 28)

Admission mode (issue 12 item 6):

    uninvited    a valid identity without a join token in an invite-only run that ignores its own refusal
                 (``testing.hostile_peer`` skips its exit): it trains, publishes its record without a token, tries to
                 group with anyone and serves its state to anyone (``AnyoneServer``), logging every state stream it
                 gets (``SERVED_MARKER``) so the harness can tell whether an honest node ever asked it for state
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_sync import StateServer
from hivetrain.faults import Fault, FaultInjector, HookPoint
from hivetrain.testing.hostile_donors import Dripper, NaNChunks

MODES = (
    "nan", "inf", "sign_flip", "huge_norm", "inflated_weight", "negative_weight", "wrong_shape", "bad_donor",
    "nan_donor", "drip_donor", "epoch_liar", "hash_liar", "ahead_liar", "uninvited",
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
INPUT_MODES = ("sign_flip", "huge_norm")
"""Modes that change what the peer averages (finite values that pass local validation)."""
SERVER_MODES = ("bad_donor", "nan_donor", "drip_donor", "epoch_liar", "hash_liar", "ahead_liar", "uninvited")
"""Modes that change the state server (and, for ``epoch_liar`` and ``hash_liar``, the record)."""


def arm_byzantine(mode: str, faults: FaultInjector, environ: Mapping[str, str] = os.environ) -> list[Fault]:
    """Arm on ``faults`` the ``call`` faults that make a peer misbehave as ``mode`` ("" = honest); the harness's
    peer (``testing.hostile_peer --byzantine MODE``) calls it before the peer starts. With
    ``$HIVETRAIN_TEST_STATE_CHUNK_BYTES`` set in ``environ`` (chaos scenarios) every peer, honest ones too, also
    gets a ``diloco.state_server`` fault that builds its state server with that chunk size.

    Returns:
        the armed faults (each fires every time its hook is hit; their ``fired`` counts show the mode acted).

    Raises:
        ValueError: an unknown mode, or a chunk size that is not an integer.
    """
    check_mode(mode)
    armed: list[Fault] = []
    if mode in WIRE_MODES:
        armed.append(Fault(HookPoint.AVERAGING_BEFORE_SEND, "call", callback=_wire_corruption(mode), times=0))
    if mode in INPUT_MODES:
        armed.append(Fault(HookPoint.DILOCO_ROUND_INPUT, "call", callback=_input_corruption(mode), times=0))
    chunk_text = environ.get(CHUNK_BYTES_ENV, "")
    if chunk_text and not chunk_text.isdigit():
        raise ValueError(f"${CHUNK_BYTES_ENV} = {chunk_text!r}: give the state chunk size in bytes, or unset it")
    lie = {"epoch_liar": _LieState, "hash_liar": _CurrentLie, "ahead_liar": _AheadLie}.get(mode, lambda: None)()
    if mode in SERVER_MODES or chunk_text:
        build = _server_builder(mode, int(chunk_text or 0), lie)
        armed.append(Fault(HookPoint.DILOCO_STATE_SERVER, "call", callback=build, times=0))
    if lie is not None:
        armed.append(Fault(HookPoint.DILOCO_RECORD, "call", callback=lie.record, times=0))
    return [faults.arm(fault) for fault in armed]


def _wire_corruption(mode: str) -> Callable[[dict[str, Any]], None]:
    """The ``averaging.before_send`` callback: corrupt our parts after local validation, as a hostile peer's modified
    client would (``flat``: our fp32 vector; ``frames``: peer id -> [meta dict, payload buffers])."""

    def corrupt(ctx: dict[str, Any]) -> None:
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

    return corrupt


def _input_corruption(mode: str) -> Callable[[dict[str, Any]], None]:
    """The ``diloco.round_input`` callback: what a byzantine peer averages instead of its ``tensors`` (fp32, its Δ or
    θ): new tensors, finite but hostile; the peer's own copy is untouched and its weight stays."""

    def corrupt(ctx: dict[str, Any]) -> None:
        if mode == "sign_flip":
            ctx["tensors"] = [t * -100.0 for t in ctx["tensors"]]
        elif mode == "huge_norm":
            ctx["tensors"] = [t * 1e6 + 1e3 for t in ctx["tensors"]]

    return corrupt


class _LieState:
    """The state an ``epoch_liar`` claims and serves: θ replaced by random weights (of the honest θ's shapes and
    scale), zero momentum, epoch ``LIE_EPOCH``; built once from the first honest state seen (``attach`` tells it
    where the peer's state is: its ``diloco.state_server`` hook)."""

    def __init__(self) -> None:
        self._get_state: Callable[[], TrainingState | None] = lambda: None
        self._lock = threading.Lock()
        self._built: tuple[TrainingState, str] | None = None

    def attach(self, get_state: Callable[[], TrainingState | None]) -> None:
        self._get_state = get_state

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

    def served(self) -> TrainingState | None:
        built = self.get()
        return None if built is None else built[0]

    def record(self, ctx: dict[str, Any]) -> None:
        """The ``diloco.record`` callback: claim ``LIE_EPOCH`` and the random state's hash (which the server serves)."""
        built = self.get()
        if built is not None:
            claim = {"epoch": LIE_EPOCH, "state_hash": built[1], "param_sketch": ""}
            ctx["record"] = ctx["record"].model_copy(
                update={**claim, "phase_epoch": LIE_EPOCH, "done_epoch": LIE_EPOCH}
            )


class _CurrentLie(_LieState):
    """The state a ``hash_liar`` claims and serves: random weights at the epoch its honest state is at, rebuilt at
    each new epoch, with a nonce in one momentum element drawn until the state's hash starts with "ff" (about 256
    tries). Each try hashes only the last tensor ``TrainingState.state_hash`` reads (``hashed_pieces``), from a copy
    of the digest of everything before it: drawing whole states took 7 s per epoch for the tiny model, and a liar
    whose record lagged its epoch by that long was no donor for a joiner that read the records meanwhile (CI, stop
    46)."""

    def get(self) -> tuple[TrainingState, str] | None:
        with self._lock:
            honest = self._get_state()
            if honest is None:
                return None
            if self._built is None or self._built[0].epoch != honest.epoch:
                gen = torch.Generator().manual_seed(13 + honest.epoch)
                params = {n: torch.randn(p.shape, generator=gen) * 3.0 for n, p in honest.params.items()}
                lie = TrainingState(honest.epoch, params, {n: torch.zeros_like(p) for n, p in params.items()})
                self._built = (lie, _hash_sorting_first(lie))
            return self._built

    def record(self, ctx: dict[str, Any]) -> None:
        """The ``diloco.record`` callback: our real epoch, the random state's hash; the honest θ sketch is kept."""
        built = self.get()
        if built is not None and ctx["record"].epoch == built[0].epoch:
            ctx["record"] = ctx["record"].model_copy(update={"state_hash": built[1]})


def _hash_sorting_first(state: TrainingState, prefix: str = "ff") -> str:
    """Set a nonce in the first element of ``state``'s last momentum tensor until ``state.state_hash()`` starts with
    ``prefix``; returns that hash. Each try hashes only that tensor's bytes, the last of ``hashed_pieces``, from a copy
    of the digest of every piece before it."""
    *_, (_, last) = state.momentum.items()
    *head_pieces, _ = state.hashed_pieces()
    head = hashlib.sha256()
    for piece in head_pieces:
        head.update(piece)
    flat, nonce, found = last.view(-1), 0, ""
    while not found.startswith(prefix):
        nonce += 1
        flat[0] = float(nonce)
        digest = head.copy()
        digest.update(flat.view(torch.uint8).numpy())
        found = digest.hexdigest()
    return found


class _AheadLie(_LieState):
    """The state an ``ahead_liar`` claims and serves: random weights x5 at one epoch past its honest state, seeded by
    that epoch (colluders agree), rebuilt as the honest epoch moves."""

    def get(self) -> tuple[TrainingState, str] | None:
        with self._lock:
            honest = self._get_state()
            if honest is None:
                return None
            if self._built is None or self._built[0].epoch != honest.epoch + 1:
                gen = torch.Generator().manual_seed(29 + honest.epoch)
                params = {n: torch.randn(p.shape, generator=gen) * 5.0 for n, p in honest.params.items()}
                lie = TrainingState(honest.epoch + 1, params, {n: torch.zeros_like(p) for n, p in params.items()})
                self._built = (lie, lie.state_hash())
            return self._built

    def record(self, ctx: dict[str, Any]) -> None:
        """The ``diloco.record`` callback: claim one epoch ahead with the poisoned state's hash."""
        built = self.get()
        if built is not None:
            claim = {"epoch": built[0].epoch, "state_hash": built[1], "param_sketch": ""}
            ctx["record"] = ctx["record"].model_copy(update=claim)


class AnyoneServer(StateServer):
    """A state server that answers anyone (its peer has no roster, so ``admits`` stays None) and logs each requester
    (``SERVED_MARKER``)."""

    async def _handle(self, info, reader, writer) -> None:
        logger.warning("%s %s", SERVED_MARKER, getattr(info, "peer_id", ""))
        await super()._handle(info, reader, writer)


def _server_builder(mode: str, chunk_bytes: int, lie: _LieState | None) -> Callable[[dict[str, Any]], None]:
    """The ``diloco.state_server`` callback: replace the peer's ``server`` with the one a peer in ``mode`` runs
    (``chunk_bytes`` > 0: with that chunk size), built on its ``get_state`` and ``faults``."""

    def build(ctx: dict[str, Any]) -> None:
        get_state = ctx["get_state"]
        kwargs: dict[str, Any] = {"faults": ctx["faults"]}
        if chunk_bytes:
            kwargs["chunk_bytes"] = chunk_bytes
        if lie is not None:
            lie.attach(get_state)
            ctx["server"] = StateServer(lie.served, **kwargs)
            return
        server_class = {"nan_donor": NaNChunks, "drip_donor": Dripper, "uninvited": AnyoneServer}.get(mode, StateServer)
        ctx["server"] = server_class(corrupt_served_state(mode, get_state), **kwargs)

    return build


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
