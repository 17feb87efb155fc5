"""The corpus as streams (``hivetrain.data``): jsonl, json and parquet record files read through ``datasets``, text
files in blocks, a held-out set that every peer shares and training never sees, per-peer shard orders, a cursor
that resumes a restarted peer, and clear errors for a missing text field or a corpus too small."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hivetrain.data import is_held_out, iter_documents, list_shards, load_corpus, resolve_files, stream_seed
from hivetrain.data.config import DataConfig

DOC_RE = re.compile(rb"<d(\d+)>")


def _doc(i: int) -> str:
    """A document whose every 40-byte stretch names it: <d17> repeated, then some text."""
    return f"<d{i}> " * 8 + "the quick brown fox jumps over the lazy dog " * (1 + i % 5)


def _jsonl_shards(root, num_shards: int = 6, per_shard: int = 40) -> list[int]:
    ids = []
    for s in range(num_shards):
        with open(root / f"part-{s:03d}.jsonl", "w") as f:
            for j in range(per_shard):
                i = s * per_shard + j
                f.write(json.dumps({"id": i, "text": _doc(i)}) + "\n")
                ids.append(i)
    return ids


def _config(root, **kw) -> DataConfig:
    base = dict(paths=(str(root),), seq_len=32, batch_size=4, num_eval_windows=4, eval_fraction=0.1,
                shuffle_windows=8)  # fmt: skip
    return DataConfig(**{**base, **kw})


def _ids(windows) -> set[int]:
    return {int(m) for w in windows for m in DOC_RE.findall(bytes(np.asarray(w, dtype=np.uint8).tolist()))}


def test_jsonl_shards_stream_with_a_shared_held_out_set_training_never_sees(tmp_path):
    ids = _jsonl_shards(tmp_path)
    held = {i for i in ids if is_held_out(_doc(i).encode(), 0.1)}
    assert 0 < len(held) < len(ids) // 4  # ~10% of 240 documents, by content hash
    a, b = load_corpus(_config(tmp_path)), load_corpus(_config(tmp_path))
    assert a.digest == b.digest and len(a.shards) == 6 and {s.kind for s in a.shards} == {"json"}
    eval_a = a.eval_windows(32, 4)
    assert eval_a.shape == (4, 33) and eval_a.equal(b.eval_windows(32, 4))
    assert _ids(eval_a) <= held
    seen = []
    stream = a.train_windows(32, stream_seed(0, "peerA"))
    for _ in range(2000):  # more than one pass over the 240 documents
        seen.append(next(stream).copy())
    assert _ids(seen) == set(ids) - held  # every training document read, no held-out one


def test_peers_read_shards_in_their_own_orders_and_batches_are_shuffled(tmp_path):
    _jsonl_shards(tmp_path)
    corpus = load_corpus(_config(tmp_path))
    firsts = []
    for peer in ("peerA", "peerB", "peerC", "peerD"):
        window = next(corpus.train_windows(32, stream_seed(0, peer)))
        firsts.append(min(_ids([window])) // 40)  # the shard it starts with
    assert len(set(firsts)) >= 2
    batch = next(corpus.train_batches(32, 4, stream_seed(0, "peerA")))
    assert batch.shape == (4, 33) and batch.dtype.is_floating_point is False


def test_parquet_json_and_text_files_mix_in_one_corpus(tmp_path):
    table = pa.table({"body": [_doc(i) for i in range(100, 160)], "n": list(range(60))})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=16)
    (tmp_path / "b.json").write_text(json.dumps([{"body": _doc(i)} for i in range(200, 230)]))
    (tmp_path / "c.txt").write_text("".join(_doc(i) + "\n" for i in range(300, 340)))
    paths = (str(tmp_path / "a.parquet"), str(tmp_path / "b.json"), str(tmp_path / "c.txt"))
    corpus = load_corpus(_config(tmp_path, paths=paths, text_field="body"))
    assert [s.kind for s in corpus.shards] == ["parquet", "json", "text"]
    stream = corpus.train_windows(32, stream_seed(0, "x"))
    ids = _ids([next(stream).copy() for _ in range(1500)])
    assert {i // 100 for i in ids} == {1, 2, 3}
    docs = list(iter_documents(corpus.shards[0], "body", start=50))
    assert [i for i, _ in docs] == list(range(50, 60)) and docs[0][1] == _doc(150).encode()


def test_a_record_without_the_text_field_is_a_clear_error(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"content": "x" * 500}) + "\n")
    with pytest.raises(ValueError, match=r"no string field 'text'.*fields: \['content'\].*data.text_field"):
        load_corpus(_config(tmp_path))
    (tmp_path / "a.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="cannot read it as json"):
        load_corpus(_config(tmp_path))


def test_a_corpus_too_small_says_what_to_change(tmp_path):
    (tmp_path / "a.txt").write_text("tiny")
    with pytest.raises(ValueError, match="raise data.eval_fraction or lower data.seq_len"):
        load_corpus(_config(tmp_path))


def test_a_restarted_stream_resumes_at_its_cursor_and_a_bad_cursor_starts_over(tmp_path, caplog):
    data = tmp_path / "data"
    data.mkdir()
    _jsonl_shards(data, num_shards=5, per_shard=20)
    cursor = tmp_path / "cursor.json"
    seed = stream_seed(0, "peerA")
    reference = load_corpus(_config(data)).train_windows(32, seed)  # no cursor: the whole stream
    ref = [next(reference).copy() for _ in range(600)]
    first = load_corpus(_config(data), cursor_path=cursor)
    stream = first.train_windows(32, seed)
    consumed = []
    while not cursor.exists():  # the cursor is saved at the end of each shard
        consumed.append(next(stream).copy())
    saved = json.loads(cursor.read_text())
    assert saved["position"] == 1 and saved["document"] == 0 and saved["digest"] == first.digest
    stream.close()
    resumed = load_corpus(_config(data), cursor_path=cursor).train_windows(32, seed)
    again = [next(resumed).copy() for _ in range(100)]
    start = len(consumed) - 1  # the call that saved the cursor returned the next shard's first window
    assert np.array_equal(consumed[-1], again[0])  # the resumed stream goes on exactly where the first shard ended
    assert all(np.array_equal(x, y) for x, y in zip(again, ref[start : start + 100], strict=True))
    cursor.write_text("{garbage")
    with caplog.at_level(logging.WARNING):
        restarted = load_corpus(_config(data), cursor_path=cursor).train_windows(32, seed)
        assert np.array_equal(next(restarted), ref[0])
    assert "ignoring the unreadable data cursor" in caplog.text


def test_directories_walk_records_but_not_json_configs_and_the_cap_cuts_text_only(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    (tmp_path / "b.txt").write_text("y" * 10_000)
    (tmp_path / "c.txt").write_text("z" * 10_000)
    files = resolve_files([str(tmp_path)])
    assert [f.name for f in files] == ["a.jsonl", "b.txt", "c.txt"]
    shards = list_shards(files, max_bytes=15_000)
    room = 15_000 - 10_000 - (tmp_path / "a.jsonl").stat().st_size
    assert [(s.path.name, s.limit_bytes) for s in shards] == [("a.jsonl", 0), ("b.txt", 0), ("c.txt", room)]
    assert sum(len(d) for _, d in iter_documents(shards[2])) == shards[2].limit_bytes


def test_join_swarm_keeps_the_cursor_next_to_a_persistent_identity_only(tmp_path):
    from hivetrain.diloco.builder import data_cursor_path

    key = tmp_path / "peer.key"
    assert data_cursor_path(str(key), "run-a") == tmp_path / "peer.key.run-a.data-cursor.json"
    assert data_cursor_path(None, "run-a") is None  # a new identity each start: a new stream, nothing to resume
