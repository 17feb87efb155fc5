"""The bound on every outer step (``diloco.update_bound``): a pure function of a norm and the recent history."""

import math

import pytest
import torch

from hivetrain.config import RunConfig
from hivetrain.diloco.update_bound import UpdateNorms, l2_norm, update_bound


def test_an_update_k_times_the_recent_median_is_refused_with_the_numbers():
    history = [1.0, 2.0, 1.5, 100.0]  # one past outlier does not move the median (1.75)
    ok, why = update_bound(17.0, history, max_ratio=10.0, min_history=3)
    assert ok and "9.71x" in why
    ok, why = update_bound(50 * 1.75, history, max_ratio=10.0, min_history=3)
    assert not ok and "50.0x the median 1.75 of the last 4" in why and "max_update_ratio = 10" in why


def test_the_bound_waits_for_a_history_and_can_be_turned_off():
    assert update_bound(1e9, [1.0, 1.0], max_ratio=10.0, min_history=3)[0]  # a joiner: no scale yet
    assert update_bound(1e9, [1.0] * 5, max_ratio=0.0, min_history=3)[0]
    assert update_bound(1e9, [0.0] * 5, max_ratio=10.0, min_history=3)[0]  # no scale to bound by
    assert not update_bound(math.inf, [], max_ratio=0.0, min_history=3)[0]
    assert not update_bound(math.nan, [], max_ratio=10.0, min_history=3)[0]


def test_the_history_keeps_the_last_window_committed_norms():
    norms = UpdateNorms(3)
    for x in (1.0, 2.0, math.inf, 3.0, 4.0):
        norms.add(x)
    assert norms.history == (2.0, 3.0, 4.0)
    with pytest.raises(ValueError):
        UpdateNorms(0)


def test_the_norm_is_fp64_over_all_tensors_and_the_same_flat_or_split():
    g = torch.Generator().manual_seed(0)
    x = [torch.randn(3000, 700, generator=g), torch.randn(13, generator=g)]  # crosses a chunk boundary
    flat = torch.cat([t.reshape(-1) for t in x])
    want = math.sqrt(sum(float((t.double() ** 2).sum()) for t in x))
    assert l2_norm(x) == pytest.approx(want, rel=1e-12)
    assert l2_norm([flat]) == pytest.approx(want, rel=1e-12)
    assert l2_norm([torch.tensor([1.0, math.inf])]) == math.inf


def test_the_config_fields_validate():
    cfg = RunConfig.from_dict({"averaging": {"max_update_ratio": 0.0, "update_norm_window": 4}})
    assert cfg.averaging.max_update_ratio == 0.0 and cfg.averaging.update_norm_window == 4
    with pytest.raises(ValueError, match="update_norm_min_history"):
        RunConfig.from_dict({"averaging": {"update_norm_window": 2, "update_norm_min_history": 3}})
    with pytest.raises(ValueError):
        RunConfig.from_dict({"averaging": {"max_update_ratio": -1.0}})
    with pytest.raises(ValueError):
        RunConfig.from_dict({"diloco": {"max_carried_phases": 0}})
