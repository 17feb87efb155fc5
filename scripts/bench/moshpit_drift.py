#!/usr/bin/env python3
"""How far DiLoCo peers drift apart when Moshpit averaging does not reach the exact mean (issue 3, item 2).

N DiLoCo peers (tiny Llama, byte-level tinyshakespeare) train in one process, one thread each
(``torch.set_num_threads(1)``), each with its own DHT node on 127.0.0.1 and its own real ``GroupAverager``. Peers run
free, as volunteers do: inner phase (H AdamW steps, ``InnerOptimizer``), pseudo-gradient Δ = θ − θ_local, averaged
with ``GroupAverager.average`` (weight = samples), outer Nesterov step (``outer_step``) on the peer's own θ, exactly
the phases of ``hivetrain.diloco.trainer``. Nothing sleeps: wall time is compute, matchmaking windows and transfers.

With strategy "moshpit", ``target_group_size`` 2 and ``moshpit_rounds`` 1, one outer step averages Δ in pairs along
one dimension of the (2, 2, 2) grid (Ryabinin et al. 2021, "Moshpit SGD", Alg. 1), so peers apply different Δ̄ and
their θ differ: the interesting regime. "butterfly" (exact mean, drift 0.0) and "gossip" (random pairs) are the
references.

``--average delta`` is what the trainer did before this bench: average Δ, then each peer applies the outer step to its
own θ and momentum. Nothing ever averages θ itself, so members of one group apply the same Δ̄ and keep their difference,
and differences between groups accumulate (amplified ~1/(1 − μ) by the outer momentum): the θ drift is a random
walk, not a contraction. ``--average state`` is Moshpit SGD on the state: each peer applies the outer step with its
own Δ, then averages (θ', m') in the same rounds. The outer step is linear in (θ, m, Δ), so with equal weights a group
leaves with the outer step of its averaged (θ, m, Δ), and the cycle argument of tests/averaging/test_drift.py bounds
the drift by the last few steps' noise. It sends twice the bytes (θ and m instead of Δ). ``--average theta`` (default)
averages θ' only (the bytes of "delta") and leaves each peer's momentum local: what ``hivetrain.diloco.trainer`` does
for "moshpit" and "gossip" (for "butterfly" all three modes are the same exact step).

After each outer step e, once every peer has finished it, the collector computes with
``groups.max_relative_deviation`` (max_p ||x_p − x̄|| / ||x̄||, float64):

    theta     the peers' θ after the step (also max_p ||θ_p − θ̄||, and that divided by ||θ̄ − θ̄ of the previous
              step||: the drift in units of one outer update, which the cosine schedule's shrinking steps cannot hide)
    avg_delta the averaged pseudo-gradients Δ̄_p each peer applied
    raw_delta the pseudo-gradients Δ_p before averaging (what averaging had to contract)

and every ``--eval-every`` steps the held-out loss of the mean model θ̄ (at the last step also of every peer's own θ,
what a volunteer's model is worth). Boundedness statistic, per series:
growth = mean over the last quarter of the steps / mean over the second quarter (stationary ≈ 1; a random walk
√t gives ≈ 1.5; linear growth ≈ 2.3); the verdict is "bounded" when theta growth <= ``--growth-limit``.

A failed round (``RoundFailed``) is counted and shown; that peer then downloads the state of a peer that finished the
epoch (as the trainer's ``sync_state`` does once the others moved on), or keeps θ if none did.

Exit status 1 when some strategy's θ drift is not bounded. ``--quick`` is a smoke size (4 peers, 8 steps, < 1 min).

Example: scripts/bench/moshpit_drift.py --strategies moshpit,gossip,butterfly --steps 40 --json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import queue
import signal
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hivetrain.averaging import AveragingConfig, GroupAverager, RoundFailed
from hivetrain.averaging.groups import grid_for, max_relative_deviation
from hivetrain.data import Corpus, load_corpus, stream_seed
from hivetrain.data.config import DataConfig
from hivetrain.diloco.config import DilocoConfig
from hivetrain.diloco.inner import InnerOptimizer
from hivetrain.diloco.outer import load_into_model, outer_step, pseudo_gradient
from hivetrain.diloco.state import TrainingState
from hivetrain.model import build_config, build_model, evaluate
from hivetrain.peers.node import NodeConfig, PeerNode, start_node

DEFAULT_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinyshakespeare.txt"
LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
QUICK = dict(peers=4, steps=8, inner_steps=4, eval_every=4, eval_windows=8, matchmaking_time_s=1.5)


@dataclass
class StepReport:
    """What one peer hands the collector after outer step ``epoch`` (tensors are fp32 CPU, in parameter order)."""

    peer: int
    epoch: int
    theta: list[torch.Tensor]
    raw_delta: list[torch.Tensor]
    avg_delta: list[torch.Tensor] | None  # None: "state" averaging, or the round failed
    round_s: float
    group_size: int  # 0: the round failed, θ kept
    bytes_sent: int
    failure: str = ""


@dataclass
class StepRow:
    """One line of the table: drift across all peers after outer step ``epoch`` (epoch 1 = after the first step)."""

    epoch: int
    theta: float  # max_relative_deviation of θ
    theta_abs: float  # max_p ||θ_p − θ̄||
    theta_steps: float  # theta_abs / ||θ̄ − θ̄ of the previous step||: drift in units of this step's update
    avg_delta: float
    raw_delta: float
    eval_loss: float | None  # of the mean model θ̄
    peer_eval_losses: list[float] | None  # of each peer's θ, last step only
    round_s: float
    failures: int
    failure_reasons: list[str]
    bytes_sent: int  # by all peers in this step
    wall_s: float


@dataclass
class Peer:
    index: int
    node: PeerNode
    averager: GroupAverager
    model: torch.nn.Module
    state: TrainingState
    inner: InnerOptimizer
    batches: object
    errors: list[str] = field(default_factory=list)


def start_nodes(num_nodes: int, timeout_s: float) -> list[PeerNode]:
    """``num_nodes`` DHT nodes on 127.0.0.1 bootstrapped from the first; on failure none is left running."""
    nodes: list[PeerNode] = []
    try:
        nodes.append(start_node(NodeConfig(host_maddrs=LOOPBACK, startup_timeout_s=timeout_s)))
        initial = tuple(nodes[0].visible_maddrs())
        for _ in range(num_nodes - 1):
            nodes.append(
                start_node(NodeConfig(host_maddrs=LOOPBACK, initial_peers=initial, startup_timeout_s=timeout_s))
            )
    except BaseException:
        for node in nodes:
            node.shutdown()
        raise
    return nodes


def averaging_config(args: argparse.Namespace, strategy: str) -> AveragingConfig:
    group = args.peers if strategy == "butterfly" else args.group_size
    return AveragingConfig(
        strategy=strategy,
        target_group_size=group,
        moshpit_rounds=args.moshpit_rounds,
        matchmaking_time_s=args.matchmaking_time_s,
        round_timeout_s=args.matchmaking_time_s + 30.0,
        part_timeout_s=10.0,
        commit_timeout_s=10.0,
        connect_timeout_s=5.0,
    )


def diloco_config(args: argparse.Namespace) -> DilocoConfig:
    return DilocoConfig(
        inner_steps=args.inner_steps,
        inner_lr=args.lr,
        warmup_steps=args.warmup,
        total_inner_steps=args.steps * args.inner_steps,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
    )


class StateBoard:
    """The states peers reach after each epoch, so that a peer whose round failed can download one (as the trainer's
    ``sync_state`` does when the others moved on). Keeps the last few epochs only."""

    def __init__(self, num_kept_epochs: int = 3):
        self._cond = threading.Condition()
        self._states: dict[int, dict[int, TrainingState]] = {}
        self._num_kept = num_kept_epochs

    def publish(self, peer: int, state: TrainingState) -> None:
        with self._cond:
            self._states.setdefault(state.epoch, {})[peer] = state
            for old in [e for e in self._states if e <= state.epoch - self._num_kept]:
                del self._states[old]
            self._cond.notify_all()

    def donor(self, epoch: int, me: int, timeout_s: float) -> tuple[int, TrainingState] | None:
        """(peer, state) of another peer that reached ``epoch``, waiting up to ``timeout_s`` seconds; None if none."""
        with self._cond:
            self._cond.wait_for(lambda: any(p != me for p in self._states.get(epoch, {})), timeout=timeout_s)
            others = sorted((p, st) for p, st in self._states.get(epoch, {}).items() if p != me)
            return others[0] if others else None


def average_step(peer: Peer, deltas: list[torch.Tensor], weight: float, args, timeout_s: float):
    """One outer step: (the Δ̄ applied, or None when the state itself is averaged; the state of epoch + 1; the
    RoundResult). Raises RoundFailed (``peer.state`` is not touched).

    "delta" (the trainer before it averaged θ): average Δ, apply the outer step to our own θ and m.
    "state" (Moshpit SGD on the state): apply the outer step with our own Δ, then average (θ', m') in the same
    rounds; with equal weights this is the outer step of the group-averaged (θ, m, Δ) (the step is linear in them),
    so a group leaves with one θ. Twice the bytes of "delta".
    "theta" (``hivetrain.diloco.trainer``): the same, but only θ' is averaged (the bytes of "delta"); each peer keeps
    its own momentum.
    """
    epoch, cfg = peer.state.epoch, diloco_config(args)
    if args.average == "delta":
        result = peer.averager.average(deltas, weight, epoch, timeout_s)
        avg = [t.clone() for t in result.tensors]  # the averager may recycle its result buffers
        return avg, outer_step(peer.state, avg, cfg.outer_lr, cfg.outer_momentum), result
    local = outer_step(peer.state, deltas, cfg.outer_lr, cfg.outer_momentum)
    names = list(local.params)
    if args.average == "theta":  # θ' only: the bytes of "delta"; the momentum stays local
        result = peer.averager.average(list(local.params.values()), weight, epoch, timeout_s)
        params = {n: t.clone() for n, t in zip(names, result.tensors, strict=True)}
        return None, TrainingState(epoch + 1, params, local.momentum), result
    result = peer.averager.average([*local.params.values(), *local.momentum.values()], weight, epoch, timeout_s)
    params = {n: t.clone() for n, t in zip(names, result.tensors[: len(names)], strict=True)}
    momentum = {n: t.clone() for n, t in zip(names, result.tensors[len(names) :], strict=True)}
    return None, TrainingState(epoch + 1, params, momentum), result


def peer_loop(peer: Peer, args: argparse.Namespace, board: StateBoard, out: queue.Queue, stop: threading.Event) -> None:
    """One volunteer: inner phase, Δ, average, outer step, for ``args.steps`` epochs (the trainer's phases)."""
    torch.set_num_threads(1)
    cfg = diloco_config(args)
    timeout_s = peer.averager.config.round_timeout_s
    try:
        for epoch in range(args.steps):
            if stop.is_set():
                return
            load_into_model(peer.state, peer.model)
            phase = peer.inner.run(peer.batches, first_step=epoch * cfg.inner_steps, num_steps=cfg.inner_steps)
            deltas = pseudo_gradient(peer.state, peer.model)
            started = time.monotonic()
            try:
                avg, peer.state, result = average_step(peer, deltas, float(phase.num_samples), args, timeout_s)
            except RoundFailed as exc:
                failure = f"{exc.reason}: {exc.detail}"
                got = board.donor(epoch + 1, peer.index, timeout_s)
                if got is None:  # nobody finished the epoch either: keep θ and m
                    peer.state = TrainingState(epoch + 1, peer.state.params, peer.state.momentum)
                    failure += "; no donor, θ kept"
                else:  # the others moved on: download a donor's state, as the trainer does
                    peer.state = got[1].clone()
                    failure += f"; downloaded the state of peer {got[0]}"
                out.put(StepReport(peer.index, epoch, list(peer.state.params.values()), deltas, None,
                                   time.monotonic() - started, 0, 0, failure))  # fmt: skip
                continue
            board.publish(peer.index, peer.state)
            theta = list(peer.state.params.values())
            out.put(StepReport(peer.index, epoch, theta, deltas, avg, result.duration_s, len(result.group),
                               result.bytes_sent))  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - reported by the collector, the run fails
        peer.errors.append(f"{type(exc).__name__}: {exc}")
        out.put(None)


def mean_model(names: list[str], thetas: list[list[torch.Tensor]], template: torch.nn.Module) -> torch.nn.Module:
    """``template`` loaded with θ̄, the unweighted mean of the peers' θ (``thetas[p]`` in ``names`` order)."""
    with torch.no_grad():
        params = dict(template.named_parameters())
        for j, name in enumerate(names):
            params[name].copy_(sum(ts[j].double() for ts in thetas) / len(thetas))
    return template


def collect(peers: list[Peer], args, reports: queue.Queue, corpus: Corpus, template, started: float) -> list[StepRow]:
    """Gather every peer's report of each epoch, compute the drift row, print it as it comes."""
    pending: dict[int, dict[int, StepReport]] = {}
    rows: list[StepRow] = []
    eval_windows = corpus.eval_windows(args.seq_len, args.eval_windows)
    prev_mean = [p.detach().double().clone() for p in template.parameters()]  # θ0, the same on every peer
    deadline = time.monotonic() + args.timeout_s
    while len(rows) < args.steps:
        try:
            report = reports.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"no outer step finished within --timeout-s {args.timeout_s}") from None
        if report is None:
            raise RuntimeError("; ".join(e for p in peers for e in p.errors) or "a peer died")
        pending.setdefault(report.epoch, {})[report.peer] = report
        epoch = len(rows)
        while epoch in pending and len(pending[epoch]) == len(peers):
            by_peer = pending.pop(epoch)
            got = [by_peer[i] for i in range(len(peers))]
            row, prev_mean = drift_row(got, prev_mean, peers, args, eval_windows, template, started)
            rows.append(row)
            if not args.json:
                print(format_row(rows[-1]), flush=True)
                for r in got:
                    if r.failure:
                        print(f"      peer {r.peer} failed: {r.failure}", flush=True)
            epoch = len(rows)
    return rows


def drift_row(got: list[StepReport], prev_mean: list[torch.Tensor], peers: list[Peer], args, eval_windows, template,
              started: float) -> tuple[StepRow, list[torch.Tensor]]:  # fmt: skip
    """The row of one outer step, and θ̄ after it (float64, for the next row's step size)."""
    thetas = [r.theta for r in got]
    mean = [sum(t.double() for t in ts) / len(ts) for ts in zip(*thetas, strict=True)]
    theta_abs = max(math.sqrt(sum(float((t.double() - m).square().sum()) for t, m in zip(ts, mean, strict=True)))
                    for ts in thetas)  # fmt: skip
    step_norm = math.sqrt(sum(float((m - q).square().sum()) for m, q in zip(mean, prev_mean, strict=True)))
    theta_rel = max_relative_deviation(thetas)
    averaged = [r.avg_delta if r.avg_delta is not None else [torch.zeros_like(t) for t in r.raw_delta] for r in got]
    avg_drift = max_relative_deviation(averaged) if args.average == "delta" else math.nan
    eval_loss = None
    epoch = got[0].epoch + 1
    if args.eval_every and (epoch % args.eval_every == 0 or epoch == args.steps):
        eval_loss = evaluate(mean_model(list(peers[0].state.params), thetas, template), eval_windows)
    peer_losses = None
    if epoch == args.steps and args.eval_every:  # what each volunteer's own model is worth at the end
        peer_losses = [evaluate(mean_model(list(peers[0].state.params), [ts], template), eval_windows) for ts in thetas]
    row = StepRow(
        epoch=epoch,
        theta=theta_rel,
        theta_abs=theta_abs,
        theta_steps=theta_abs / step_norm if step_norm > 0 else 0.0,
        avg_delta=avg_drift,
        raw_delta=max_relative_deviation([r.raw_delta for r in got]),
        eval_loss=eval_loss,
        peer_eval_losses=peer_losses,
        round_s=statistics.median(r.round_s for r in got),
        failures=sum(r.group_size == 0 for r in got),
        failure_reasons=[f"peer {r.peer}: {r.failure}" for r in got if r.failure],
        bytes_sent=sum(r.bytes_sent for r in got),
        wall_s=time.monotonic() - started,
    )
    return row, mean


HEADER = (
    f"{'step':>5}{'θ drift':>11}{'|θ-θ̄|':>10}{'in steps':>9}{'Δ̄ drift':>10}{'Δ drift':>9}{'eval':>7}{'round s':>8}"
    f"{'fail':>5}"
)


def format_row(r: StepRow) -> str:
    loss = f"{r.eval_loss:7.3f}" if r.eval_loss is not None else f"{'':7}"
    return (
        f"{r.epoch:5d}{r.theta:11.3e}{r.theta_abs:10.3f}{r.theta_steps:9.2f}{r.avg_delta:10.3f}{r.raw_delta:9.3f}{loss}"
        f"{r.round_s:8.2f}{r.failures:5d}"
    )


def growth(series: list[float]) -> float:
    """mean(last quarter) / mean(second quarter): ≈1 stationary, ≈1.5 random walk, ≈2.3 linear; nan if too short."""
    q = len(series) // 4
    if q < 1:
        return math.nan
    second, last = statistics.fmean(series[q : 2 * q]), statistics.fmean(series[-q:])
    return last / second if second > 0 else (1.0 if last == 0 else math.inf)


def run_strategy(args: argparse.Namespace, strategy: str, corpus: Corpus) -> dict:
    """Start N DHT nodes and averagers, train ``args.steps`` outer steps on N threads, return the series."""
    model_cfg = build_config(args.model, corpus.vocab_size, args.seq_len)
    cfg = averaging_config(args, strategy)
    prefix = f"drift-{uuid.uuid4().hex[:8]}.avg"
    nodes = start_nodes(args.peers, timeout_s=60.0)
    peers: list[Peer] = []
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        for i, node in enumerate(nodes):
            averager = GroupAverager(node, prefix, cfg, listen_host="127.0.0.1")
            averager.start()
            averager.wait_ready(timeout_s=10.0)
            model = build_model(model_cfg, seed=args.seed)  # same θ0 on every peer, as after a state download
            # seeded by the peer's index, not its (fresh, random) peer id: every strategy sees the same data
            batches = corpus.train_batches(args.seq_len, args.batch_size, stream_seed(args.seed, f"peer{i}"))
            inner = InnerOptimizer(model, diloco_config(args))
            peers.append(Peer(i, node, averager, model, TrainingState.from_model(model), inner, batches))
        template = build_model(model_cfg, seed=args.seed)
        eval_windows = corpus.eval_windows(args.seq_len, args.eval_windows)
        initial_loss = evaluate(template, eval_windows)
        if not args.json:
            grid = "x".join(map(str, grid_for(args.peers, cfg.target_group_size)))
            print(
                f"\n== {strategy}, average {args.average}: {args.peers} peers, grid {grid}, group size "
                f"{cfg.target_group_size}, {cfg.moshpit_rounds} round(s)/step, "
                f"H={args.inner_steps}, eval loss at step 0 {initial_loss:.3f}"
            )
            print(HEADER, flush=True)  # fmt: skip
        reports: queue.Queue = queue.Queue()
        board = StateBoard()
        started = time.monotonic()
        threads = [
            threading.Thread(target=peer_loop, args=(p, args, board, reports, stop), name=f"peer{p.index}", daemon=True)
            for p in peers
        ]
        for t in threads:
            t.start()
        rows = collect(peers, args, reports, corpus, template, started)
        wall_s = time.monotonic() - started
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=args.matchmaking_time_s + 45.0)
        for p in peers:
            p.averager.shutdown()
        for node in nodes:
            node.shutdown()
    summary = summarize(rows, args, strategy, cfg, initial_loss, wall_s)
    if not args.json:
        print(verdict_line(summary, args.growth_limit), flush=True)
    return summary


def quarter_means(series: list[float]) -> tuple[float | None, float | None]:
    """(mean of the second quarter, mean of the last quarter) of ``series``; None when shorter than 4."""
    q = len(series) // 4
    return (statistics.fmean(series[q : 2 * q]), statistics.fmean(series[-q:])) if q else (None, None)


def summarize(rows: list[StepRow], args, strategy: str, cfg: AveragingConfig, initial_loss: float, wall_s: float):
    theta = [r.theta for r in rows]
    raw = [r.raw_delta for r in rows]
    avg_delta = [r.avg_delta for r in rows] if args.average == "delta" else None
    losses = [r.eval_loss for r in rows if r.eval_loss is not None]
    q2, q4 = quarter_means(theta)
    return {
        "strategy": strategy,
        "average": args.average,
        "group_size": cfg.target_group_size,
        "grid": list(grid_for(args.peers, cfg.target_group_size)),
        "wall_s": wall_s,
        "s_per_step": wall_s / max(len(rows), 1),
        "bytes_per_step": statistics.fmean(r.bytes_sent for r in rows),
        "failures": sum(r.failures for r in rows),
        "initial_eval_loss": initial_loss,
        "final_eval_loss": losses[-1] if losses else None,
        "final_peer_eval_loss_mean": statistics.fmean(rows[-1].peer_eval_losses) if rows[-1].peer_eval_losses else None,
        "final_peer_eval_loss_max": max(rows[-1].peer_eval_losses) if rows[-1].peer_eval_losses else None,
        "theta_drift_max": max(theta),
        "theta_drift_final": theta[-1],
        "theta_abs_final": rows[-1].theta_abs,
        "theta_drift_mean_q2": q2,
        "theta_drift_mean_q4": q4,
        "theta_growth": growth(theta),
        "theta_steps_final": rows[-1].theta_steps,
        "theta_steps_growth": growth([r.theta_steps for r in rows]),
        "raw_delta_drift_mean": statistics.fmean(raw),
        "avg_delta_drift_max": max(avg_delta) if avg_delta else None,
        "avg_delta_growth": growth(avg_delta) if avg_delta else None,
        "contraction_mean": statistics.fmean(a / r for a, r in zip(avg_delta, raw, strict=True) if r > 0)
        if avg_delta and any(raw)
        else None,
        "bounded": bool(max(theta) == 0.0 or growth(theta) <= args.growth_limit),
        "rows": [vars(r) for r in rows],
    }


def verdict_line(s: dict, limit: float) -> str:
    word = "bounded" if s["bounded"] else "GROWING"
    delta = (
        f"Δ̄ drift max {s['avg_delta_drift_max']:.3e}, growth {s['avg_delta_growth']:.2f}, "
        f"Δ̄/Δ drift {s['contraction_mean'] or 0:.3f}; "
        if s["avg_delta_drift_max"] is not None
        else ""
    )
    return (
        f"verdict {s['strategy']}/{s['average']}: θ drift {word}: growth (mean last quarter / mean second quarter) "
        f"{s['theta_growth']:.2f} (limit {limit}), max {s['theta_drift_max']:.3e}, final "
        f"{s['theta_steps_final']:.2f} outer steps' worth (growth {s['theta_steps_growth']:.2f}); {delta}"
        f"eval loss {s['initial_eval_loss']:.3f} -> {s['final_eval_loss'] or math.nan:.3f} (mean model), "
        f"peers' own {s['final_peer_eval_loss_mean'] or math.nan:.3f} mean, "
        f"{s['final_peer_eval_loss_max'] or math.nan:.3f} worst; "
        f"{s['failures']} failed rounds; {s['s_per_step']:.1f} s/step, {s['bytes_per_step'] / 1e6:.1f} MB/step"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="text file (default: shared tinyshakespeare.txt)")
    parser.add_argument("--strategies", default="moshpit", help="comma-separated: moshpit, gossip, butterfly")
    parser.add_argument("--peers", type=int, default=8, help="DiLoCo peers (threads, one DHT node each)")
    parser.add_argument("--steps", type=int, default=40, help="outer steps")
    parser.add_argument("--inner-steps", type=int, default=10, help="DiLoCo H: inner AdamW steps per outer step")
    parser.add_argument(
        "--average",
        choices=("delta", "state", "theta"),
        default="theta",
        help="theta = local outer step, then average θ only, momentum stays local (the trainer); delta = average Δ, "
        "then a local outer step (drifts without bound); state = local outer step, then average θ and m (2x bytes)",
    )
    parser.add_argument("--group-size", type=int, default=2, help="moshpit/gossip target_group_size")
    parser.add_argument("--moshpit-rounds", type=int, default=1, help="averaging rounds per outer step")
    parser.add_argument("--matchmaking-time-s", type=float, default=3.0, help="matchmaking window, seconds")
    parser.add_argument("--model", default="tiny", help="model preset")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per window")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per inner step")
    parser.add_argument("--lr", type=float, default=2e-3, help="inner AdamW peak learning rate")
    parser.add_argument("--warmup", type=int, default=20, help="inner warmup steps")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="outer learning rate")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="outer Nesterov momentum")
    parser.add_argument("--eval-every", type=int, default=5, help="eval the mean model every N outer steps; 0 = never")
    parser.add_argument("--eval-windows", type=int, default=32, help="held-out windows")
    parser.add_argument("--growth-limit", type=float, default=1.25, help="largest θ growth statistic called bounded")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="give up if no outer step ends for this long")
    parser.add_argument("--quick", action="store_true", help=f"smoke size (< 1 min): {QUICK}")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--json-out", default="", help="also write the JSON object to this file")
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    strategies = [s for s in args.strategies.split(",") if s]
    if not strategies or any(s not in ("moshpit", "gossip", "butterfly") for s in strategies):
        parser.error(f"--strategies {args.strategies!r}: expected moshpit, gossip and/or butterfly")
    if args.peers < 2 or args.steps < 1 or args.inner_steps < 1:
        parser.error("need --peers >= 2, --steps >= 1, --inner-steps >= 1")
    if not Path(args.data).is_file():
        parser.error(f"--data {args.data}: no such file")
    logging.basicConfig(level=logging.ERROR)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: DHT nodes are shut down
    torch.set_num_threads(1)
    data_cfg = DataConfig(paths=(args.data,), seq_len=args.seq_len, batch_size=args.batch_size,
                          num_eval_windows=args.eval_windows, max_corpus_bytes=0)  # fmt: skip
    corpus = load_corpus(data_cfg)
    results = {s: run_strategy(args, s, corpus) for s in strategies}
    config = {k: v for k, v in vars(args).items() if k not in ("json", "json_out", "quick")}
    blob = json.dumps({"config": config, "results": results})
    if args.json:
        print(blob)
    if args.json_out:
        Path(args.json_out).write_text(blob + "\n")
    return 0 if all(r["bounded"] for r in results.values()) else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
