"""SWARM pipeline mode: stage servers and trainers streaming microbatches, decided by hivetrain's own functions.

S stages; each stage server has a speed (microbatches/s at a stage of cost 1: one forward + one backward) and a
session (``[churn]``). Trainers keep ``inflight_per_trainer`` microbatches in the pipeline (closed loop): a
microbatch visits stages 0..S-1 in turn, and at each hop the trainer picks a server with the production
``swarm.routing.choose_server`` from the records it can see (each trainer has its own ``peers.bans.BanList`` and
in-flight counts). A server serves FIFO (one microbatch at a time, ``cost / speed`` seconds each). A hop fails when
the server is gone (noticed after ``hop_latency_s``) or has not answered within ``call_timeout_s`` (a long queue);
the trainer then bans the server (``BanList.ban``, exponential backoff) and reroutes the microbatch to another
server of the same stage (``exclude``); a success ``forgive``s the server, as ``swarm.client`` does.

Servers announce a ``swarm.announce.StageRecord`` every ``announce_interval_s`` (staggered: throughput, queue
length, status); a departed server's record stays visible until it is ``record_max_age_s`` old, so trainers keep
routing to it until then, which is what reroutes cost. Joining servers pick a stage with
``swarm.rebalance.choose_stage``; every ``rebalance_interval_s`` each serving server asks
``swarm.rebalance.decide_move`` and a mover serves again after ``move_s`` (its new stage's state download).

Reported (``summary``): ``pipeline_throughput_mb_per_s`` (microbatches through every stage per second after
``warmup_s``), ``ideal_throughput_mb_per_s`` (time average of the slowest stage's summed server speed: what the
servers could do with perfect routing), their ratio, ``rerouted_share`` (microbatches that needed at least one
reroute), moves, bans, hops failed by cause, servers per stage at the end.

A queued microbatch whose call deadline (less ``swarm.runtime``'s 0.5 s margin) passes before the server starts it is
skipped, as ``StageRuntime`` does; one that started is finished, and its work is wasted if the call timed out.

Simplifications: activations' transfer time is not modelled (a hop costs ``hop_latency_s``); the backward pass is
folded into each server's service time.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from hivetrain.peers.bans import BanConfig, BanList
from hivetrain.sim.config import Scenario
from hivetrain.sim.peers import draw_session_s, peer_id_for
from hivetrain.swarm.announce import StageRecord
from hivetrain.swarm.rebalance import choose_stage, decide_move
from hivetrain.swarm.routing import choose_server

_Z95 = 1.6448536269514722
DEADLINE_MARGIN_S = 0.5  # swarm.runtime.StageRuntime's default deadline_margin_s


@dataclass
class Server:
    """One simulated stage server."""

    peer_id: str
    speed: float  # microbatches/s at a stage of cost 1
    leaves_at: float
    stage: int
    status: str = "joining"  # StageRecord's ServerState
    moving_to: int | None = None  # while moving: the target stage (StageRecord.moving_to)
    free_at: float = 0.0  # when its FIFO queue drains
    ends: deque = field(default_factory=deque)  # finish times of the microbatches it holds
    gone: bool = False


@dataclass
class Trainer:
    bans: BanList
    inflight: Counter = field(default_factory=Counter)


class PipelineSim:
    """One SWARM-mode run of a scenario (``[sim] mode = "swarm"``). ``run()`` returns the summary dict.

    ``probes`` keeps (inputs, output) of the first ``num_probes`` calls of each decision function the run made (and
    of every move), so that tests can call the production function again on the same inputs and compare.
    """

    def __init__(self, scenario: Scenario, num_probes: int = 50):
        self.sc, self.p = scenario, scenario.pipeline
        self.env = simpy.Environment()
        self.rng = np.random.default_rng(scenario.sim.seed)
        self.route_rng = random.Random(scenario.sim.seed)
        self.servers: dict[str, Server] = {}
        self.records: dict[str, StageRecord] = {}
        self._view: list[StageRecord] | None = None
        bans = BanConfig(ban_base_s=self.p.ban_base_s, ban_max_s=self.p.ban_max_s)  # as swarm.trainer
        self.trainers = [Trainer(BanList(bans)) for _ in range(self.p.num_trainers)]
        self.num_drawn = 0
        self.done_at: list[float] = []
        self.rerouted = 0
        self.counts: Counter = Counter()
        self.ideal: list[tuple[float, float]] = []  # (time, slowest stage's summed speed)
        self.num_probes = num_probes
        self.probes: dict[str, list[tuple[Any, ...]]] = {"choose_stage": [], "decide_move": []}

    # ---- servers and their records --------------------------------------------------------------------------------
    def _throughput(self, s: Server) -> float:
        return s.speed / self.p.cost(s.stage)

    def _draw_server(self) -> Server:
        sigma = math.log(self.p.server_spread) / (2 * _Z95)
        speed = float(self.p.server_mb_per_s_median * math.exp(sigma * self.rng.standard_normal()))
        session = draw_session_s(self.rng, self.sc.churn)
        pid = peer_id_for(self.sc.sim.seed, self.num_drawn)
        self.num_drawn += 1
        return Server(pid, speed, self.env.now + session, stage=0)

    def _announce(self, s: Server) -> None:
        now = self.env.now
        while s.ends and s.ends[0] <= now:
            s.ends.popleft()
        self.records[s.peer_id] = StageRecord.model_construct(
            peer_id=s.peer_id, run_id="sim", model_fingerprint="f", stage=s.stage, num_stages=self.p.num_stages,
            status=s.status, throughput=self._throughput(s), queue_len=len(s.ends), load=0.0, epoch=0, state_hash="",
            incarnation="", open_window=0, phase_microbatches=0, abandoned=(), served_total=0, rebalances=0,
            updated_at=now, moving_to=s.moving_to,
        )  # fmt: skip
        self._view = None

    def view(self) -> list[StageRecord]:
        """The records younger than ``record_max_age_s`` (what a DHT read returns), one list until one changes."""
        now = self.env.now
        if self._view is None or any(now - r.updated_at > self.p.record_max_age_s for r in self._view):
            self._view = [r for r in self.records.values() if now - r.updated_at <= self.p.record_max_age_s]
        return self._view

    def _choose_stage(self) -> int:
        view, now = self.view(), self.env.now
        stage, _ = choose_stage(view, self.p.num_stages, now, self.p.record_max_age_s)
        self._probe("choose_stage", (tuple(view), self.p.num_stages, now, self.p.record_max_age_s), stage)
        return stage

    def _probe(self, name: str, inputs: tuple, output: Any) -> None:
        """Keep the first ``num_probes`` calls of ``name``, and every call that moved a server (they are rare)."""
        if len(self.probes[name]) < self.num_probes or (name == "decide_move" and output is not None):
            self.probes[name].append((inputs, output))

    def _join(self, s: Server, placed: int | None, status: str) -> None:
        """``s`` takes ``placed`` or the stage ``choose_stage`` gives it, announces, and starts its life."""
        s.stage = self._choose_stage() if placed is None else placed
        s.status = status
        self.servers[s.peer_id] = s
        self._announce(s)
        self.env.process(self._server_life(s))

    def _server_life(self, s: Server):
        """Fetch the stage's state (a joiner), announce periodically, leave at the end of the session."""
        if s.status == "joining":
            yield self.env.timeout(self.p.move_s)
            s.status = "serving"
            self._announce(s)
        yield self.env.timeout(float(self.rng.uniform(0, self.p.announce_interval_s)))
        while self.env.now < s.leaves_at:
            self._announce(s)
            yield self.env.timeout(min(self.p.announce_interval_s, max(s.leaves_at - self.env.now, 0.0)))
        s.gone = True  # its record stays until it ages out
        self.counts["departures"] += 1

    def _arrivals(self):
        churn = self.sc.churn
        if churn.session == "none" or not churn.arrivals:
            return
        rate = self.p.num_servers / churn.mean_session_s
        while True:
            yield self.env.timeout(float(self.rng.exponential(1 / rate)))
            self.counts["arrivals"] += 1
            self._join(self._draw_server(), None, "joining")

    def _rebalance(self):
        while self.p.rebalance:
            yield self.env.timeout(self.p.rebalance_interval_s)
            view, now = self.view(), self.env.now
            for s in sorted(self.servers.values(), key=lambda s: s.peer_id):
                if s.gone or s.status != "serving":
                    continue
                args = (view, s.stage, now, self.p.rebalance_margin)
                kwargs = dict(my_peer_id=s.peer_id, num_stages=self.p.num_stages, max_age_s=self.p.record_max_age_s,
                              min_servers_per_stage=self.p.min_servers_per_stage)  # fmt: skip
                target, _ = decide_move(*args, **kwargs)
                self._probe("decide_move", (args, kwargs), target)
                if target is not None:
                    self.counts["moves"] += 1
                    self.env.process(self._move(s, target))

    def _move(self, s: Server, target: int):
        s.status, s.moving_to = "moving", target
        self._announce(s)
        yield self.env.timeout(self.p.move_s)
        s.stage, s.status, s.moving_to = target, "serving", None
        self._announce(s)

    def _measure_ideal(self):
        while True:
            totals = [0.0] * self.p.num_stages
            for s in self.servers.values():
                if not s.gone and s.status == "serving":
                    totals[s.stage] += self._throughput(s)
            self.ideal.append((self.env.now, min(totals)))
            yield self.env.timeout(self.p.announce_interval_s)

    # ---- microbatches ---------------------------------------------------------------------------------------------
    def _hop(self, s: Server, now: float) -> tuple[bool, float]:
        """Send a microbatch to ``s`` at ``now``: (answered, when the trainer knows)."""
        lat = self.p.hop_latency_s
        if s.gone or s.status != "serving":
            return False, now + lat  # connection refused / not serving this stage
        start = max(now + lat, s.free_at)
        deadline = now + self.p.call_timeout_s
        if start > deadline - DEADLINE_MARGIN_S:  # expired while queued: the server skips it (swarm.runtime)
            return False, deadline
        end = start + self.p.cost(s.stage) / s.speed
        s.free_at = end
        s.ends.append(end)
        if s.leaves_at < min(end, deadline):
            return False, max(now, s.leaves_at) + lat  # died holding it: the stream breaks
        if end + lat > deadline:
            return False, deadline  # timed out while it ran: the work is done, wasted
        return True, end + lat

    def _microbatch(self, trainer: Trainer):
        while True:
            rerouted = False
            for stage in range(self.p.num_stages):
                tried: list[str] = []
                while True:
                    now = self.env.now
                    rec, _ = choose_server(self.view(), stage, now, trainer.bans, self.route_rng,
                                           inflight=trainer.inflight, exclude=tried)  # fmt: skip
                    if rec is None:  # nobody to send it to: wait for an announcement
                        self.counts["no_server"] += 1
                        tried = []
                        yield self.env.timeout(1.0)
                        continue
                    s = self.servers[rec.peer_id]
                    trainer.inflight[s.peer_id] += 1
                    ok, when = self._hop(s, now)
                    yield self.env.timeout(when - now)
                    trainer.inflight[s.peer_id] -= 1
                    if ok:
                        trainer.bans.forgive(s.peer_id)
                        break
                    self.counts["hop_failed." + ("gone" if s.gone or s.status != "serving" else "timeout")] += 1
                    trainer.bans.ban(s.peer_id, self.env.now, reason="hop failed")
                    self.counts["bans"] += 1
                    tried.append(s.peer_id)
                    rerouted = True
            self.done_at.append(self.env.now)
            self.rerouted += rerouted

    # ---- run ------------------------------------------------------------------------------------------------------
    def _initial_stage(self, k: int) -> int | None:
        placement, S = self.p.initial_placement, self.p.num_stages
        if placement == "choose_stage":
            return None
        if placement == "skewed" and k < self.p.num_servers // 2:
            return 0
        return k % S

    def run(self) -> dict[str, Any]:
        """Simulate ``[sim] max_sim_s`` seconds; returns the summary (see the module docstring)."""
        started = time.perf_counter()
        for k in range(self.p.num_servers):  # each initial server sees the ones placed before it
            self._join(self._draw_server(), self._initial_stage(k), "serving")
        for trainer in self.trainers:
            for _ in range(self.p.inflight_per_trainer):
                self.env.process(self._microbatch(trainer))
        for proc in (self._arrivals(), self._rebalance(), self._measure_ideal()):
            self.env.process(proc)
        self.env.run(until=self.sc.sim.max_sim_s)
        return self._summary(time.perf_counter() - started)

    def _summary(self, wall_s: float) -> dict[str, Any]:
        p, end = self.p, self.sc.sim.max_sim_s
        span = max(end - p.warmup_s, 1e-9)
        done = sum(t >= p.warmup_s for t in self.done_at)
        ideal = [v for t, v in self.ideal if t >= p.warmup_s]
        throughput = done / span
        ideal_mean = float(np.mean(ideal)) if ideal else 0.0
        per_stage = Counter(s.stage for s in self.servers.values() if not s.gone)
        return {
            "scenario": self.sc.name,
            "mode": "swarm",
            "peers": p.num_servers,
            "num_stages": p.num_stages,
            "servers_per_stage_start": p.num_servers / p.num_stages,
            "sim_s": end,
            "microbatches_done": len(self.done_at),
            "pipeline_throughput_mb_per_s": throughput,
            "ideal_throughput_mb_per_s": ideal_mean,
            "throughput_ratio": throughput / ideal_mean if ideal_mean > 0 else None,
            "rerouted_share": self.rerouted / max(len(self.done_at), 1),
            "moves": self.counts["moves"],
            "bans": self.counts["bans"],
            "hops_failed": {k.split(".", 1)[1]: v for k, v in sorted(self.counts.items()) if k.startswith("hop_")},
            "no_server_waits": self.counts["no_server"],
            "arrivals": self.counts["arrivals"],
            "departures": self.counts["departures"],
            "servers_per_stage_end": [per_stage.get(s, 0) for s in range(p.num_stages)],
            "rebalance": p.rebalance,
            "wall_s": wall_s,
        }
