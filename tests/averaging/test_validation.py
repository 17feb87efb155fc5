"""Validation of weights and parts from the network, and the ban list's backoff, expiry and memory bound."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from hivetrain.averaging.codecs import CodecConfig, EncodedPart, make_codec
from hivetrain.averaging.validation import BadContribution, validate_part, validate_weight
from hivetrain.peers.bans import BanConfig, BanList


@pytest.mark.parametrize("w,expected", [(0, 0.0), (5, 5.0), (2.5, 2.5), (100.0, 100.0), (np.float32(3.0), 3.0)])
def test_validate_weight_accepts(w, expected: float) -> None:
    assert validate_weight(w, max_samples=100) == expected


@pytest.mark.parametrize("w", [float("nan"), float("inf"), -float("inf"), -1e-9, 100.5, True, "3", None, [1.0]])
def test_validate_weight_rejects(w) -> None:
    with pytest.raises(BadContribution) as info:
        validate_weight(w, max_samples=100)
    assert info.value.reason == "weight" and isinstance(info.value, ValueError)


def test_validate_weight_rejects_bad_local_bound() -> None:
    for bound in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="max_samples"):
            validate_weight(1.0, max_samples=bound)


def test_validate_part_accepts_tensor_without_copy_and_decodes_encoded() -> None:
    x = torch.randn(1000)
    assert validate_part(x, 1000) is x
    part = make_codec(CodecConfig("int8", 64)).encode(x)
    y = validate_part(part, 1000, allowed_codecs={"int8"})
    assert y.dtype == torch.float32 and y.shape == (1000,)
    assert float((y - x).abs().max()) <= float(x.abs().max()) / 254 * 1.001
    assert validate_part(torch.zeros(0), 0).shape == (0,)


def _reason(part, n: int = 100, **kwargs) -> str:
    with pytest.raises(BadContribution) as info:
        validate_part(part, n, **kwargs)
    return info.value.reason


@pytest.mark.parametrize("pos", [0, 50, 99])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_validate_part_rejects_non_finite(pos: int, bad: float) -> None:
    x = torch.randn(100)
    x[pos] = bad
    assert _reason(x) == "non_finite"
    assert _reason(x.half(), expected_dtype=torch.float16) == "non_finite"
    wire = EncodedPart("fp16", 100, x.half().numpy().tobytes())  # a peer can put NaN/Inf bit patterns on the wire
    assert _reason(wire, allowed_codecs={"fp16"}) == "non_finite"


def test_validate_part_rejects_wrong_size_dtype_type_codec() -> None:
    assert _reason(torch.randn(99)) == "size"
    assert _reason(torch.randn(101)) == "size"
    assert _reason(torch.randn(10, 10)) == "size"
    assert _reason(torch.randn(100, dtype=torch.float64)) == "dtype"
    assert _reason(torch.randn(100).half()) == "dtype"
    assert _reason(torch.randn(100).to_sparse()) == "dtype"
    assert _reason(np.zeros(100, dtype=np.float32)) == "type"
    assert _reason([0.0] * 100) == "type"
    int8 = make_codec(CodecConfig("int8", 64)).encode(torch.randn(100))
    assert _reason(int8, allowed_codecs={"int4"}) == "codec"
    assert _reason(int8, 120) == "size"
    assert _reason(EncodedPart("int8", 100, b"\x00" * 99, 64, "fp32", b"\x00" * 8)) == "malformed"
    nan_scales = EncodedPart("int8", 100, b"\x01" * 100, 64, "fp32", np.full(2, np.nan, np.float32).tobytes())
    assert _reason(nan_scales) == "non_finite"
    with pytest.raises(ValueError, match="expected_num_elements"):
        validate_part(torch.zeros(1), -1)


def test_ban_backoff_expiry_and_forgetting() -> None:
    bans = BanList(BanConfig(ban_base_s=10, backoff_factor=3, ban_max_s=100, forget_after_s=1000))
    r1 = bans.ban("peerA", now=0.0, reason="non_finite")
    assert (r1.until, r1.offences) == (10.0, 1)
    assert bans.is_banned("peerA", 9.99) and not bans.is_banned("peerA", 10.0)
    assert bans.check("peerA", 5.0) == (True, "banned until 10.0 (offence 1: non_finite)")
    assert bans.check("peerB", 5.0) == (False, "not banned")
    assert bans.ban("peerA", now=20.0).until == 20 + 30  # second offence: 10 * 3
    assert bans.ban("peerA", now=60.0).until == 60 + 90  # third: 10 * 9
    assert bans.ban("peerA", now=200.0).until == 200 + 100  # fourth: 270, capped at 100
    r5 = bans.ban("peerA", now=300.0 + 1000.0)  # last ban ended >= forget_after_s ago: a first offence again
    assert (r5.offences, r5.until) == (1, 1310.0)


def test_ban_extends_but_never_shortens_and_explicit_duration() -> None:
    bans = BanList(BanConfig(ban_base_s=10, backoff_factor=2, ban_max_s=1000))
    bans.ban("p", now=0.0, ban_time_s=500)
    r = bans.ban("p", now=1.0, ban_time_s=1)  # second offence: 1 * 2 = 2 s, but the 500 s ban stands
    assert r.until == 500.0 and r.offences == 2
    with pytest.raises(ValueError):
        bans.ban("p", now=0.0, ban_time_s=0)
    with pytest.raises(ValueError):
        bans.ban("", now=0.0)
    with pytest.raises(ValueError):
        bans.ban("p", now=float("nan"))
    bans.unban("p")
    assert not bans.is_banned("p", 2.0) and len(bans) == 0


def test_ban_active_prune_and_memory_bound() -> None:
    bans = BanList(BanConfig(ban_base_s=10, forget_after_s=50, max_entries=3))
    bans.ban("a", now=0.0)
    bans.ban("b", now=5.0)
    bans.ban("c", now=8.0, ban_time_s=100)
    assert [r.peer_id for r in bans.active(6.0)] == ["a", "b", "c"]
    assert [r.peer_id for r in bans.active(12.0)] == ["b", "c"]
    bans.ban("d", now=9.0)  # over max_entries: nothing forgotten yet, so the soonest-ending ("a") goes
    assert len(bans) == 3 and not bans.is_banned("a", 9.5) and bans.is_banned("d", 9.5)
    assert bans.prune(now=70.0) == 2  # b (ended 15) and d (ended 19) are forgotten; c ends at 108
    assert [r.peer_id for r in bans.active(70.0)] == ["c"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ban_base_s": 0},
        {"backoff_factor": 0.5},
        {"ban_max_s": 1.0, "ban_base_s": 2.0},
        {"forget_after_s": -1},
        {"max_entries": 0},
        {"ban_base_s": float("inf")},
    ],
)
def test_ban_config_rejects_bad_fields(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        BanConfig(**kwargs)


def test_ban_list_is_thread_safe() -> None:
    bans = BanList(BanConfig(ban_base_s=1, backoff_factor=1, max_entries=10_000))

    def worker(offset: int) -> None:
        for i in range(500):
            bans.ban(f"peer{offset}-{i}", now=float(i))
            bans.is_banned(f"peer{offset}-{i}", now=float(i))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads) and len(bans) == 2000
