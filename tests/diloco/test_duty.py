"""Duty cycle and pause (diloco/duty.py): the budget arithmetic, pure; the pacing object on a fake clock, no sleeps."""

import math
import os
import random
import signal
import threading

import pytest

from hivetrain.diloco.duty import DutyCycle, decide_sleep, settle


class FakeTime:
    """A clock that only moves when someone waits; ``wait`` can oversleep by a rule and run a hook at each call."""

    def __init__(self, granularity_s: float = 0.0, jitter_s: float = 0.0, seed: int = 0):
        self.now = 1000.0
        self.granularity_s, self.jitter_s = granularity_s, jitter_s
        self.rng = random.Random(seed)
        self.waits: list[float] = []
        self.on_wait = None  # called with the number of waits so far, before the clock moves

    def clock(self) -> float:
        return self.now

    def wait(self, stop: threading.Event, timeout_s: float) -> None:
        self.waits.append(timeout_s)
        if self.on_wait is not None:
            self.on_wait(len(self.waits))
        if stop.is_set():
            return
        took = timeout_s
        if self.granularity_s:
            took = math.ceil(took / self.granularity_s) * self.granularity_s
        self.now += took + self.rng.uniform(0.0, self.jitter_s)

    def duty(self, fraction: float = 1.0, **kwargs) -> DutyCycle:
        return DutyCycle(fraction, clock=self.clock, wait=self.wait, **kwargs)


# ---- decide_sleep / settle: pure ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fraction", "expected_s"), [(1.0, 0.0), (0.5, 2.0), (0.25, 6.0), (0.1, 18.0)])
def test_a_step_owes_its_share_of_idle_time(fraction, expected_s):
    decision = decide_sleep(0.0, 2.0, fraction)
    assert decision.sleep_s == pytest.approx(expected_s)
    assert decision.owed_s == pytest.approx(expected_s)
    assert decision.reason


def test_shares_too_short_to_sleep_are_carried_not_dropped():
    owed, slept = 0.0, []
    for _ in range(10):  # 1 ms steps at 0.9: 0.11 ms owed each, below the 5 ms minimum sleep
        decision = decide_sleep(owed, 0.001, 0.9, min_sleep_s=0.005)
        slept.append(decision.sleep_s)
        owed = settle(decision.owed_s, decision.sleep_s)
    assert slept == [0.0] * 10 and owed == pytest.approx(10 * 0.001 / 9)
    decision = decide_sleep(owed, 0.04, 0.9, min_sleep_s=0.005)  # the carried time is slept with the next share
    assert decision.sleep_s == pytest.approx(0.05 / 9)


def test_an_oversleep_becomes_credit_for_the_next_sleep_and_credit_is_capped():
    first = decide_sleep(0.0, 1.0, 0.5)
    owed = settle(first.owed_s, 1.3)  # asked for 1 s, the timer gave 1.3 s
    assert owed == pytest.approx(-0.3)
    assert decide_sleep(owed, 1.0, 0.5).sleep_s == pytest.approx(0.7)
    assert settle(0.5, 3600.0, max_credit_s=1.0) == -1.0  # suspended mid-sleep: no hour of full-speed training
    assert decide_sleep(-5.0, 0.0, 0.5, max_credit_s=1.0).owed_s == -1.0


def test_idle_time_already_spent_pays_what_is_owed():
    assert decide_sleep(0.4, 1.0, 0.5, idle_s=1.2).sleep_s == pytest.approx(0.2)
    assert decide_sleep(0.4, 1.0, 0.5, idle_s=30.0).sleep_s == 0.0


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5, float("nan")])
def test_a_duty_cycle_outside_0_1_is_refused(fraction):
    with pytest.raises(ValueError, match="duty cycle"):
        decide_sleep(0.0, 1.0, fraction)
    with pytest.raises(ValueError, match="duty cycle"):
        DutyCycle(fraction)


# ---- DutyCycle on a fake clock --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fraction", [0.9, 0.5, 0.25, 0.1])
def test_long_run_ratio_converges_to_the_duty_cycle_with_jittery_steps_and_a_coarse_timer(fraction):
    """Steps from 1 ms to 60 ms, a timer that rounds every sleep up to 10 ms and adds up to 3 ms: the share of wall
    time in steps ends within 1% of F. A plain sleep of step·(1/F−1) after each step gives 0.51, 0.37, 0.22 and 0.096
    here for F = 0.9, 0.5, 0.25 and 0.1."""
    fake = FakeTime(granularity_s=0.010, jitter_s=0.003, seed=int(fraction * 100))
    duty = fake.duty(fraction)
    stop = threading.Event()
    rng = random.Random(7)
    start, compute = fake.now, 0.0
    for _ in range(5000):
        step_s = rng.choice([0.001, 0.002, 0.005]) if rng.random() < 0.7 else rng.uniform(0.01, 0.06)
        fake.now += step_s
        compute += step_s
        idle = duty.after_step(step_s, stop)
        assert idle >= 0.0
    ratio = compute / (fake.now - start)
    assert ratio == pytest.approx(fraction, rel=0.01)
    assert duty.slept_s == pytest.approx(fake.now - start - compute)


def test_full_duty_cycle_never_waits():
    fake = FakeTime()
    duty = fake.duty(1.0)
    for _ in range(100):
        assert duty.after_step(0.5, threading.Event()) == 0.0
    assert fake.waits == [] and duty.slept_s == 0.0


def test_slow_steps_owe_in_proportion():
    fake = FakeTime()
    duty = fake.duty(0.25)
    assert duty.after_step(0.1, threading.Event()) == pytest.approx(0.3)
    assert duty.after_step(2.0, threading.Event()) == pytest.approx(6.0)


def test_pause_blocks_until_resumed_polling_the_flag():
    fake = FakeTime()
    duty = fake.duty(1.0, poll_s=0.1)
    assert duty.toggle() is True and duty.paused
    fake.on_wait = lambda n: duty.resume() if n == 30 else None  # a signal handler resumes during the 30th wait
    idle = duty.after_step(0.2, threading.Event())
    assert len(fake.waits) == 30 and set(fake.waits) == {0.1}
    assert idle == pytest.approx(3.0) and duty.paused_s == pytest.approx(3.0)
    assert not duty.paused and duty.toggle() is True and duty.toggle() is False


def test_a_pause_pays_the_owed_sleep_and_earns_at_most_the_capped_credit():
    fake = FakeTime()
    duty = fake.duty(0.5, poll_s=0.1, max_credit_s=1.0)
    duty.pause()
    fake.on_wait = lambda n: duty.resume() if n == 100 else None  # paused 10 s
    assert duty.after_step(2.0, threading.Event()) == pytest.approx(10.0)  # no 2 s sleep on top of the pause
    assert duty.owed_s == -1.0
    fake.on_wait = None
    assert duty.after_step(2.0, threading.Event()) == pytest.approx(1.0)  # 2 s owed, 1 s of credit


def test_stop_ends_a_pause_and_skips_the_sleep():
    fake = FakeTime()
    duty = fake.duty(0.5, poll_s=0.1)
    stop = threading.Event()
    duty.pause()
    fake.on_wait = lambda n: stop.set() if n == 5 else None
    idle = duty.after_step(1.0, stop)
    assert len(fake.waits) == 5 and idle == pytest.approx(0.4)
    assert duty.paused  # stopping is not resuming


def test_stop_cuts_a_sleep_short_and_what_was_not_slept_stays_owed():
    fake = FakeTime()
    duty = fake.duty(0.25)
    stop = threading.Event()
    fake.on_wait = lambda n: stop.set()
    assert duty.after_step(1.0, stop) == 0.0
    assert fake.waits == [pytest.approx(3.0)] and duty.owed_s == pytest.approx(3.0)


def test_pause_file_pauses_while_it_exists_checked_at_most_every_half_second(tmp_path):
    path = tmp_path / "pause"
    checks: list[float] = []
    fake = FakeTime()

    def exists(p: str) -> bool:
        checks.append(fake.now)
        return os.path.exists(p)

    duty = fake.duty(1.0, pause_file=str(path), exists=exists, poll_s=0.1, file_check_s=0.5)
    stop = threading.Event()
    assert duty.after_step(0.01, stop) == 0.0 and not duty.paused
    fake.now += 0.2
    path.touch()
    assert duty.after_step(0.01, stop) == 0.0  # looked 0.2 s ago: not yet
    fake.now += 0.3
    fake.on_wait = lambda n: path.unlink() if n == 17 else None  # removed 1.6 s into the pause
    idle = duty.after_step(0.01, stop)
    assert idle == pytest.approx(2.0)  # seen removed at the next check of the file, 0.4 s later
    assert not duty.paused and duty.paused_s == pytest.approx(2.0)
    gaps = [b - a for a, b in zip(checks, checks[1:], strict=False)]
    assert min(gaps) >= 0.5 - 1e-9


def test_pause_file_and_flag_are_independent(tmp_path):
    path = tmp_path / "pause"
    fake = FakeTime()
    duty = fake.duty(1.0, pause_file=str(path), poll_s=0.1, file_check_s=0.5)
    path.touch()
    duty.pause()

    def on_wait(n: int) -> None:
        if n == 10:
            path.unlink()  # the file goes, the flag still holds
        if n == 40:
            duty.resume()

    fake.on_wait = on_wait
    assert duty.after_step(0.01, threading.Event()) == pytest.approx(4.0)


def test_sigusr1_toggles_the_pause_through_the_cli_handler():
    from hivetrain.cli.common import install_pause_handler

    duty = DutyCycle(1.0)
    previous = install_pause_handler(duty.toggle)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert duty.paused
        os.kill(os.getpid(), signal.SIGUSR1)
        assert not duty.paused
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("value", ["0", "1.5", "-1", "nan", "half"])
def test_join_swarm_refuses_a_bad_duty_cycle_naming_the_flag(value, capsys):
    from hivetrain.cli.join_swarm import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--duty-cycle", value])
    assert exc.value.code == 2
    assert "--duty-cycle" in capsys.readouterr().err


def test_join_swarm_accepts_duty_cycle_and_pause_file():
    from hivetrain.cli.join_swarm import build_parser

    args = build_parser().parse_args(["--duty-cycle", "0.25", "--pause-file", "/tmp/p"])
    assert args.duty_cycle == 0.25 and args.pause_file == "/tmp/p"
    assert build_parser().parse_args([]).duty_cycle == 1.0


def test_local_swarm_parses_one_duty_cycle_per_peer(capsys):
    from hivetrain.cli.local_swarm import build_parser

    assert build_parser().parse_args(["--out", "x", "--duty-cycles", "1,0.5, 0.25"]).duty_cycles == [1.0, 0.5, 0.25]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--out", "x", "--duty-cycles", "1,0"])
    assert "--duty-cycles" in capsys.readouterr().err
