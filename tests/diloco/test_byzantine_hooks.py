"""Byzantine peers are faults armed at production hook points: ``hivetrain.diloco`` never imports the fault harness.

``hivetrain.testing.byzantine.arm_byzantine`` turns a ``hostile_peer --byzantine MODE`` into ``call`` faults on the
peer's FaultInjector; each test hits the hook the way production code does and checks what the mode did to it.
"""

import ast
from pathlib import Path

import pytest
import torch

import hivetrain.diloco
from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_sync import StateServer
from hivetrain.faults import FaultInjector, HookPoint
from hivetrain.testing.byzantine import (
    CHUNK_BYTES_ENV,
    LIE_EPOCH,
    MODES,
    AnyoneServer,
    arm_byzantine,
)
from hivetrain.testing.hostile_donors import Dripper, NaNChunks
from tests.records import peer_record

DILOCO = Path(hivetrain.diloco.__file__).parent


def _imports(path: Path) -> set[str]:
    """Every hivetrain module ``path`` imports, at the top or inside a function (``from a import b``: a and a.b)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n.startswith("hivetrain.")}


def test_diloco_modules_import_nothing_from_the_fault_harness_even_indirectly():
    """Follows every hivetrain import from each hivetrain.diloco module (source only: no subprocess, no torch), up to
    the command-line entry points (``hivetrain.cli``: ``node_launch`` starts ``join_swarm.main``), which are where the
    harness arms its faults."""
    root = DILOCO.parent.parent
    todo = [(f"hivetrain.diloco.{p.stem}", ()) for p in DILOCO.glob("*.py")]
    seen: set[str] = set()
    while todo:
        module, chain = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        assert not module.startswith("hivetrain.testing"), " -> ".join((*chain, module))
        base = root / module.replace(".", "/")
        path = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        if path.exists() and not module.startswith("hivetrain.cli."):  # else a name in a module: m is followed
            todo.extend((name, (*chain, module)) for name in _imports(path))
    assert "hivetrain.diloco.trainer" in seen and "hivetrain.faults" in seen


def _state(epoch=3):
    gen = torch.Generator().manual_seed(epoch)
    params = {"w": torch.randn(64, generator=gen), "b": torch.randn(4, generator=gen)}
    return TrainingState(epoch, params, {n: torch.zeros_like(p) for n, p in params.items()})


def _server_hook(faults, state):
    """What DilocoTrainer does: offer its honest server at ``diloco.state_server``; returns the one it will run."""
    get_state = lambda: state  # noqa: E731
    honest = StateServer(get_state, faults=faults)
    return faults.check(HookPoint.DILOCO_STATE_SERVER, server=honest, get_state=get_state, faults=faults)["server"]


def test_an_honest_peer_arms_nothing_and_keeps_its_server():
    faults = FaultInjector()
    assert arm_byzantine("", faults, environ={}) == []
    state = _state()
    server = _server_hook(faults, state)
    assert type(server) is StateServer and server.get_state() is state


def test_in_a_chaos_scenario_every_peer_serves_the_scenario_chunk_size():
    faults = FaultInjector()
    (chunking,) = arm_byzantine("", faults, environ={CHUNK_BYTES_ENV: "65536"})
    server = _server_hook(faults, _state())
    assert type(server) is StateServer and server.chunk_bytes == 65536 and chunking.fired == 1
    with pytest.raises(ValueError, match=CHUNK_BYTES_ENV):
        arm_byzantine("", FaultInjector(), environ={CHUNK_BYTES_ENV: "lots"})


@pytest.mark.parametrize(
    ("mode", "server_class"),
    [("nan_donor", NaNChunks), ("drip_donor", Dripper), ("uninvited", AnyoneServer), ("bad_donor", StateServer)],
)
def test_state_server_modes_replace_the_server(mode, server_class):
    faults = FaultInjector()
    arm_byzantine(mode, faults, environ={})
    state = _state()
    server = _server_hook(faults, state)
    assert type(server) is server_class and server.faults is faults
    served = server.get_state()
    if mode == "bad_donor":  # the genuine epoch, other bytes
        assert served.epoch == state.epoch and served.state_hash() != state.state_hash()
    else:
        assert served is state


def test_an_epoch_liar_serves_random_weights_and_publishes_their_hash_at_a_far_epoch():
    faults = FaultInjector()
    arm_byzantine("epoch_liar", faults, environ={})
    record = peer_record("liar", epoch=3, state_hash="honest")
    assert faults.check(HookPoint.DILOCO_RECORD, record=record)["record"] is record  # no state offered yet
    state = _state()
    server = _server_hook(faults, state)
    lie = server.get_state()
    assert lie.epoch == LIE_EPOCH and lie.params.keys() == state.params.keys()
    published = faults.check(HookPoint.DILOCO_RECORD, record=record)["record"]
    assert (published.epoch, published.phase_epoch, published.done_epoch) == (LIE_EPOCH,) * 3
    assert published.state_hash == lie.state_hash() and published.peer_id == "liar"


def test_a_hash_liar_claims_its_epoch_with_a_hash_sorting_first_and_rebuilds_the_lie_at_each_epoch():
    faults = FaultInjector()
    arm_byzantine("hash_liar", faults, environ={})
    honest = {"state": _state(epoch=3)}
    get_state = lambda: honest["state"]  # noqa: E731 - the trainer's current state, as its hook offers it
    offered = StateServer(get_state, faults=faults)
    server = faults.check(HookPoint.DILOCO_STATE_SERVER, server=offered, get_state=get_state, faults=faults)["server"]
    hashes = []
    for epoch in (3, 4):
        honest["state"] = _state(epoch)
        lie = server.get_state()
        record = faults.check(HookPoint.DILOCO_RECORD, record=peer_record("liar", epoch=epoch, state_hash="h"))
        published = record["record"]
        # its own, current epoch; the hash of the random state it serves, which sorts above any honest hash but 1/256
        assert lie.epoch == published.epoch == epoch and published.state_hash == lie.state_hash()
        assert published.state_hash.startswith("ff") and lie.params.keys() == honest["state"].params.keys()
        assert not any(torch.equal(lie.params[n], p) for n, p in honest["state"].params.items())
        hashes.append(published.state_hash)
    assert hashes[0] != hashes[1]


def _wire(mode):
    """Hit ``averaging.before_send`` as allreduce does; returns (our flat vector, frames) as the mode left them."""
    faults = FaultInjector()
    arm_byzantine(mode, faults, environ={})
    flat = torch.ones(8)
    frames = {"peer": [{"w": 10.0}, [memoryview(bytes(16))]]}
    faults.check(
        HookPoint.AVERAGING_BEFORE_SEND, epoch=1, peer="me", round_id="r", subround=0, flat=flat, frames=frames
    )
    return flat, frames["peer"]


def test_wire_modes_corrupt_what_goes_on_the_wire():
    assert torch.isnan(_wire("nan")[0]).all() and torch.isinf(_wire("inf")[0]).all()
    assert _wire("inflated_weight")[1][0]["w"] == 10.0 * 1e6 + 1e9
    assert _wire("negative_weight")[1][0]["w"] < 0
    assert sum(len(b) for b in _wire("wrong_shape")[1][1]) == 12


def test_every_mode_arms_call_faults_and_unknown_modes_are_refused():
    for mode in MODES:
        armed = arm_byzantine(mode, FaultInjector(), environ={})
        assert armed, mode
        assert all(f.action == "call" and f.times == 0 for f in armed)
    with pytest.raises(ValueError, match="unknown byzantine mode 'evil'; choose one of nan"):
        arm_byzantine("evil", FaultInjector(), environ={})
