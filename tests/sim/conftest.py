"""Small scenarios for the simulation tests (each runs in about a second)."""

from __future__ import annotations

from typing import Any

from hivetrain.sim.config import Scenario, parse_scenario


def tiny(**tables: dict[str, Any]) -> Scenario:
    """20 peers, 3 outer steps of 10 inner steps, a 1 MB model; ``tables`` override whole TOML tables' keys."""
    raw: dict[str, Any] = {
        "name": "tiny",
        "sim": {"seed": 3, "num_peers": 20, "outer_steps": 3, "model_bytes": 1_000_000, "tick_s": 1.0},
        "schedule": {"inner_steps": 10, "batch_size": 8},
        "averaging": {"target_group_size": 64},
    }
    for table, values in tables.items():
        raw.setdefault(table, {}).update(values)
    return parse_scenario(raw)
