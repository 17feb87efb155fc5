"""A group member process killed at each averaging hook point (an armed ``exit`` fault: ``os._exit(137)``, no cleanup,
like SIGKILL): the survivors drop it and commit in the same call (issue 23), bit-identical, their inputs unchanged:
their own mean, plus its part in the slices reduced before it died. Killed holding the full result, when the
survivors may already have voted, it may instead leave them failing (the two-phase-commit gap); then a retry
without the dead peer commits."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import threading
import time

import psutil
import pytest
import torch

from hivetrain.averaging import AveragingConfig, RoundFailed, RoundResult

from .conftest import LOOPBACK, run_threads

CONFIG = dict(target_group_size=3, matchmaking_time_s=1.0, part_timeout_s=2.0, commit_timeout_s=2.0, drop_failed=True,
              connect_timeout_s=2.0)  # fmt: skip
NUM_ELEMENTS = 1_000_000
PATIENCE_S = 10.0  # how long past the window the group waits for a member not yet ready
POINTS = ["averaging.before_send", "averaging.mid_transfer", "averaging.after_reduce", "averaging.before_commit"]


def _victim(initial_peers: tuple[str, ...], prefix: str, point: str, others: tuple[str, ...], to_parent, go) -> None:
    """Child process: join the swarm, arm ``exit`` at ``point``, average with ``others`` when told to."""
    from hivetrain.averaging import GroupAverager
    from hivetrain.faults import Fault, FaultInjector
    from hivetrain.peers.node import NodeConfig, start_node

    node = start_node(NodeConfig(host_maddrs=LOOPBACK, initial_peers=initial_peers, startup_timeout_s=30))
    faults = FaultInjector()
    faults.arm(Fault(point, "exit"))
    avg = GroupAverager(node, prefix, AveragingConfig(**CONFIG), faults=faults, listen_host="127.0.0.1")
    avg.start()
    to_parent.put(node.peer_id)
    if go.wait(60):
        try:
            avg.average([torch.full((NUM_ELEMENTS,), 100.0)], 1.0, 0, 30.0, frozenset(others), patience_s=PATIENCE_S)
            to_parent.put("committed")
        except RoundFailed as exc:
            to_parent.put(f"failed: {exc}")
    avg.shutdown()
    node.shutdown()


def _watch_exit(proc) -> tuple[threading.Thread, list[float]]:
    """Start a thread that notes when ``proc`` exits (``time.monotonic()``, within 50 ms: ``_exit_code``'s poll) in
    the list it returns."""
    exited: list[float] = []

    def watch() -> None:
        _exit_code(proc, 120.0)
        exited.append(time.monotonic())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    return watcher, exited


def _exit_code(proc, timeout_s: float) -> int | None:
    """Poll the exit code (``join`` would wait on a pipe the victim's orphaned DHT process still holds)."""
    end = time.monotonic() + timeout_s
    while proc.exitcode is None and time.monotonic() < end:
        time.sleep(0.05)
    return proc.exitcode


def _said(queue) -> str:
    """What the victim reported of its own call (it reports only if the fault did not fire)."""
    try:
        return str(queue.get(timeout=1.0))
    except Exception:  # noqa: BLE001 - queue.Empty, or a pipe the killed victim left broken
        return "nothing"


def _sha(result: RoundResult) -> str:
    return hashlib.sha256(result.tensors[0].numpy().tobytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS)
def test_member_killed_at_hook_point_costs_the_survivors_nothing_but_its_part(make_averagers, swarm, prefix, point):
    survivors = make_averagers(2, AveragingConfig(**CONFIG))
    ctx = mp.get_context("spawn")
    to_parent, go = ctx.Queue(), ctx.Event()
    survivor_ids = tuple(a.node.peer_id for a in survivors)
    proc = ctx.Process(
        target=_victim, args=(tuple(swarm[0].visible_maddrs()), prefix, point, survivor_ids, to_parent, go)
    )
    proc.start()
    descendants: list[int] = []
    try:
        victim_id = to_parent.get(timeout=90)
        descendants = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]  # its DHT and p2pd
        inputs = [[torch.full((NUM_ELEMENTS,), float(i))] for i in range(2)]
        watcher, exited = _watch_exit(proc)
        go.set()
        # each member expects the other two, as a trainer expects the live trainers its records show: the group closes
        # when all three are ready, not at a 1 s window that a victim process slow to wake on a loaded machine misses
        # (it then fails "not_in_group", or leads a rival declaration, and never reaches the hook: CI, 2026-12-01)
        expected = frozenset((*survivor_ids, victim_id))
        calls = [
            lambda a=a, x=x: a.average(x, 1.0, 0, 30.0, expected, patience_s=PATIENCE_S)
            for a, x in zip(survivors, inputs, strict=True)
        ]
        results = run_threads(calls, 40)
        ended = time.monotonic()
        code = _exit_code(proc, 10.0)
        assert code == 137, (
            f"the fault at {point} did not fire (exit code {code}; the victim: {_said(to_parent)}; "
            f"the survivors: {[getattr(r, 'group', r) for r in results]})"
        )
        watcher.join(1.0)
        # the survivors' calls end within a part timeout (and a commit timeout) of the victim's death, not a round's
        bound_s = CONFIG["part_timeout_s"] + CONFIG["commit_timeout_s"] + 3.0
        assert exited and ended - exited[0] < bound_s, f"survivors done at {ended:.2f}, the victim died at {exited}"
        for i, x in enumerate(inputs):
            assert torch.equal(x[0], torch.full((NUM_ELEMENTS,), float(i)))
        if point == "averaging.before_commit" and all(isinstance(r, RoundFailed) for r in results):
            assert all(r.reason in ("peer_failed", "timeout", "aborted") for r in results), results
            results = run_threads(calls, 40)  # the retry without the dead peer
        assert all(isinstance(r, RoundResult) for r in results), results
        assert victim_id not in results[0].group and len(results[0].group) == 2
        assert _sha(results[0]) == _sha(results[1])
        # per slice, the mean of the parts its reducer averaged: the survivors' (0 and 1), plus the victim's (100)
        # in a slice reduced before it died (kept: only its own slice is reduced again without it)
        value = {victim_id: 100.0, **{a.node.peer_id: float(i) for i, a in enumerate(survivors)}}
        expected = torch.full((NUM_ELEMENTS,), 0.5)
        for start, end, members in results[0].slice_members:
            assert set(results[0].group) <= set(members), members
            expected[start:end] = sum(value[p] for p in members) / len(members)
        torch.testing.assert_close(results[0].tensors[0], expected, atol=1e-6, rtol=0)
    finally:
        go.set()
        _exit_code(proc, 5.0)
        for pid in [*descendants, proc.pid]:  # the victim's orphaned DHT process and p2pd
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        proc.join(5)
