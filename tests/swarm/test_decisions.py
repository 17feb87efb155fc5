"""Pure decisions: stochastic wiring, bans with backoff, rebalancing, the joiner's stage, the gradient ledger."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from hivetrain.peers.bans import BanConfig, BanList
from hivetrain.swarm import wire
from hivetrain.swarm.announce import StageRecord
from hivetrain.swarm.ledger import GradientLedger, LedgerEntry
from hivetrain.swarm.rebalance import choose_stage, decide_move, stage_throughputs
from hivetrain.swarm.routing import choose_server

NOW = 1_000.0


def rec(peer: str, stage: int, throughput: float, queue_len: int = 0, status="serving", age_s=0.0, **kw):
    return StageRecord(
        peer_id=peer,
        run_id="r",
        model_fingerprint="f",
        stage=stage,
        num_stages=3,
        status=status,
        throughput=throughput,
        queue_len=queue_len,
        updated_at=NOW - age_s,
        **kw,
    )


# ---- stochastic wiring and bans -------------------------------------------------------------------------------------


def test_choose_server_is_proportional_to_throughput_over_queue():
    records = [rec("fast", 1, 30.0), rec("slow", 1, 10.0), rec("queued", 1, 30.0, queue_len=2), rec("other", 0, 99.0)]
    bans, rng = BanList(BanConfig(ban_base_s=1.0, ban_max_s=10.0)), random.Random(0)
    picks = Counter(choose_server(records, 1, NOW, bans, rng)[0].peer_id for _ in range(20_000))
    # weights 30, 10, 30/3 = 10 -> 0.6, 0.2, 0.2; the stage-0 server is never a candidate
    assert set(picks) == {"fast", "slow", "queued"}
    assert picks["fast"] / 20_000 == pytest.approx(0.6, abs=0.02)
    assert picks["slow"] / 20_000 == pytest.approx(0.2, abs=0.02)
    assert picks["queued"] / 20_000 == pytest.approx(0.2, abs=0.02)


def test_choose_server_counts_this_trainers_inflight_work_and_skips_busy_excluded_and_banned():
    records = [rec("a", 0, 10.0), rec("b", 0, 10.0), rec("c", 0, 10.0, status="syncing"), rec("d", 0, 10.0)]
    bans, rng = BanList(BanConfig(ban_base_s=1.0, ban_max_s=10.0)), random.Random(1)
    bans.ban("d", NOW, reason="timeout")
    picks = Counter(choose_server(records, 0, NOW, bans, rng, inflight={"a": 3})[0].peer_id for _ in range(4000))
    assert set(picks) == {"a", "b"} and picks["b"] / 4000 == pytest.approx(0.8, abs=0.03)  # 10/4 vs 10
    chosen, _ = choose_server(records, 0, NOW, bans, rng, exclude={"a"})
    assert chosen.peer_id == "b"
    none, reason = choose_server(records, 0, NOW, bans, rng, exclude={"a", "b"})
    assert none is None and "1 not serving" in reason and "1 banned" in reason
    assert choose_server(records, 2, NOW, bans, rng)[0] is None


def _route_concurrently(records, stage, rng, num_microbatches):
    """Pick servers for microbatches sent one after another while all earlier ones are still in flight, as the
    trainer does up to ``max_inflight_microbatches``: each pick counts this trainer's in-flight work."""
    bans, inflight = BanList(BanConfig(ban_base_s=1.0, ban_max_s=10.0)), Counter()
    for _ in range(num_microbatches):
        inflight[choose_server(records, stage, NOW, bans, rng, inflight=inflight)[0].peer_id] += 1
    return inflight


def test_stochastic_wiring_spreads_concurrent_microbatches_over_a_stages_servers():
    """What the wiring guarantees about spread, with time and randomness fixed (the pipeline e2e test cannot: its
    weights follow measured throughput). Two equal servers, 4 microbatches in flight at once: all 4 land on one
    server with probability 1/3 * 1/4 * 1/5 = 1/60 (the in-flight count divides the weight), not 1/8 as with
    independent draws; and the e2e test's layout (3 stages x 2 servers, 8 microbatches, seed 5) uses every server."""
    pair = [rec("a", 0, 10.0), rec("b", 0, 10.0)]
    piled = sum(len(_route_concurrently(pair, 0, random.Random(seed), 4)) == 1 for seed in range(3000))
    assert piled / 3000 == pytest.approx(1 / 60, abs=0.006)
    layout = [rec(f"s{stage}{i}", stage, 10.0) for stage in range(3) for i in range(2)]
    rng = random.Random(5)
    used = Counter()
    for _ in range(2):  # 8 microbatches, 4 in flight at a time
        for stage in range(3):
            used.update(_route_concurrently(layout, stage, rng, 4))
    assert len(used) == 6 and sum(used.values()) == 24


def test_bans_back_off_exponentially_and_success_clears_strikes():
    bans = BanList(BanConfig(ban_base_s=2.0, ban_max_s=10.0))
    assert bans.ban("p", NOW, reason="x").until == NOW + 2.0
    assert bans.is_banned("p", NOW + 1.9) and not bans.is_banned("p", NOW + 2.1)
    assert bans.ban("p", NOW + 3, reason="x").until == NOW + 3 + 4.0
    assert bans.ban("p", NOW + 10, reason="x").until == NOW + 10 + 8.0
    assert bans.ban("p", NOW + 20, reason="x").until == NOW + 20 + 10.0  # capped
    bans.forgive("p")
    assert bans.is_banned("p", NOW + 25)  # forgiving clears strikes, not the ban in force
    assert bans.ban("p", NOW + 40, reason="x").until == NOW + 42.0
    assert bans.ban("q", NOW, reason="nan", weight=3).until == NOW + 8.0  # worse offences start longer
    assert bans.banned(NOW + 1) == {"p", "q"}
    with pytest.raises(ValueError):
        BanConfig(ban_base_s=5.0, ban_max_s=1.0)
    with pytest.raises(ValueError):
        bans.ban("p", NOW, weight=0)


# ---- rebalancing ---------------------------------------------------------------------------------------------------


def test_decide_move_moves_the_best_server_from_over_to_under_served_stage():
    records = [rec("a", 0, 10), rec("b", 0, 10), rec("c", 0, 10), rec("d", 1, 10), rec("e", 2, 10), rec("f", 2, 10)]
    assert stage_throughputs(records, 3) == [30, 10, 20]
    target, reason = decide_move(records, 0, NOW, margin=0.2)
    assert target == 1 and ">= 20.00 mb/s" in reason and "from 10.00 to 20.00" in reason
    # only one server of the donor stage moves (the lowest peer ID among equally good movers)
    assert decide_move(records, 0, NOW, 0.2, my_peer_id="a")[0] == 1
    assert decide_move(records, 0, NOW, 0.2, my_peer_id="b") == (None, "a is the better server of stage 0 to move")
    # servers of the bottleneck or of a stage with less spare throughput stay
    assert decide_move(records, 1, NOW, 0.2)[0] is None
    assert decide_move(records, 2, NOW, 0.2, my_peer_id="e")[0] is None


def test_decide_move_does_nothing_when_the_gain_is_under_the_margin():
    # stage throughputs [40, 20, 25]: moving a stage-0 server (worth 10 * 20/10 = 20 at stage 1) gives [30, 40, 25]:
    # both stages end >= 30, 10 above the old bottleneck, half of the 20 the mover brings
    records = [rec(p, 0, 10) for p in "abcz"] + [rec("d", 1, 20), rec("e", 2, 25)]
    target, reason = decide_move(records, 0, NOW, margin=0.6)
    assert target is None and ">= 30.00 mb/s" in reason and "brings 20.00" in reason and "20.00 to 25.00" in reason
    assert "not above the 60% margin" in reason
    assert decide_move(records, 0, NOW, margin=0.2)[0] == 1
    assert decide_move(records, 0, NOW, margin=0.5)[0] is None  # exactly the margin is not enough


def test_decide_move_acts_with_many_servers_per_stage_and_stops_near_balance():
    # 10 servers per stage; stage 1's are half as fast: [10, 5, 10] mb/s. One move changes the pipeline by 10%
    # (5 -> 5.5), which a margin on the pipeline's relative gain (20%) never allowed; the mover brings 0.5 mb/s and
    # adds all of it, so it moves
    fast = [rec(f"a{i}", 0, 1.0) for i in range(10)] + [rec(f"c{i}", 2, 1.0) for i in range(10)]
    records = fast + [rec(f"b{i}", 1, 0.5) for i in range(10)]
    target, reason = decide_move(records, 0, NOW, 0.2)
    assert target == 1 and ">= 5.50 mb/s" in reason and "from 5.00 to 5.50" in reason
    # near balance ([8, 7.5, 8]: 15 half-speed stage-1 servers) moving a stage-0 server would make stage 0 the
    # bottleneck at 7 mb/s: no gain, no move (the stages do not trade a server back and forth)
    balanced = fast[:8] + fast[10:18] + [rec(f"b{i}", 1, 0.5) for i in range(15)]
    target, reason = decide_move(balanced, 0, NOW, 0.2)
    assert target is None and ">= 7.00 mb/s (bottleneck now 7.50" in reason


def test_decide_move_relieves_one_of_several_tied_bottlenecks():
    # [60, 10, 10, 10]: no single move raises the pipeline's minimum (two stages stay at 10), but each move relieves one
    # bottleneck stage; three moves in a row reach [30, 20, 20, 20]
    records = [rec(f"a{i}", 0, 10) for i in range(6)] + [rec(p, s, 10) for p, s in (("b", 1), ("c", 2), ("d", 3))]
    records = [r.model_copy(update={"num_stages": 4}) for r in records]
    target, reason = decide_move(records, 0, NOW, 0.2)
    assert target == 1 and "from 10.00 to 10.00" in reason


def test_a_moving_server_counts_at_the_stage_it_moves_to():
    # [30, 10, 30] and a fourth stage-0 server already on its way to stage 1: the stages are [30, 20, 30] once it
    # arrives, and a second move would only make stage 0 the bottleneck (20 -> 20): nobody follows it
    records = [rec(p, 0, 10) for p in "abc"] + [rec("m", 0, 10, status="moving", moving_to=1), rec("d", 1, 10)]
    records += [rec(p, 2, 10) for p in "efg"]
    target, reason = decide_move(records, 0, NOW, 0.2)
    assert target is None and "[30.0, 20.0, 30.0]" in reason and ">= 20.00 mb/s (bottleneck now 20.00" in reason
    assert choose_stage(records, 3, NOW, 5.0)[0] == 1  # a joiner still goes to the least served stage
    # without moving_to (the record of an older server) the mover counts nowhere and a second server would follow
    unknown = [r.model_copy(update={"moving_to": None}) for r in records]
    assert decide_move(unknown, 0, NOW, 0.2)[0] == 1


def test_decide_move_estimates_cost_ratio_ignores_stale_and_keeps_a_server_per_stage():
    # stage 1 servers are half as fast as stage 0's: a mover brings 20 * (5 / 20) = 5 mb/s to stage 1
    records = [rec("a", 0, 20), rec("b", 0, 20), rec("c", 1, 5), rec("d", 2, 30)]
    target, reason = decide_move(records, 0, NOW, 0.2)
    assert target == 1 and "from 5.00 to 10.00" in reason
    # a lone server never leaves its stage
    lone = [rec("a", 0, 100), rec("c", 1, 5), rec("d", 2, 100)]
    assert decide_move(lone, 0, NOW, 0.2)[0] is None
    # an empty stage is the bottleneck; stale records (a dead server) do not count
    stale = [rec("a", 0, 10), rec("b", 0, 10), rec("c", 1, 10, age_s=60), rec("d", 2, 10)]
    assert decide_move(stale, 0, NOW, 0.2, max_age_s=5.0, num_stages=3)[0] == 1
    with pytest.raises(ValueError):
        decide_move(records, 5, NOW, 0.2)


def test_choose_stage_picks_the_least_served_stage():
    records = [rec("a", 0, 10), rec("b", 1, 30), rec("c", 2, 10), rec("d", 2, 10)]
    assert choose_stage(records, 3, NOW, 5.0)[0] == 0
    assert choose_stage([], 3, NOW, 5.0)[0] == 0
    assert choose_stage([rec("a", 0, 10), rec("c", 2, 10, age_s=60)], 3, NOW, 5.0)[0] == 1


# ---- the gradient ledger -------------------------------------------------------------------------------------------


def entry(peer: str, window: int, mb: str, incarnation="i1", stage=1):
    x = wire.encode(torch.zeros(1, 2, 4))
    return LedgerEntry(stage, mb, peer, incarnation, window, x, x)


def test_ledger_drops_committed_windows_and_replays_abandoned_ones_exactly_once():
    ledger = GradientLedger()
    for e in [entry("a", 0, "m0"), entry("a", 0, "m1"), entry("a", 1, "m2"), entry("a", 2, "m3"), entry("b", 0, "m4")]:
        ledger.add(e)
    replay = ledger.observe("a", "i1", open_window=2, abandoned=(1,))
    assert [e.microbatch_id for e in replay] == ["m2"]  # window 1 abandoned
    assert ledger.num_durable == 2  # window 0 committed
    assert [e.microbatch_id for e in ledger.entries["a"]] == ["m3"]  # window 2 still open
    assert ledger.observe("a", "i1", open_window=2, abandoned=(1,)) == []  # nothing twice
    # a new incarnation (restart / reset after a stall) loses everything uncommitted
    assert [e.microbatch_id for e in ledger.observe("a", "i2", 0, ())] == ["m3"]
    # a server whose record vanished is replayed in full
    assert [e.microbatch_id for e in ledger.observe_live({})] == ["m4"]
    assert len(ledger) == 0 and ledger.num_bytes == 0


def test_ledger_byte_cap_drops_the_oldest_entries_unprotected():
    one = entry("a", 0, "m0").num_bytes()
    ledger = GradientLedger(max_num_bytes=2 * one)
    ledger.add(entry("a", 0, "m0"))
    ledger.add(entry("b", 0, "m1"))
    ledger.add(entry("a", 0, "m2"))
    assert ledger.num_unprotected == 1
    assert sorted(e.microbatch_id for v in ledger.entries.values() for e in v) == ["m1", "m2"]
