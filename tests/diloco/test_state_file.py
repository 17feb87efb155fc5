"""A training state on disk (issue 24 item 4): the same bytes, hash and reads as in memory, one piece at a time."""

import json
import math
import struct
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file

from hivetrain.diloco import state_file
from hivetrain.diloco.state import TrainingState
from hivetrain.diloco.state_file import (
    StateFileInvalid,
    StateFileWriter,
    copy_state_file,
    meta_reference,
    state_hash_of_file,
    write_state_file,
)
from hivetrain.diloco.state_wire import flatten
from hivetrain.diloco.update_bound import step_norm


def _state(epoch, seed, n=70_000):
    gen = torch.Generator().manual_seed(seed)
    params = {"emb.weight": torch.randn(n, generator=gen), "h.0.w": torch.randn(31, 17, generator=gen)}
    params["norm"] = torch.randn((), generator=gen)
    momentum = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
    return TrainingState(epoch=epoch, params=params, momentum=momentum)


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    """Pieces of 4 KiB, so every state here spans many of them and pieces cross tensor boundaries."""
    monkeypatch.setattr(state_file, "PIECE_BYTES", 4096)


def test_a_state_written_to_disk_reads_back_the_same_bytes_hash_and_tensors(tmp_path):
    state = _state(7, seed=1)
    written = write_state_file(state, tmp_path / "s.safetensors")
    assert written.state_hash() == state.state_hash()
    assert written.read_range(0, written.num_bytes()) == flatten(state)
    assert written.read_range(1000, 9000) == flatten(state)[1000:9000]
    loaded = written.to_state()
    assert loaded.state_hash() == state.state_hash()
    plain = load_file(str(tmp_path / "s.safetensors"))  # a standard safetensors file
    assert set(plain) == set(state.to_flat_dict())
    assert all(torch.equal(plain[k], v) for k, v in state.to_flat_dict().items())


def test_a_meta_reference_holds_names_and_shapes_and_no_memory():
    model = torch.nn.Linear(4, 3)
    ref = meta_reference(model)
    assert list(ref.params) == ["weight", "bias"] and ref.params["weight"].shape == (3, 4)
    assert all(t.device.type == "meta" for t in ref.to_flat_dict().values())
    state = _state(0, seed=0)
    assert {k: v.shape for k, v in meta_reference(state).params.items()} == {
        k: v.shape for k, v in state.params.items()
    }


def test_a_writer_takes_chunks_in_any_order_and_checks_the_hash_and_every_value(tmp_path):
    state = _state(3, seed=2)
    flat = flatten(state)
    writer = StateFileWriter(tmp_path / "d.safetensors", meta_reference(state))
    chunks = list(range(0, len(flat), 10_000))
    for start in reversed(chunks):
        writer[start : min(start + 10_000, len(flat))] = flat[start : start + 10_000]
    assert writer.finish(3, "0" * 64) is None  # another hash: refused, the file kept for another try
    done = writer.finish(3, state.state_hash())
    assert done is not None and done.epoch == 3 and done.state_hash() == state.state_hash()
    assert done.to_state().state_hash() == state.state_hash()

    nan = bytearray(flat)
    nan[40:44] = struct.pack("<f", math.nan)
    bad = StateFileWriter(tmp_path / "n.safetensors", meta_reference(state))
    bad[0 : len(nan)] = bytes(nan)
    assert bad.finish(3, None) is None  # a NaN is never a state, whatever its hash
    bad.abandon()
    assert not (tmp_path / "n.safetensors").exists()
    with pytest.raises(ValueError, match="outside"):
        writer2 = StateFileWriter(tmp_path / "o.safetensors", meta_reference(state))
        writer2[len(flat) - 4 : len(flat) + 4] = b"x" * 8


def test_a_checkpoint_in_safetensors_own_order_is_copied_into_the_state_layout(tmp_path):
    state = _state(5, seed=3)
    save_file(state.to_flat_dict(), str(tmp_path / "ck.safetensors"))  # sorted by name, not our order
    copied = copy_state_file(tmp_path / "ck.safetensors", meta_reference(state), 5, tmp_path / "c.safetensors")
    assert copied.state_hash() == state.state_hash()
    assert copied.read_range(0, copied.num_bytes()) == flatten(state)
    digest, finite = state_hash_of_file(tmp_path / "ck.safetensors", list(state.params), 5)
    assert (digest, finite) == (state.state_hash(), True)


def test_a_state_of_another_model_is_told_from_a_corrupt_file(tmp_path):
    state = _state(5, seed=3)
    save_file(state.to_flat_dict(), str(tmp_path / "ck.safetensors"))
    other = meta_reference(_state(0, seed=4, n=100))
    with pytest.raises(StateFileInvalid) as raised:
        copy_state_file(tmp_path / "ck.safetensors", other, 5, tmp_path / "c.safetensors")
    assert raised.value.other_model and not (tmp_path / "c.safetensors").exists()
    raw = bytearray((tmp_path / "ck.safetensors").read_bytes())
    (tmp_path / "short.safetensors").write_bytes(bytes(raw[:-8]))  # the data no longer tiles the section
    with pytest.raises(StateFileInvalid) as raised:
        copy_state_file(tmp_path / "short.safetensors", meta_reference(state), 5, tmp_path / "c.safetensors")
    assert not raised.value.other_model and "cover" in raised.value.reason


def _forged(tmp_path, header: dict, data_bytes: int):
    raw = json.dumps(header).encode()
    path = tmp_path / "forged.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * data_bytes)
    return path


@pytest.mark.parametrize(
    "header, data_bytes, reason",
    [
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            12,
            "overlaps",
        ),  # fmt: skip
        ({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}, 4, "fp32"),
        ({"a": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 8]}}, 8, "shape"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 16, "cover"),
    ],
)
def test_a_forged_header_breaks_a_bound_and_is_refused(tmp_path, header, data_bytes, reason):
    path = _forged(tmp_path, header, data_bytes)
    with pytest.raises(StateFileInvalid, match=reason):
        state_hash_of_file(path, ["a"], 0)


def test_a_header_claiming_more_bytes_than_the_file_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(StateFileInvalid, match="header of"):
        state_hash_of_file(path, [], 0)


def test_the_step_between_states_on_disk_is_the_step_in_memory(tmp_path):
    old, new = _state(3, seed=5), _state(4, seed=6)
    on_disk = write_state_file(old, tmp_path / "o.safetensors"), write_state_file(new, tmp_path / "n.safetensors")
    in_memory = step_norm(old, new)
    assert step_norm(*on_disk) == pytest.approx(in_memory, rel=1e-12)
    assert step_norm(old, on_disk[1]) == pytest.approx(in_memory, rel=1e-12)


def test_a_state_file_stays_readable_after_its_path_is_unlinked(tmp_path):
    state = _state(2, seed=7)
    written = write_state_file(state, tmp_path / "s.safetensors")
    (tmp_path / "s.safetensors").unlink()
    assert written.read_range(0, 64) == flatten(state)[:64]
    written.close()
    with pytest.raises(OSError):
        written.read_range(0, 64)


def test_every_read_holds_one_piece_not_the_state(tmp_path, monkeypatch):
    """The largest single read or write while writing, hashing, copying and measuring a state is one piece."""
    sizes = []
    pread, pwrite = state_file.os.pread, state_file.os.pwrite
    monkeypatch.setattr(state_file.os, "pread", lambda fd, n, off: sizes.append(n) or pread(fd, n, off))
    monkeypatch.setattr(state_file.os, "pwrite", lambda fd, data, off: sizes.append(len(data)) or pwrite(fd, data, off))
    state = _state(1, seed=8)
    save_file(state.to_flat_dict(), str(tmp_path / "ck.safetensors"))
    copied = copy_state_file(tmp_path / "ck.safetensors", meta_reference(state), 1, tmp_path / "c.safetensors")
    written = write_state_file(state, tmp_path / "w.safetensors")
    step_norm(copied, written)
    header = 8 + state_file.header_width(meta_reference(state))
    assert state.num_bytes() > 50 * 4096 and max(sizes) <= max(4096, header)


def test_build_manifest_reads_the_file_as_it_reads_the_tensors(tmp_path):
    from hivetrain.diloco.state_wire import build_manifest, read_range, state_segments

    state = _state(2, seed=9)
    written = write_state_file(state, tmp_path / "s.safetensors")
    in_memory = build_manifest(
        2, state.state_hash(), partial(read_range, state_segments(state)), state.num_bytes(), 8192
    )
    on_disk = build_manifest(2, written.state_hash(), written.read_range, written.num_bytes(), 8192)
    assert on_disk == in_memory
