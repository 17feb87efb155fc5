"""The runner fires triggered faults through one table keyed by the fault model's type (issue 27 item 4)."""

import typing

from hivetrain.chaos.fault_models import LAUNCH_TIME_KINDS, TRIGGERED_KINDS
from hivetrain.chaos.firing import FIRE


def test_every_triggered_kind_has_one_firing_and_no_launch_time_kind_has_any():
    kinds = [typing.get_args(model.model_fields["kind"].annotation)[0] for model in FIRE]
    assert sorted(kinds) == sorted(TRIGGERED_KINDS)
    assert not set(kinds) & set(LAUNCH_TIME_KINDS)
