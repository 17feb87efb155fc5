"""The DiLoCo peer builder (``hivetrain.diloco.builder``): peers assembled in-process, with no CLI around them."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hivetrain.config import load_run_config
from hivetrain.data import load_corpus
from hivetrain.diloco.builder import build_peer
from hivetrain.diloco.options import TrainerOptions
from hivetrain.peers.records import IncompatibleRun, publish_record
from tests.records import peer_record

RUN = {
    "run_id": "built",
    "model": "tiny",
    "data.seq_len": 32,
    "data.batch_size": 4,
    "data.num_eval_windows": 4,
    "data.max_corpus_bytes": 300_000,
    "diloco.schedule": "steps",
    "diloco.inner_steps": 5,
    "diloco.warmup_steps": 2,
    "diloco.outer_steps": 2,
    "averaging.matchmaking_time_s": 2.0,
    "averaging.round_timeout_s": 30.0,
}
OPTIONS = TrainerOptions(record_interval_s=1.0, record_ttl_s=10.0)


def _outer_steps_into(events: list[dict]):
    """An ``on_event`` that keeps a peer's outer_step events."""

    def record(event: dict) -> None:
        if event["event"] == "outer_step":
            events.append(event)

    return record


@pytest.mark.slow
def test_two_peers_built_in_process_agree_bit_for_bit_after_two_outer_steps(make_node):
    """Acceptance of issue 27: two DiLoCo peers built with the builder on one DHT train 2 outer steps together and
    hold the same state hash at every epoch (about 5 s here; issue 27 asks under 20 s: a figure, not an assertion)."""
    config = load_run_config(None, RUN)
    corpus = load_corpus(config.data)  # read once: both peers' streams come from it (seeded by their peer ids)
    first = make_node()
    second = make_node(first.visible_maddrs())
    peers, steps = [], {first.peer_id: [], second.peer_id: []}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two trainers share this process's cores
    try:
        for node in (first, second):
            node.guard_run(config.run_id)
            record = _outer_steps_into(steps[node.peer_id])
            peers.append(build_peer(config, node, options=OPTIONS, corpus=corpus, check_memory=False, on_event=record))
        errors: list[BaseException] = []

        def run(peer) -> None:
            try:
                peer.run()
            except BaseException as exc:  # noqa: BLE001 - reported by the test below
                errors.append(exc)

        workers = [threading.Thread(target=run, args=(peer,), daemon=True) for peer in peers]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=60)
        assert not errors, errors
        assert not any(w.is_alive() for w in workers), "a peer did not finish its 2 outer steps within 60 s"
    finally:
        torch.set_num_threads(threads)
        for peer in peers:
            peer.trainer.stop()
            peer.close()
    hashes = [peer.trainer.stats.state_hashes for peer in peers]
    assert sorted(hashes[0]) == sorted(hashes[1]) == [0, 1, 2]
    assert hashes[0] == hashes[1]  # one model: the same θ and outer momentum at every epoch
    for events in steps.values():  # both outer steps averaged the pair
        assert [(e["epoch"], e["group_size"]) for e in events] == [(1, 2), (2, 2)], events


@pytest.mark.slow
def test_the_builder_refuses_a_model_other_than_the_swarms_and_leaves_nothing_running(make_node):
    config = load_run_config(None, RUN)
    corpus = load_corpus(config.data)
    elder = make_node()
    elder.guard_run(config.run_id)
    record = peer_record(elder.peer_id, run_id=config.run_id, model_fingerprint="e" * 64, updated_at=time.time())
    assert publish_record(elder.dht, elder.owner_marker, record, 60)  # a peer of the run training another model
    node = make_node(elder.visible_maddrs())
    node.guard_run(config.run_id)
    before = set(threading.enumerate())
    with pytest.raises(IncompatibleRun, match="trains a different model"):
        build_peer(config, node, options=OPTIONS, corpus=corpus, check_memory=False)
    assert set(threading.enumerate()) <= before  # refused before the averager or the loop started
