"""SWARM pipeline mode: the production routing and rebalancing decide, and the throughput obeys its bound."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hivetrain.cli.main import main
from hivetrain.sim.config import parse_scenario
from hivetrain.sim.pipeline import PipelineSim
from hivetrain.swarm.rebalance import choose_stage, decide_move


def _small(churn: bool = True, **pipeline: Any) -> PipelineSim:
    raw = {
        "name": "swarm-tiny",
        "sim": {"seed": 2, "mode": "swarm", "max_sim_s": 240.0},
        "pipeline": {"num_stages": 3, "num_servers": 12, "num_trainers": 2, "inflight_per_trainer": 6,
                     "stage_costs": [1.0, 1.0, 2.0], "warmup_s": 30.0, **pipeline},
        "churn": {"session": "exponential" if churn else "none", "mean_session_s": 600.0},
    }  # fmt: skip
    return PipelineSim(parse_scenario(raw))


def test_throughput_stays_under_the_slowest_stage_and_churn_reroutes() -> None:
    sim = _small(initial_placement="round_robin")
    r = sim.run()
    assert r["microbatches_done"] > 100
    assert 0 < r["pipeline_throughput_mb_per_s"] <= r["ideal_throughput_mb_per_s"] * 1.05  # sampled ideal: 5% slack
    assert r["departures"] > 0 and sum(r["hops_failed"].values()) > 0 and r["rerouted_share"] > 0


def test_rebalancing_moves_servers_off_an_overloaded_stage_and_raises_throughput() -> None:
    skewed = {"initial_placement": "skewed", "rebalance_margin": 0.02}
    moved, stayed = _small(False, **skewed).run(), _small(False, **skewed, rebalance=False).run()
    assert stayed["servers_per_stage_end"] == [8, 2, 2]
    assert moved["moves"] > 0 and stayed["moves"] == 0
    assert moved["pipeline_throughput_mb_per_s"] > 1.2 * stayed["pipeline_throughput_mb_per_s"]


def test_simulated_placements_and_moves_are_the_production_functions_answers() -> None:
    """Each probed call is replayed on the production function with the inputs the simulation gave it."""
    sim = _small(initial_placement="choose_stage", rebalance_margin=0.02)
    sim.run()
    stages, moves = sim.probes["choose_stage"], sim.probes["decide_move"]
    assert len(stages) >= 12 and len(moves) >= 12
    assert len({out for _, out in stages}) == 3  # every stage was chosen at least once
    for (view, num_stages, now, max_age_s), stage in stages:
        assert choose_stage(view, num_stages, now, max_age_s)[0] == stage
    for (args, kwargs), target in moves:
        assert decide_move(*args, **kwargs)[0] == target
    assert any(target is not None for _, target in moves)


def test_sim_command_runs_swarm_mode(tmp_path: Path, capsys) -> None:
    scenario = tmp_path / "swarm.toml"
    scenario.write_text('[sim]\nmode = "swarm"\nmax_sim_s = 60.0\n[pipeline]\nnum_servers = 8\nnum_stages = 2\n')
    assert main(["sim", str(scenario), "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    for key in ("pipeline_throughput_mb_per_s", "ideal_throughput_mb_per_s", "rerouted_share", "moves"):
        assert key in report
    assert report["peers"] == 8 and report["microbatches_done"] > 0
