"""``diloco.forecast``: a volunteer's predicted phase, round, compute utilization and share, before it joins."""

import pytest

from hivetrain.diloco.forecast import forecast

BASE = dict(
    samples_per_s=10.0, swarm_samples_per_s=30.0, num_trainers=3, schedule="swarm", inner_steps=50,
    samples_per_step=8, target_samples_per_epoch=0, strategy="butterfly", target_group_size=64, moshpit_rounds=2,
    wire_bytes=4_000_000, upload_bytes_per_s=1e6, download_bytes_per_s=2e6, overlap=False,
)  # fmt: skip


def test_swarm_schedule_one_group_closed_form():
    f = forecast(**BASE)
    # target 50 x 8 x 4 trainers = 1,600 samples over 40 samples/s in all
    assert f.phase_s == pytest.approx(40.0) and f.samples_per_phase == pytest.approx(400.0)
    assert f.group_size == 4 and f.round_bytes == int(2 * 3 / 4 * 4_000_000)
    assert f.round_s == pytest.approx(6.0)  # 6 MB at the 1 MB/s uplink, the slower direction
    assert f.utilization == pytest.approx(40.0 / 46.0) and f.share == pytest.approx(0.25)


def test_fixed_steps_and_overlap():
    f = forecast(**{**BASE, "schedule": "steps", "overlap": True})
    assert f.phase_s == pytest.approx(50 * 8 / 10.0)
    assert f.utilization == 1.0  # the 6 s round runs during the 40 s phase
    slow = forecast(**{**BASE, "overlap": True, "upload_bytes_per_s": 1e5})  # a 60 s round: it is the bottleneck
    assert slow.utilization == pytest.approx(40.0 / 60.0)


def test_more_trainers_than_one_group_pay_the_column_stage():
    f = forecast(**{**BASE, "num_trainers": 99, "target_group_size": 50, "swarm_samples_per_s": 990.0})
    assert f.group_size == 50
    assert f.round_bytes == int((2 * 49 / 50 + 2 * 1 / 2) * 4_000_000)  # rows of 50, 2 rows
    assert "two stages" in f.reason


def test_alone_sends_nothing_and_moshpit_runs_its_rounds():
    assert forecast(**{**BASE, "num_trainers": 0, "swarm_samples_per_s": 0.0}).round_bytes == 0
    f = forecast(**{**BASE, "strategy": "moshpit", "target_group_size": 2})
    assert f.round_bytes == int(2 * 2 * 1 / 2 * 4_000_000)


@pytest.mark.parametrize("field", ["samples_per_s", "upload_bytes_per_s", "download_bytes_per_s"])
def test_a_rate_that_is_not_positive_is_refused(field):
    with pytest.raises(ValueError, match=field):
        forecast(**{**BASE, field: 0.0})
