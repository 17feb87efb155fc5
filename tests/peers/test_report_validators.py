"""The pipeline's report records (``swarm/reports.py``) under RecordGuard: good ones accepted, bad ones refused by
their rule (pure, time injected); chained after the signature check as a node runs it; a node on the code before
them passes their keys unchanged; a field added by a later version is accepted and ignored."""

from __future__ import annotations

import time

import pytest

from hivetrain.peers.validators import RecordGuard, key_id
from hivetrain.swarm.reports import (
    Move,
    RebalanceReport,
    TrainerReport,
    rebalances_key,
    trainer_reports_key,
)
from tests.peers.test_validators import NOW, Signer, _check, _node_validator, _signed


def _trainer(signer: Signer, **fields) -> dict:
    good = TrainerReport(
        peer_id=signer.peer_id,
        run_id="r",
        model_fingerprint="f",
        started_at=NOW - 100,
        microbatches=10,
        reroutes=2,
        last_reasons=("stage 1 QmX: dead: unreachable",),
        updated_at=NOW,
    )
    return {**good.model_dump(mode="json"), **fields}


def _rebalance(signer: Signer, **fields) -> dict:
    good = RebalanceReport(
        peer_id=signer.peer_id,
        run_id="r",
        model_fingerprint="f",
        stage=2,
        started_at=NOW - 100,
        rebalances=1,
        moves=(Move(at=NOW - 5, from_stage=0, to_stage=2, reason="stage 2 is the bottleneck"),),
        last_decision="stage 2 is the bottleneck",
        last_decision_at=NOW - 5,
        updated_at=NOW,
    )
    return {**good.model_dump(mode="json"), **fields}


def test_good_reports_are_accepted(alice):
    assert _check("trainer_report", _trainer(alice), alice.marker).ok
    assert _check("rebalance_report", _rebalance(alice), alice.marker).ok
    assert _check("trainer_report", _trainer(alice), alice.marker, expiration=NOW + 60).ok  # a trainer's last report


@pytest.mark.parametrize(
    ("kind", "fields", "expiration", "rule"),
    [
        ("trainer_report", {"microbatches": -1}, NOW + 5, "schema"),
        ("trainer_report", {"last_reasons": ["x"] * 5}, NOW + 5, "schema"),
        ("trainer_report", {"last_reasons": ["x" * 301]}, NOW + 5, "schema"),
        ("trainer_report", {"peer_id": "QmSomeoneElse"}, NOW + 5, "signer"),
        ("trainer_report", {"run_id": "other"}, NOW + 5, "run"),
        ("trainer_report", {"updated_at": NOW + 3600}, NOW + 3605, "time"),
        ("trainer_report", {}, NOW + 10**9, "expiration"),
        ("trainer_report", {"padding": "x" * 20_000}, NOW + 5, "size"),
        ("rebalance_report", {"moves": [{"at": NOW, "from_stage": 0, "to_stage": 1}] * 5}, NOW + 5, "schema"),
        ("rebalance_report", {"last_decision": "y" * 301}, NOW + 5, "schema"),
        ("rebalance_report", {"stage": -1}, NOW + 5, "schema"),
        ("rebalance_report", {"updated_at": NOW - 10_000}, NOW + 5, "time"),  # claims to be older than its lifetime
    ],
)
def test_a_bad_report_is_refused_by_its_rule(alice, kind, fields, expiration, rule):
    value = (_trainer if kind == "trainer_report" else _rebalance)(alice, **fields)
    verdict = _check(kind, value, alice.marker, expiration=expiration)
    assert not verdict.ok and verdict.rule == rule, verdict


def test_a_report_under_another_signers_subkey_is_refused(alice, mallory):
    assert _check("trainer_report", _trainer(alice), mallory.marker).rule == "signer"
    assert _check("rebalance_report", _rebalance(alice), b"not a marker").rule == "subkey"


def test_a_field_added_by_a_later_version_is_accepted_and_ignored(alice):
    value = _trainer(alice, tokens_per_s=123.0)
    assert _check("trainer_report", value, alice.marker).ok
    assert not hasattr(TrainerReport.model_validate(value), "tokens_per_s")


def test_the_guard_knows_the_report_keys_and_runs_after_the_signature_check(alice, mallory):
    now = time.time()
    honest = _node_validator(mallory, RecordGuard(run_ids=("r",), clock=lambda: now))
    good = _signed(alice, trainer_reports_key("r"), _trainer(alice, updated_at=now), now + 5)
    assert honest.validate(good)
    assert not honest.validate(_signed(alice, trainer_reports_key("r"), _trainer(alice, updated_at=now), now + 10**9))
    assert not honest.validate(
        _signed(alice, rebalances_key("r"), _rebalance(alice, stage=-1, updated_at=now), now + 5)
    )
    assert honest.validate(_signed(alice, rebalances_key("r"), _rebalance(alice, updated_at=now), now + 5))


def test_a_node_on_the_code_before_the_reports_passes_their_keys_unchanged(alice, mallory):
    """Mixed versions: the previous code's guard knew only the peer and stage keys of a run; a report (even one this
    code would refuse) passes it, so older nodes store and serve newer peers' reports and drop nothing."""
    now = time.time()
    old_guard = RecordGuard(run_ids=("r",), clock=lambda: now)
    for key in (trainer_reports_key("r"), rebalances_key("r")):
        del old_guard._keys[key_id(key)]
    old_node = _node_validator(mallory, old_guard)
    assert old_node.validate(_signed(alice, trainer_reports_key("r"), _trainer(alice, updated_at=now), now + 5))
    assert old_node.validate(_signed(alice, rebalances_key("r"), _rebalance(alice, updated_at=now), now + 5))
