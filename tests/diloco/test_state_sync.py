"""State download between real peers on loopback: parallel chunks from agreeing donors, hash checks, bad donors."""

import pytest
import torch

from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_sync import StateDownloadFailed, StateServer, download_state
from hivetrain.faults import Fault, FaultInjector
from hivetrain.peers.loop import LoopThread


def _state(epoch, seed, n=300_000):
    gen = torch.Generator().manual_seed(seed)
    params = {"a": torch.randn(n, generator=gen), "b": torch.randn(7, 3, generator=gen)}
    return TrainingState(
        epoch=epoch, params=params, momentum={k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
    )


@pytest.fixture
def loop():
    lt = LoopThread()
    yield lt
    lt.stop()


def _serve(loop, node, state, chunk_bytes=256 * 1024, faults=None):
    server = StateServer(lambda: state, chunk_bytes=chunk_bytes, **({"faults": faults} if faults else {}))
    p2p = loop.run(node.dht.replicate_p2p(), 30)
    loop.run(server.register(p2p, "run"), 30)
    return server


def test_download_spreads_chunks_over_agreeing_donors_and_verifies_hash(make_node, loop):
    donors = [make_node(name="d0")]
    donors.append(make_node(donors[0].visible_maddrs(), name="d1"))
    joiner = make_node(donors[0].visible_maddrs(), name="j")
    good = _state(3, seed=1)
    servers = [_serve(loop, d, good) for d in donors]
    reference = _state(0, seed=99)
    p2p = loop.run(joiner.dht.replicate_p2p(), 30)
    got = loop.run(download_state(p2p, "run", [d.peer_id for d in donors], {3: good.state_hash()}, reference, 10), 60)
    assert got.epoch == 3 and got.state_hash() == good.state_hash()
    assert all(s.bytes_served > 0 for s in servers), "both donors should serve chunks"
    assert sum(s.bytes_served for s in servers) == good.num_bytes()


def test_donor_with_unpublished_state_is_refused(make_node, loop):
    donor = make_node(name="d0")
    joiner = make_node(donor.visible_maddrs(), name="j")
    _serve(loop, donor, _state(3, seed=2))
    p2p = loop.run(joiner.dht.replicate_p2p(), 30)
    with pytest.raises(StateDownloadFailed, match="published"):
        loop.run(download_state(p2p, "run", [donor.peer_id], {3: "0" * 64}, _state(0, seed=9), 10), 60)


def test_donor_dying_mid_download_hands_its_chunks_to_the_others(make_node, loop):
    donors = [make_node(name="d0")]
    donors.append(make_node(donors[0].visible_maddrs(), name="d1"))
    joiner = make_node(donors[0].visible_maddrs(), name="j")
    good = _state(2, seed=3)
    faults = FaultInjector()
    fault = faults.arm(Fault("state.mid_download", "call", callback=lambda ctx: donors[1].shutdown(), times=1))
    for d in donors:
        _serve(loop, d, good)
    p2p = loop.run(joiner.dht.replicate_p2p(), 30)
    got = loop.run(
        download_state(
            p2p, "run", [d.peer_id for d in donors], {2: good.state_hash()}, _state(0, seed=9), 5, faults=faults
        ),
        90,
    )
    assert fault.fired == 1
    assert got.state_hash() == good.state_hash()
