"""The coordinator follows trainers on evidence: a majority of live trainers, never a lone liar; it bans the
trainers whose epochs the run's age rules out. The network is faked: the loop records which download it was asked
for and hands back a state of that epoch."""

from types import SimpleNamespace

import pytest
import torch

import hivetrain.coordinator.follower as follower_module
from hivetrain.coordinator.follower import FollowerOptions, StateFollower
from hivetrain.diloco.state import TrainingState
from tests.records import peer_record

NOW = 10_000.0


def state(epoch: int) -> TrainingState:
    return TrainingState(epoch, {"w": torch.full((2,), float(epoch))}, {"w": torch.zeros(2)})


class FakeLoop:
    """Runs nothing: records the donors of each state download and returns the state of the epoch they hold."""

    def __init__(self, epochs: dict[str, int]):
        self.epochs, self.downloads = epochs, []

    def run(self, coro, timeout_s):
        donors = coro.cr_frame.f_locals["donors"]
        coro.close()
        self.downloads.append(tuple(donors))
        return state(self.epochs[donors[0]])


def make(epochs: dict[str, int], **options) -> tuple[StateFollower, FakeLoop]:
    loop = FakeLoop(epochs)
    node = SimpleNamespace(peer_id="coord", dht=None)
    follower = StateFollower(node, loop, "r", state(0), None, {}, "f", FollowerOptions(**options))
    follower._p2p = None
    return follower, loop


def rec(peer: str, epoch: int) -> object:
    return peer_record(peer, epoch, NOW, state_hash=state(epoch).state_hash() if peer != "liar" else "random")


@pytest.fixture(autouse=True)
def dht_time(monkeypatch):
    monkeypatch.setattr(follower_module, "get_dht_time", lambda: NOW)


def test_the_coordinator_follows_a_lone_trainer_but_not_one_liar_against_it():
    follower, loop = make({"a": 4})
    assert follower.step([rec("a", 4)]).startswith("downloaded epoch 4")
    assert loop.downloads == [("a",)] and follower.current().epoch == 4
    follower, loop = make({"a": 4, "liar": 9})
    liar = peer_record("liar", 4, NOW, state_hash="random")  # the same epoch, another state: one word against one
    assert follower.step([rec("a", 4), liar]) == "in sync" and loop.downloads == []


def test_the_coordinator_bans_an_epoch_the_runs_age_rules_out_and_follows_the_honest_pair():
    follower, loop = make({"a": 4, "b": 4}, run_started_at=NOW - 600.0)  # 600 s: 6600 epochs at most
    assert follower.step([rec("a", 4), rec("b", 4), rec("liar", 10**6)]).startswith("downloaded epoch 4")
    assert loop.downloads == [("a", "b")]
    assert [b.peer_id for b in follower.bans.active(NOW)] == ["liar"]


def test_at_a_runs_start_the_coordinator_follows_no_lone_liar_among_trainers_still_at_epoch_0():
    # chaos lying-epoch-takeover: before the honest peers' first commit the liar was the only trained record, "1 of 1"
    follower, loop = make({"a": 0, "b": 0, "c": 0, "liar": 500})
    records = [rec("a", 0), rec("b", 0), rec("c", 0), rec("liar", 500)]
    assert follower.step(records) == "in sync" and loop.downloads == []
    # far past the run-age bound it is banned too, though the follower's quorum takes a lone holder
    follower, loop = make({"a": 0, "b": 0, "liar": 100_000}, run_started_at=NOW - 30.0)
    assert follower.step([rec("a", 0), rec("b", 0), rec("liar", 100_000)]) == "in sync" and loop.downloads == []
    assert [b.peer_id for b in follower.bans.active(NOW)] == ["liar"]
    # alone, a trainer is still followed (a one-trainer run stays joinable through the coordinator)
    follower, loop = make({"a": 3}, run_started_at=NOW - 30.0)
    assert follower.step([rec("a", 3)]).startswith("downloaded epoch 3")


def test_a_restarted_coordinator_keeps_its_checkpoint_from_before_an_adoption_it_could_not_bound(tmp_path):
    """Issue 28: after a restart the coordinator has no step history, so the first state it follows is taken on the
    trainers' word; the checkpoint it restored from stays on disk whatever keep_checkpoints says."""
    from hivetrain.coordinator.checkpoint import CheckpointStore

    store = CheckpointStore(tmp_path, keep_last=1)
    store.save(state(40), {})
    loop = FakeLoop({"a": 41, "b": 41})
    node = SimpleNamespace(peer_id="coord", dht=None)
    follower = StateFollower(node, loop, "r", state(0), store, {}, "f", FollowerOptions(checkpoint_every=1))
    follower._p2p = None
    assert follower.restore() == 40
    assert follower.step([rec("a", 41), rec("b", 41)]).startswith("downloaded epoch 41")
    epoch, reason = store.protected()
    assert epoch == 40 and "epoch 41 adopted unchecked" in reason and "we hold epoch 40" in reason
    assert [c.epoch for c in store.list(verify=False)] == [41, 40]  # keep_last 1, and the protected one


def test_the_runs_last_epoch_is_checkpointed_whatever_the_checkpoint_interval(tmp_path):
    """Issue 26: a run of 3 outer steps checkpointed every 5 epochs ended with no checkpoint of its final state."""
    from hivetrain.coordinator.checkpoint import CheckpointStore

    store = CheckpointStore(tmp_path, keep_last=3)
    node = SimpleNamespace(peer_id="coord", dht=None)
    run = {"diloco": {"outer_steps": 3}}
    loop = FakeLoop({"a": 2, "b": 2})
    follower = StateFollower(node, loop, "r", state(0), store, run, "f", FollowerOptions(checkpoint_every=5))
    follower._p2p = None
    follower.step([rec("a", 2), rec("b", 2)])
    assert store.list(verify=False) == []  # epoch 2: neither a multiple of 5 nor the last
    loop.epochs = {"a": 3, "b": 3}
    assert follower.step([rec("a", 3), rec("b", 3)]).startswith("downloaded epoch 3")
    assert 3 in [c.epoch for c in store.list(verify=False)]  # (2 too: kept before an adoption it could not bound)
    never = StateFollower(node, FakeLoop({"a": 3, "b": 3}), "r", state(0), CheckpointStore(tmp_path / "n", keep_last=1),
                          run, "f", FollowerOptions(checkpoint_every=0))  # fmt: skip
    never._p2p = None
    never.step([rec("a", 3), rec("b", 3)])
    assert not (tmp_path / "n").exists()  # 0 = never, the last epoch included


def test_each_adopted_state_and_checkpoint_is_an_event_with_its_epoch(tmp_path):
    """The coordinator's ``--metrics-file`` lines (the chaos harness reads the epochs it adopted from them)."""
    from hivetrain.coordinator.checkpoint import CheckpointStore

    events: list[dict] = []
    node = SimpleNamespace(peer_id="coord", dht=None)
    store = CheckpointStore(tmp_path, keep_last=3)
    follower = StateFollower(node, FakeLoop({"a": 2, "b": 2}), "r", state(0), store, {}, "f",
                             FollowerOptions(checkpoint_every=2), on_event=events.append)  # fmt: skip
    follower._p2p = None
    follower.step([rec("a", 2), rec("b", 2)])
    assert [(e["event"], e["epoch"]) for e in events] == [("state_downloaded", 2), ("checkpoint_saved", 2)]
    assert events[0]["state_hash"] == state(2).state_hash() and events[0]["reason"]


# ---- issue 24: states on disk, no θ₀ of our own ---------------------------------------------------------------------


def meta() -> TrainingState:
    from hivetrain.diloco.state_file import meta_reference

    return meta_reference(state(0))


class DiskLoop(FakeLoop):
    """``FakeLoop`` for a follower with a work directory: the state it hands back is written where the download was
    told to write it (``into``), as ``fetch_state`` does."""

    def run(self, coro, timeout_s):
        from hivetrain.diloco.state_file import write_state_file

        into = coro.cr_frame.f_locals["into"]
        assert into is not None, "a follower with a work directory downloads into a file"
        return write_state_file(super().run(coro, timeout_s), into, meta())


def test_a_follower_without_theta0_takes_the_quorums_and_keeps_every_state_on_disk(tmp_path):
    """The coordinator of a model too big to build holds no θ₀: it publishes epoch 0 with no hash, downloads the
    trainers' θ₀ by quorum, follows each step with its bound, checkpoints by hard link, and keeps a few files."""
    from hivetrain.coordinator.checkpoint import CheckpointStore
    from hivetrain.diloco.state_file import StateFile

    store, work = CheckpointStore(tmp_path / "ck", keep_last=2), tmp_path / "work"
    work.mkdir()
    (work / "state-000009.safetensors").write_bytes(b"left by a killed coordinator")
    node = SimpleNamespace(peer_id="coord", dht=None)
    loop = DiskLoop({"a": 0, "b": 0})
    follower = StateFollower(node, loop, "r", None, store, {}, "f", FollowerOptions(checkpoint_every=1),
                             reference=meta(), work_dir=work)  # fmt: skip
    follower._p2p = None
    assert follower.current() is None and follower.epoch == 0 and follower.state_hash == ""
    assert not (work / "state-000009.safetensors").exists()
    assert follower.step([rec("a", 0), rec("b", 0)]).startswith("downloaded epoch 0")
    for epoch in range(1, 8):
        loop.epochs = {"a": epoch, "b": epoch}
        assert follower.step([rec("a", epoch), rec("b", epoch)]).startswith(f"downloaded epoch {epoch}")
        held = follower.current()
        assert isinstance(held, StateFile) and held.state_hash() == state(epoch).state_hash()
        follower.server.observe()  # as a joiner's manifest request does
    assert len(follower.steps.history) == 7  # every step from θ₀ on was measured
    assert [p.name for p in work.glob("state-*.safetensors")] == ["state-000008.safetensors"]  # the current only
    previous = follower.server._recent[0].state  # served still: its name is gone, its bytes are not
    assert [s.state.epoch for s in follower.server._recent] == [6, 7] and not previous.path.exists()
    assert previous.to_state().state_hash() == state(6).state_hash()
    newest = store.list()[0]
    assert newest.epoch == 7 and newest.status == "ok"
    assert (newest.path / "state.safetensors").stat().st_ino == held.inode[1]

    restarted = StateFollower(node, DiskLoop({}), "r", None, store, {}, "f", FollowerOptions(),
                              reference=meta(), work_dir=work)  # fmt: skip
    assert restarted.restore() == 7 and restarted.state_hash == state(7).state_hash()


def test_a_refused_download_leaves_no_file_behind(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    node = SimpleNamespace(peer_id="coord", dht=None)
    loop = DiskLoop({"a": 1, "b": 1})
    follower = StateFollower(node, loop, "r", state(0), None, {}, "f", FollowerOptions(step_min_history=0),
                             reference=meta(), work_dir=work)  # fmt: skip
    follower._p2p = None
    follower.steps.add(1e-6)  # the run's steps are tiny: θ₀ -> θ₁ (w += 1) is far beyond them
    assert follower.step([rec("a", 1), rec("b", 1)]).startswith("refused epoch 1")
    assert [p.name for p in work.glob("state-*.safetensors")] == ["state-000001.safetensors"]  # θ₀ only
    assert follower.epoch == 0


def test_a_killed_coordinators_temporary_state_directory_is_removed_by_the_next(tmp_path, monkeypatch):
    """Without --checkpoint-dir the follower's states live in a temporary directory named with the coordinator's pid;
    one left by a coordinator that was killed (gigabytes for a big model) goes at the next start, a live one stays."""
    import os
    import tempfile
    from types import SimpleNamespace

    from hivetrain.cli.coordinator import _follower_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    pid_max = int(open("/proc/sys/kernel/pid_max").read())
    dead, live = tmp_path / f"hivetrain-follower-{pid_max + 1}-ab", tmp_path / f"hivetrain-follower-{os.getpid()}-cd"
    for stale in (dead, live):
        stale.mkdir()
        (stale / "state-000001.safetensors").write_bytes(b"x")
    made = _follower_dir(SimpleNamespace(checkpoint_dir=None))
    assert not dead.exists() and live.exists() and made.parent == tmp_path
    assert made.name.startswith(f"hivetrain-follower-{os.getpid()}-")
