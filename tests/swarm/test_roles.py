"""``decide_role``: which role a volunteer joining a pipelined run takes, from made-up stage records and times."""

from __future__ import annotations

import pytest

from hivetrain.swarm.announce import StageRecord
from hivetrain.swarm.config import SwarmConfig
from hivetrain.swarm.roles import decide_role

NOW = 1000.0
SWARM = SwarmConfig(num_stages=3, min_servers_per_stage=1, record_ttl_s=5.0)


def server(peer: str, stage: int, throughput: float = 1.0, age_s: float = 0.0, status="serving") -> StageRecord:
    return StageRecord(
        peer_id=peer,
        run_id="r",
        model_fingerprint="f",
        stage=stage,
        num_stages=3,
        status=status,
        throughput=throughput,
        updated_at=NOW - age_s,
    )


def test_auto_serves_an_unserved_stage_first():
    decision = decide_role("auto", [server("a", 0), server("b", 2)], SWARM, NOW, has_data=True)
    assert (decision.role, decision.stage) == ("server", 1)


def test_auto_trains_once_every_stage_is_served_and_it_holds_the_data():
    records = [server("a", 0), server("b", 1), server("c", 2)]
    assert decide_role("auto", records, SWARM, NOW, has_data=True).role == "trainer"


def test_auto_without_data_serves_the_bottleneck_stage():
    records = [server("a", 0, 4.0), server("b", 1, 0.5), server("c", 2, 2.0)]
    decision = decide_role("auto", records, SWARM, NOW, has_data=False)
    assert (decision.role, decision.stage) == ("server", 1)


def test_auto_ignores_expired_and_moving_servers():
    records = [server("a", 0), server("b", 1, age_s=6.0), server("c", 2), server("d", 1, status="moving")]
    decision = decide_role("auto", records, SWARM, NOW, has_data=True)
    assert (decision.role, decision.stage) == ("server", 1)


def test_auto_serves_until_every_stage_has_the_minimum_servers():
    swarm = SwarmConfig(num_stages=3, min_servers_per_stage=2)
    records = [server("a", 0), server("b", 0), server("c", 1), server("d", 1), server("e", 2)]
    decision = decide_role("auto", records, swarm, NOW, has_data=True)
    assert (decision.role, decision.stage) == ("server", 2)


def test_forced_roles_and_stage():
    records = [server("a", 0), server("b", 1), server("c", 2)]
    assert decide_role("server", records, SWARM, NOW, has_data=True).role == "server"
    assert decide_role("trainer", [], SWARM, NOW, has_data=True).role == "trainer"
    assert decide_role("auto", records, SWARM, NOW, has_data=True, stage=2).stage == 2


@pytest.mark.parametrize(
    "request_, stage, has_data, message",
    [
        ("server", 3, True, "this run has stages 0..2"),
        ("trainer", None, False, "needs the run's training data"),
        ("trainer", 1, True, "--stage is for stage servers"),
    ],
)
def test_roles_it_cannot_take_are_refused(request_, stage, has_data, message):
    with pytest.raises(ValueError, match=message):
        decide_role(request_, [], SWARM, NOW, has_data=has_data, stage=stage)
