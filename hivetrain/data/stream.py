"""The corpus as streams: a held-out set every peer shares, and each peer's endless, shuffled stream of training
windows, tokenized lazily and packed into fixed-length windows, never the whole corpus in memory.

Held-out split: a document (``sources``) is held out when the first 8 bytes of its BLAKE2b hash, read as a fraction
of 2^64, fall below ``data.eval_fraction``: a pure function of its content, so every peer holds out the same
documents without reading the corpus first, wherever its files live. Training skips them. The evaluation windows
are the first ``num_eval_windows`` windows packed from held-out documents in the corpus's sorted order (the same on
every peer; the scan stops as soon as they are found, so it reads about ``num_eval_windows * (seq_len + 1) /
eval_fraction`` tokens of the corpus).

Training streams: each peer reads whole shards (files) in its own random order (a permutation per pass, seeded by
the peer's stream seed and the pass number), so two peers rarely read the same shard at the same time, and a peer
that leaves leaves no hole: every peer's order covers every shard. Documents are packed back to back (with the
tokenizer's separator between them) into windows of ``seq_len + 1`` tokens, within a shard (its last partial window
is dropped); a buffer of ``data.shuffle_windows``
windows shuffles them before they are batched. With a cursor file the stream saves its position (pass, shard,
document) atomically at every shard's end and every ``CURSOR_SAVE_INTERVAL_S`` seconds, and a restarted peer
resumes there (losing at most the windows that were in its shuffle buffer).

Memory: the shuffle buffer, one document, and what ``datasets`` holds for one record batch: nothing grows with the
corpus (``scripts/bench/data_stream.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from hivetrain.data.sources import Shard, iter_documents
from hivetrain.data.tokenizers import ByteTokenizer, LocalTokenizer

logger = logging.getLogger(__name__)

CURSOR_SAVE_INTERVAL_S = 30.0


def is_held_out(document: bytes, eval_fraction: float) -> bool:
    """Whether ``document`` (UTF-8 bytes) belongs to the held-out set: a pure function of its content."""
    h = int.from_bytes(hashlib.blake2b(document, digest_size=8).digest(), "little")
    return h < eval_fraction * 2**64


def pack(tokens: Iterator[np.ndarray], separator: np.ndarray, window: int) -> Iterator[np.ndarray]:
    """Pack documents' tokens back to back (``separator`` after each) into windows of ``window`` tokens.

    Yields (window,) arrays of the documents' dtype; they may be views: copy what you keep. The tail that does not
    fill a window is carried into the next document; each document is copied once.
    """
    carry = separator[:0]
    for toks in tokens:
        data = np.concatenate([carry, toks, separator])
        num = len(data) // window
        for i in range(num):
            yield data[i * window : (i + 1) * window]
        carry = data[num * window :].copy()


@dataclass
class StreamCursor:
    """Where a training stream is: pass number, position in that pass's shard order, next document of that shard."""

    pass_index: int = 0
    position: int = 0
    document: int = 0


@dataclass
class Corpus:
    """A corpus read as streams (module docstring).

    Attributes:
        shards: the corpus's files in sorted order.
        tokenizer: bytes or a local transformers tokenizer.
        text_field: the field of a record that holds its text.
        eval_fraction: the fraction of documents held out, in (0, 0.5).
        vocab_size: the tokenizer's vocabulary size.
        digest: sha256 (hex) of the shard list (names, sizes), the tokenizer, the text field and the held-out
            fraction: equal on peers that read the same corpus the same way.
        shuffle_windows: windows in each training stream's shuffle buffer.
        cursor_path: where training streams keep their position (None = they start over on restart).
    """

    shards: list[Shard]
    tokenizer: ByteTokenizer | LocalTokenizer
    text_field: str
    eval_fraction: float
    vocab_size: int
    digest: str
    shuffle_windows: int = 512
    cursor_path: Path | None = None
    _eval_cache: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def documents(self, held_out: bool) -> Iterator[np.ndarray]:
        """Tokens of the held-out (or the training) documents, all shards in sorted order."""
        for shard in self.shards:
            for _, doc in iter_documents(shard, self.text_field):
                if doc and is_held_out(doc, self.eval_fraction) == held_out:
                    yield self.tokenizer.encode(doc)

    def eval_windows(self, seq_len: int, num_windows: int) -> torch.Tensor:
        """(n, seq_len + 1) int64 held-out windows, the same on every peer; n = ``num_windows`` unless the corpus
        holds fewer (then all it holds, with a warning).

        Raises:
            ValueError: the held-out documents do not fill one window (the message says what to change).
        """
        key = (seq_len, num_windows)
        if key not in self._eval_cache:
            windows = []
            for w in pack(self.documents(held_out=True), self.tokenizer.separator(), seq_len + 1):
                windows.append(w.astype(np.int64))
                if len(windows) == num_windows:
                    break
            if not windows:
                raise ValueError(
                    f"the held-out documents ({self.eval_fraction:.1%} of the corpus's documents, chosen by content "
                    f"hash) do not fill one window of {seq_len + 1} tokens: add text, raise data.eval_fraction or "
                    "lower data.seq_len"
                )
            if len(windows) < num_windows:
                logger.warning("the corpus holds %d held-out windows, not %d: evaluating on those", len(windows),
                               num_windows)  # fmt: skip
            self._eval_cache[key] = torch.from_numpy(np.stack(windows))
        return self._eval_cache[key].clone()

    def train_windows(
        self, seq_len: int, stream_seed: int, clock: Callable[[], float] = time.monotonic
    ) -> Iterator[np.ndarray]:
        """One peer's endless stream of (seq_len + 1,) training windows, unshuffled (module docstring).

        Raises:
            ValueError: a whole pass over the corpus yields no training window (corpus too small).
        """
        cursor = self._load_cursor(stream_seed)
        separator, window = self.tokenizer.separator(), seq_len + 1
        last_save = clock()
        while True:
            order = np.random.default_rng([stream_seed, cursor.pass_index]).permutation(len(self.shards))
            produced, whole_pass = 0, cursor.position == 0 and cursor.document == 0
            while cursor.position < len(order):
                shard = self.shards[int(order[cursor.position])]
                # windows never span shards (``pack`` starts each shard afresh): a stream resumed at a shard's start
                # is exact
                for w in pack(self._training_tokens(shard, cursor), separator, window):
                    produced += 1
                    yield w
                    if self.cursor_path is not None and clock() - last_save >= CURSOR_SAVE_INTERVAL_S:
                        self._save_cursor(stream_seed, cursor)  # past the document being packed: near, not exact
                        last_save = clock()
                cursor.position, cursor.document = cursor.position + 1, 0
                self._save_cursor(stream_seed, cursor)
            if produced == 0 and whole_pass:
                raise ValueError(
                    f"the corpus has no training window of {window} tokens outside the held-out documents: add text "
                    "or lower data.seq_len"
                )
            cursor = StreamCursor(cursor.pass_index + 1, 0, 0)

    def _training_tokens(self, shard: Shard, cursor: StreamCursor) -> Iterator[np.ndarray]:
        """Tokens of ``shard``'s training documents from ``cursor.document`` on, moving the cursor past each one."""
        for index, doc in iter_documents(shard, self.text_field, start=cursor.document):
            cursor.document = index + 1
            if doc and not is_held_out(doc, self.eval_fraction):
                yield self.tokenizer.encode(doc)

    def train_batches(self, seq_len: int, batch_size: int, stream_seed: int) -> Iterator[torch.Tensor]:
        """Endless (batch_size, seq_len + 1) int64 batches of one peer's training windows, shuffled through a buffer
        of ``shuffle_windows`` windows (seeded by ``stream_seed``)."""
        rng = np.random.default_rng(stream_seed)
        buffer: list[np.ndarray] = []
        batch: list[np.ndarray] = []
        for w in self.train_windows(seq_len, stream_seed):
            if len(buffer) < self.shuffle_windows:
                buffer.append(w.copy())
                continue
            i = int(rng.integers(len(buffer)))
            batch.append(buffer[i])
            buffer[i] = w.copy()
            if len(batch) == batch_size:
                yield torch.from_numpy(np.stack(batch).astype(np.int64))
                batch = []

    # ---- the cursor file --------------------------------------------------------------------------------------
    def _load_cursor(self, stream_seed: int) -> StreamCursor:
        if self.cursor_path is None or not self.cursor_path.exists():
            return StreamCursor()
        try:
            saved = json.loads(self.cursor_path.read_text())
            if saved.get("digest") != self.digest or saved.get("stream_seed") != stream_seed:
                logger.info("data cursor %s is for another corpus or stream: starting over", self.cursor_path)
                return StreamCursor()
            cursor = StreamCursor(int(saved["pass_index"]), int(saved["position"]), int(saved["document"]))
            if not (0 <= cursor.position < len(self.shards) and cursor.pass_index >= 0 and cursor.document >= 0):
                raise ValueError(f"out of range: {cursor}")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring the unreadable data cursor %s (%s): starting over", self.cursor_path, exc)
            return StreamCursor()
        logger.info("resuming the training stream at pass %d, shard %d of %d, document %d", cursor.pass_index,
                    cursor.position, len(self.shards), cursor.document)  # fmt: skip
        return cursor

    def _save_cursor(self, stream_seed: int, cursor: StreamCursor) -> None:
        if self.cursor_path is None:
            return
        state = {"digest": self.digest, "stream_seed": stream_seed, "pass_index": cursor.pass_index,
                 "position": cursor.position % len(self.shards), "document": cursor.document}  # fmt: skip
        if cursor.position >= len(self.shards):  # the pass ended: the next one starts at its beginning
            state.update(pass_index=cursor.pass_index + 1, position=0, document=0)
        tmp = self.cursor_path.with_name(self.cursor_path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self.cursor_path)
        except OSError as exc:
            logger.warning("cannot save the data cursor to %s: %s", self.cursor_path, exc)
