"""State download between real peers on loopback: parallel chunks from agreeing donors, hash checks, bad donors."""

import time

import pytest
import torch
from hivemind.p2p import PeerID

from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_file import write_state_file
from hivetrain.diloco.state_sync import StateDownloadFailed, StateServer, download_state, fetch_state
from hivetrain.diloco.state_wire import recv_control, send_control
from hivetrain.faults import Fault, FaultInjector
from hivetrain.peers.loop import LoopThread
from hivetrain.testing.hostile_donors import Dripper, Liar, NaNChunks, SilentMeta, lie_about_hash


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


@pytest.mark.slow
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
    assert sum(s.bytes_served for s in servers) >= good.num_bytes()  # more if a lagging chunk was re-requested


@pytest.mark.slow
def test_donor_with_unpublished_state_is_refused(make_node, loop):
    donor = make_node(name="d0")
    joiner = make_node(donor.visible_maddrs(), name="j")
    _serve(loop, donor, _state(3, seed=2))
    p2p = loop.run(joiner.dht.replicate_p2p(), 30)
    with pytest.raises(StateDownloadFailed, match="published"):
        loop.run(download_state(p2p, "run", [donor.peer_id], {3: "0" * 64}, _state(0, seed=9), 10), 60)


@pytest.mark.slow
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


# ---- issue 12, finding 3: a joiner routes around bad donors --------------------------------------------------------

CHUNK = 256 * 1024


def _swarm(make_node, loop, count):
    nodes = [make_node(name="n0")]
    nodes += [make_node(nodes[0].visible_maddrs(), name=f"n{i}") for i in range(1, count)]
    return nodes


def _register(loop, node, server):
    p2p = loop.run(node.dht.replicate_p2p(), 30)
    loop.run(server.register(p2p, "run"), 30)
    return server


def _fetch(loop, joiner, donors, expected, timeout_s=30.0, reference=None, **kwargs):
    p2p = loop.run(joiner.dht.replicate_p2p(), 30)
    start = time.monotonic()
    peers = [d.peer_id for d in donors]
    reference = reference or _state(0, seed=9)
    result = loop.run(fetch_state(p2p, "run", peers, expected, reference, timeout_s, **kwargs), 120)
    return result, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("manifest", ["honest", "lying"])
def test_nan_donor_first_among_three_honest_does_not_stop_the_first_download(make_node, loop, manifest):
    # the attacker is first in the donor list (the order decide_sync gives and the old code trusted)
    nodes = _swarm(make_node, loop, 5)
    attacker, honest, joiner = nodes[0], nodes[1:4], nodes[4]
    good = _state(3, seed=1)
    servers = [_register(loop, d, StateServer(lambda: good, chunk_bytes=CHUNK)) for d in honest]
    if manifest == "honest":
        bad = _register(loop, attacker, NaNChunks(lambda: good, chunk_bytes=CHUNK))
    else:  # serves a NaN state under the published hash, with a manifest that matches the NaN chunks
        nan_state = _state(3, seed=1)
        nan_state.params["a"].fill_(float("nan"))
        faults, lie = lie_about_hash(good.state_hash())
        bad = _register(loop, attacker, Liar(lambda: nan_state, chunk_bytes=CHUNK, faults=faults))
    reported = []
    p2p = loop.run(joiner.dht.replicate_p2p(), 30)
    got = loop.run(
        download_state(
            p2p,
            "run",
            [attacker.peer_id] + [d.peer_id for d in honest],
            {3: good.state_hash()},
            _state(0, seed=9),
            30,
            on_bad_donor=lambda peer, reason: reported.append(peer),
        ),
        60,
    )
    assert got.state_hash() == good.state_hash()
    assert sum(s.bytes_served for s in servers) >= good.num_bytes()
    if manifest == "honest":
        assert bad.served_nan >= 1 and reported == [attacker.peer_id]
    else:
        assert lie.fired >= 1 and bad.bytes_served == 0  # three donors outvote its manifest: never downloaded


@pytest.mark.slow
@pytest.mark.parametrize("lie", ["finite", "nan"])
def test_a_lying_manifest_is_refused_and_another_donors_is_used(make_node, loop, lie):
    # two sybils offer one false manifest for the published hash, so it is tried first (2 donors against 1)
    nodes = _swarm(make_node, loop, 4)
    sybils, honest, joiner = nodes[:2], nodes[2], nodes[3]
    good = _state(3, seed=1)
    fake = good.clone()
    fake.params["a"][0] = float("nan") if lie == "nan" else fake.params["a"][0] + 1.0  # chunk 0 differs
    faults, fault = lie_about_hash(good.state_hash())
    for sybil in sybils:
        _register(loop, sybil, Liar(lambda: fake, chunk_bytes=CHUNK, faults=faults))
    server = _register(loop, honest, StateServer(lambda: good, chunk_bytes=CHUNK))
    result, _ = _fetch(loop, joiner, sybils + [honest], {3: good.state_hash()})
    assert fault.fired >= 2
    assert result.state.state_hash() == good.state_hash()
    assert result.manifests_refuted == 1 and set(result.bad_donors) == {s.peer_id for s in sybils}
    if lie == "finite":  # refuted at the end; every chunk both manifests agree on is kept
        assert server.bytes_served == CHUNK
    else:  # refuted by the first NaN chunk, before the rest of the lie was downloaded
        assert "NaN" in next(iter(result.bad_donors.values()))


@pytest.mark.slow
def test_a_dripping_donor_costs_about_one_chunk_not_a_network_timeout(make_node, loop):
    nodes = _swarm(make_node, loop, 4)
    donors, joiner = nodes[:3], nodes[3]
    good = _state(3, seed=1, n=1_000_000)  # 8 MB, 31 chunks
    _register(loop, donors[0], StateServer(lambda: good, chunk_bytes=CHUNK))
    _register(loop, donors[1], StateServer(lambda: good, chunk_bytes=CHUNK))
    honest_result, honest_s = _fetch(loop, joiner, donors[:2], {3: good.state_hash()}, reference=good)
    dripper = _register(loop, donors[2], Dripper(lambda: good, chunk_bytes=CHUNK))
    result, drip_s = _fetch(loop, joiner, [donors[2]] + donors[:2], {3: good.state_hash()}, reference=good)
    assert result.state.state_hash() == good.state_hash() == honest_result.state.state_hash()
    assert dripper.drips >= 1, "the dripper must have been given a chunk"
    assert drip_s < 2 * honest_s + 1.0, f"dripper: {drip_s:.2f} s, honest: {honest_s:.2f} s"
    assert result.bad_donors == {}  # slow is not malicious: dropped or outrun, never reported for a ban


@pytest.mark.slow
def test_a_donor_that_never_answers_the_manifest_request_holds_nobody_up(make_node, loop):
    nodes = _swarm(make_node, loop, 3)
    good = _state(3, seed=1)
    silent = _register(loop, nodes[0], SilentMeta(lambda: good, chunk_bytes=CHUNK))
    _register(loop, nodes[1], StateServer(lambda: good, chunk_bytes=CHUNK))
    result, elapsed_s = _fetch(loop, nodes[2], nodes[:2], {3: good.state_hash()}, timeout_s=30.0)
    assert silent.stalls == 1 and result.state.state_hash() == good.state_hash()
    assert elapsed_s < 10.0, f"{elapsed_s:.1f} s: waited for the silent donor"  # meta_grace_s = 2 s, not 30 s
    assert nodes[0].peer_id in result.dropped_donors and not result.bad_donors


@pytest.mark.slow
def test_a_joiner_with_stale_records_gets_the_previous_epoch(make_node, loop):
    donor, first, joiner = _swarm(make_node, loop, 3)
    states = {3: _state(3, seed=1), 4: _state(4, seed=2)}
    current = [states[3]]
    _register(loop, donor, StateServer(lambda: current[0], chunk_bytes=CHUNK))
    result, _ = _fetch(loop, first, [donor], {3: states[3].state_hash()})  # the donor serves epoch 3
    assert result.state.epoch == 3
    current[0] = states[4]  # it commits epoch 4; a joiner that read the records before still expects epoch 3
    result, _ = _fetch(loop, joiner, [donor], {3: states[3].state_hash()})
    assert result.state.epoch == 3 and result.state.state_hash() == states[3].state_hash()


@pytest.mark.slow
def test_a_download_survives_the_donor_moving_two_epochs_ahead_mid_way(make_node, loop):
    donor, joiner = _swarm(make_node, loop, 2)
    states = [_state(e, seed=e) for e in (3, 4, 5)]
    current = [states[0]]
    server = _register(loop, donor, StateServer(lambda: current[0], chunk_bytes=CHUNK))

    def advance(ctx):
        for state in states[1:]:
            current[0] = state
            server.observe()

    faults = FaultInjector()
    fault = faults.arm(Fault("state.mid_download", "call", callback=advance, times=1))
    result, _ = _fetch(loop, joiner, [donor], {3: states[0].state_hash()}, faults=faults)
    assert fault.fired == 1 and result.state.state_hash() == states[0].state_hash()


@pytest.mark.slow
def test_a_donor_at_its_downloader_cap_refuses_one_more_and_the_joiner_takes_the_others_chunks(make_node, loop):
    """``max_downloaders=1``: while one peer holds a chunk stream open, a second peer's chunk request is answered
    "busy" (its manifest still is); a joiner that finds that donor busy completes from the other holder, without
    banning it; once the first peer's stream closes the donor serves again."""
    capped_node, other_node, first, joiner = _swarm(make_node, loop, 4)
    good = _state(5, seed=4)
    capped = _register(loop, capped_node, StateServer(lambda: good, chunk_bytes=256 * 1024, max_downloaders=1))
    other = _serve(loop, other_node, good)
    manifest = capped._manifests()[-1].manifest
    holder_p2p = loop.run(first.dht.replicate_p2p(), 30)

    async def hold_a_chunk_stream():
        _, reader, writer = await holder_p2p.call_binary_stream_handler(
            PeerID.from_base58(capped_node.peer_id), "run.state"
        )
        await send_control(writer, {"op": "chunk", "epoch": 5, "state_hash": manifest.state_hash, "index": 0})
        header = await recv_control(reader, 10)
        await reader.readexactly(header["num_bytes"])
        return writer

    held = loop.run(hold_a_chunk_stream(), 30)
    result, _ = _fetch(loop, joiner, [capped_node, other_node], {5: good.state_hash()})
    assert result.state is not None and result.state.state_hash() == good.state_hash()
    assert capped.requests_busy >= 1 and not result.bad_donors
    assert "busy" in result.dropped_donors.get(capped_node.peer_id, "")
    assert other.bytes_served >= good.num_bytes() - capped.bytes_served
    held.close()
    deadline = time.monotonic() + 10
    while capped._downloaders and time.monotonic() < deadline:  # the donor sees the stream close
        time.sleep(0.05)
    again, _ = _fetch(loop, joiner, [capped_node], {5: good.state_hash()})
    assert again.state is not None and again.state.state_hash() == good.state_hash()


def test_snapshots_are_references_and_bounded():
    states = [_state(e, seed=e, n=1000) for e in range(6)]
    current = [states[0]]
    server = StateServer(lambda: current[0], chunk_bytes=4096, keep_epochs=3)
    for state in states:
        current[0] = state
        server.observe()
    snapshots = server._manifests()
    assert len(snapshots) == 3 and all(s.state is t for s, t in zip(snapshots, states[3:], strict=True))


def test_a_hash_the_owner_already_computed_is_not_computed_again(monkeypatch):
    """The trainer hashes every new state; its server takes that hash for the manifest instead of a second pass."""
    states = [_state(e, seed=e, n=1000) for e in range(2)]
    known = {id(states[0]): states[0].state_hash()}
    current = [states[0]]
    server = StateServer(lambda: current[0], chunk_bytes=4096, known_hash=lambda s: known.get(id(s)))
    hashed = []
    original = TrainingState.state_hash
    monkeypatch.setattr(TrainingState, "state_hash", lambda self: hashed.append(self.epoch) or original(self))
    (snapshot,) = server._manifests()
    assert hashed == [] and snapshot.manifest.state_hash == known[id(states[0])]
    current[0] = states[1]  # a state the owner has no hash for: hashed here
    assert [s.manifest.state_hash for s in server._manifests()][-1] == original(states[1]) and hashed == [1]


@pytest.mark.slow
def test_a_state_modified_in_place_after_hashing_is_not_served(make_node, loop):
    nodes = _swarm(make_node, loop, 3)
    good = _state(3, seed=1)
    mutable = good.clone()
    mutated = _register(loop, nodes[0], StateServer(lambda: mutable, chunk_bytes=CHUNK))
    _register(loop, nodes[1], StateServer(lambda: good, chunk_bytes=CHUNK))

    def mutate(ctx):
        mutable.params["a"].add_(1.0)  # an owner that breaks the no-in-place contract after the manifest went out

    faults = FaultInjector()
    faults.arm(Fault("state.before_serve", "call", callback=mutate, times=1))
    mutated.faults = faults
    result, _ = _fetch(loop, nodes[2], nodes[:2], {3: good.state_hash()})
    assert result.state.state_hash() == good.state_hash()
    assert mutated.chunks_refused >= 1 and result.bad_donors == {}


@pytest.mark.slow
def test_a_long_download_logs_its_progress_with_rate_and_time_left(make_node, loop, monkeypatch, caplog):
    """Issue 26 item 3: a GB-sized state takes minutes; the joiner's log says how far it is (here every chunk)."""
    from hivetrain.diloco import state_fetch

    monkeypatch.setattr(state_fetch, "PROGRESS_EVERY_S", 0.0)
    donor = make_node(name="d0")
    joiner = make_node(donor.visible_maddrs(), name="j")
    good = _state(3, seed=4)
    _serve(loop, donor, good, chunk_bytes=256 * 1024)
    p2p = loop.run(joiner.dht.replicate_p2p(), 30)
    with caplog.at_level("INFO", logger=state_fetch.logger.name):
        got = loop.run(download_state(p2p, "run", [donor.peer_id], {3: good.state_hash()}, _state(0, seed=9), 10), 60)
    assert got.state_hash() == good.state_hash()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("state download: epoch 3")]
    chunks = -(-good.num_bytes() // (256 * 1024))
    assert len(lines) == chunks - 1, lines  # one per chunk but the last (the download's end is logged elsewhere)
    shares = [float(line.split("%")[0].rsplit(" ", 1)[1]) for line in lines]
    assert shares == sorted(shares) and 0 < shares[0] and shares[-1] < 100
    assert all(" MB/s, " in line and ("s left" in line or "no rate yet" in line) for line in lines)


@pytest.mark.slow
def test_a_state_on_disk_is_served_and_downloaded_into_a_file_chunk_by_chunk(make_node, loop, tmp_path):
    """Issue 24 item 4: the coordinator of a model larger than its memory serves its state from a file and downloads
    the next one into a file; a joiner holding the state in memory gets the same bytes from it."""
    from hivetrain.diloco.state_file import StateFile, meta_reference, write_state_file

    donor = make_node(name="d0")
    coordinator = make_node(donor.visible_maddrs(), name="c")
    joiner = make_node(donor.visible_maddrs(), name="j")
    good = _state(4, seed=5)
    _serve(loop, donor, good)
    meta = meta_reference(good)
    p2p = loop.run(coordinator.dht.replicate_p2p(), 30)
    expected = {4: good.state_hash()}
    got = loop.run(download_state(p2p, "run", [donor.peer_id], expected, meta, 10, into=tmp_path / "s.safetensors"), 60)
    assert isinstance(got, StateFile) and got.state_hash() == good.state_hash() and got.epoch == 4

    served = _serve(loop, coordinator, got)
    again = loop.run(download_state(loop.run(joiner.dht.replicate_p2p(), 30), "run", [coordinator.peer_id],
                                    expected, _state(0, seed=9), 10), 60)  # fmt: skip
    assert isinstance(again, TrainingState) and again.state_hash() == good.state_hash()
    assert served.bytes_served == good.num_bytes()

    # a donor whose manifest claims the published hash for other bytes: every chunk is written, the whole file is
    # hashed, refuted, and removed
    liar = write_state_file(_state(4, seed=6), tmp_path / "liar.safetensors")
    faults, fault = lie_about_hash(good.state_hash())
    _register(loop, joiner, Liar(lambda: liar, chunk_bytes=CHUNK, faults=faults))
    with pytest.raises(StateDownloadFailed, match="1 bad"):
        loop.run(download_state(p2p, "run", [joiner.peer_id], expected, meta, 10, into=tmp_path / "x.safetensors"), 60)
    assert fault.fired >= 1 and not (tmp_path / "x.safetensors").exists()  # a failed download leaves no file


@pytest.mark.slow
def test_zero_chunks_of_the_state_are_written_by_the_downloader_not_sent_by_donors(make_node, loop, tmp_path):
    """Outer momentum at μ = 0 is all zeros: a follower pulled 100.7 MB per epoch for a 50 MB model from volunteers'
    uplinks. Chunks whose manifest hash is that of zeros are filled locally; the state still verifies as a whole."""
    donor = make_node(name="d0")
    joiner = make_node(donor.visible_maddrs(), name="j")
    theta = _state(5, seed=7)
    good = TrainingState(
        epoch=5, params=theta.params, momentum={k: torch.zeros_like(v) for k, v in theta.params.items()}
    )
    server = _serve(loop, donor, good, chunk_bytes=CHUNK)
    half = good.num_bytes() // 2  # θ, then the momentum
    for into in (None, tmp_path / "s.safetensors"):
        before = server.bytes_served
        result, _ = _fetch(loop, joiner, [donor], {5: good.state_hash()}, into=into)
        assert result.state.state_hash() == good.state_hash()
        sent = server.bytes_served - before
        assert half <= sent < half + CHUNK  # θ's chunks and the one that straddles θ and the momentum


@pytest.mark.slow
def test_chunks_of_the_state_we_hold_are_copied_not_fetched_and_a_false_local_copy_changes_nothing(
    make_node, loop, tmp_path
):
    """Fragments (Streaming DiLoCo) change one fragment's θ and momentum per epoch: a follower or peer an epoch behind
    already holds the rest. Chunks whose manifest hash our own state's bytes have are copied from it (in memory or on
    disk); the assembled state is still checked against the published hash."""
    donor = make_node(name="d0")
    joiner = make_node(donor.visible_maddrs(), name="j")
    old = _state(5, seed=7)
    gen = torch.Generator().manual_seed(8)
    changed = {"b": torch.randn(7, 3, generator=gen)}  # the epoch's fragment: 21 of 300,021 parameters
    new = TrainingState(6, {**old.params, **changed}, {**old.momentum, "b": torch.randn(7, 3, generator=gen)})
    server = _serve(loop, donor, new, chunk_bytes=CHUNK)
    on_disk = write_state_file(old, tmp_path / "old.safetensors")
    for local in (old, on_disk):
        before = server.bytes_served
        result, _ = _fetch(loop, joiner, [donor], {6: new.state_hash()}, local=local)
        assert result.state.state_hash() == new.state_hash()
        assert server.bytes_served - before <= 2 * CHUNK  # the chunk holding θ_b and the one holding its momentum
    other = _state(5, seed=11)  # a local state that shares nothing: every chunk comes from the donor
    before = server.bytes_served
    result, _ = _fetch(loop, joiner, [donor], {6: new.state_hash()}, local=other)
    assert result.state.state_hash() == new.state_hash() and server.bytes_served - before == new.num_bytes()
