"""PhaseRunner: what a peer publishes about its inner phase (progress, the phase that ended, throughput)."""

import itertools
import threading

import torch

from hivetrain.diloco.config import DilocoConfig
from hivetrain.diloco.duty import DutyCycle
from hivetrain.diloco.inner import InnerOptimizer
from hivetrain.diloco.phase import PhaseRunner
from hivetrain.diloco.schedule import PhasePlan
from hivetrain.model import build_config, build_model

B, T = 2, 8


def runner(inner_steps: int) -> PhaseRunner:
    model = build_model(build_config("tiny", vocab_size=64, max_seq_len=T + 1), seed=0)
    gen = torch.Generator().manual_seed(0)
    batches = (torch.randint(0, 64, (B, T + 1), generator=gen) for _ in itertools.count())
    plan = PhasePlan(schedule="steps", inner_steps=inner_steps, batch_size=B)
    inner = InnerOptimizer(model, DilocoConfig(inner_steps=inner_steps, warmup_steps=1))
    return PhaseRunner(inner, batches, plan, DutyCycle(1.0), "me")


def test_an_ended_phase_is_published_as_done_until_a_phase_for_the_same_round_starts_again():
    phases = runner(inner_steps=3)
    assert phases.done == (0, 0)
    phases.begin(5)
    assert phases.progress == (5, 0)
    result = phases.run(lambda: [], threading.Event(), lambda i, loss: None)
    assert result.inner.num_steps == 3 and phases.done == (5, 3 * B) and phases.progress == (5, 3 * B)
    assert phases.throughput == phases.last_rate > 0  # between phases: the ended phase's rate
    phases.begin(6)  # overlap: the next round's phase; the ended one stays visible to the slower peers
    assert phases.done == (5, 3 * B) and phases.progress == (6, 0)
    phases.run(lambda: [], threading.Event(), lambda i, loss: None)
    phases.begin(6)  # the round for 6 failed: a new phase for 6 runs anew, nobody may count the old one as done
    assert phases.done == (0, 0)


def test_a_phase_whose_others_end_before_our_first_step_would_runs_no_step_and_keeps_our_pace():
    from hivemind.utils import get_dht_time

    from tests.records import peer_record

    phases = runner(inner_steps=3)
    phases.plan = PhasePlan(schedule="swarm", inner_steps=3, batch_size=B)
    phases.begin(5)
    phases.run(lambda: [], threading.Event(), lambda i, loss: None)  # alone: 3 steps, and our pace measured
    pace = phases.last_rate
    assert pace > 0
    # both others ended their phase for epoch 6 with the whole target (3 peers x 3 steps x B): they wait for us
    others = [
        peer_record(p, 5, get_dht_time(), phase_epoch=7, done_epoch=6, done_samples=9 * B, throughput=50.0)
        for p in ("a", "b")
    ]
    steps: list[int] = []
    phases.begin(6)
    result = phases.run(lambda: others, threading.Event(), lambda i, loss: steps.append(i))
    assert result.inner.num_steps == 0 and result.inner.num_samples == 0 and steps == []
    assert phases.done == (6, 0) and phases.last_rate == pace  # the next phase still knows how long our step is
