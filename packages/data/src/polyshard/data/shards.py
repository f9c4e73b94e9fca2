"""Writing shards: documents in, ``<split>-NNNNN.tokens`` / ``.docs`` / ``.mask`` files out.

:class:`ShardWriter` numbers the documents as they arrive (in source order), sends document ``n`` to
``val`` when :func:`~polyshard.data.format.held_out` says so and to ``train`` otherwise, and appends
each to its split's open shard. A shard holds whole documents: a new one starts when the next
document would take it past ``shard_tokens`` (a document longer than that gets a shard of its own).
Arrays go to disk with ``ndarray.tofile``; nothing is held beyond the chunk being written.

:meth:`ShardWriter.state` is what a restart needs (the closed shards, and the open one's counts);
a writer built from it truncates the open shard's files to those counts and appends from there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any

import numpy as np

from polyshard.data.encode import Encoded
from polyshard.data.format import DOCS, DOCS_DTYPE, MASK, SPLITS, TOKENS, ShardInfo, SplitInfo, held_out


class Resume(Exception):
    """The temporary folder does not hold what its progress file says: start over."""


class SplitWriter:
    def __init__(self, folder: Path, split: str, dtype: np.dtype[Any], masked: bool, shard_tokens: int,
                 state: dict[str, Any] | None = None):  # fmt: skip
        self.folder, self.split, self.dtype, self.masked, self.shard_tokens = folder, split, dtype, masked, shard_tokens
        self.closed: list[ShardInfo] = []
        self.current: ShardInfo | None = None
        self.files: list[IO[bytes]] = []
        if state is not None:
            self.closed = [ShardInfo(*s) for s in state["closed"]]
            if state["open"] is not None:
                self._open(ShardInfo(*state["open"]))

    def suffixes(self) -> tuple[str, ...]:
        return (TOKENS, DOCS, MASK) if self.masked else (TOKENS, DOCS)

    def _sizes(self, shard: ShardInfo) -> tuple[int, ...]:
        return (shard.tokens * self.dtype.itemsize, shard.documents * DOCS_DTYPE.itemsize, shard.tokens)

    def _open(self, shard: ShardInfo) -> None:
        """Open ``shard``'s files for appending, cut to the counts it records (a restart's leftovers go)."""
        self.current = shard
        for suffix, size in zip(self.suffixes(), self._sizes(shard)):
            path = self.folder / (shard.name + suffix)
            if size and (not path.is_file() or path.stat().st_size < size):
                raise Resume(f"{path} is shorter than the progress file says")
            if path.is_symlink():  # a link put there since: appending would write wherever it points
                raise Resume(f"{path} is a link")
            # O_NOFOLLOW: a link made between the check and the open is refused, never written through
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if size else os.O_TRUNC)
            file = os.fdopen(os.open(path, flags, 0o644), "ab" if size else "wb")
            file.truncate(size)
            self.files.append(file)

    def _close(self) -> None:
        for file in self.files:
            file.close()
        self.files = []
        if self.current is not None:
            self.closed.append(self.current)
        self.current = None

    def add(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None) -> None:
        """Append whole documents (``lengths`` tokens each, end to end in ``tokens``)."""
        starts = np.concatenate([[0], np.cumsum(lengths)])
        first = 0
        while first < len(lengths):
            if self.current is None:
                self._open(ShardInfo(f"{self.split}-{len(self.closed):05d}", 0, 0))
            assert self.current is not None
            ends = self.current.tokens + starts[first + 1 :] - starts[first]
            fit = int(np.searchsorted(ends, self.shard_tokens, side="right"))
            if fit == 0 and self.current.tokens:
                self._close()  # the next document would pass shard_tokens: it starts a new shard
                continue
            fit = max(fit, 1)  # a document longer than a shard has one of its own
            self._write(tokens, mask, starts, first, first + fit)
            first += fit
            if first < len(lengths):
                self._close()

    def _write(self, tokens: np.ndarray, mask: np.ndarray | None, starts: np.ndarray, first: int, last: int) -> None:
        assert self.current is not None
        begin, end = int(starts[first]), int(starts[last])
        offsets = (self.current.tokens + starts[first:last] - begin).astype(DOCS_DTYPE)
        tokens[begin:end].astype(self.dtype, copy=False).tofile(self.files[0])
        offsets.tofile(self.files[1])
        if self.masked:
            assert mask is not None
            mask[begin:end].tofile(self.files[2])
        shard = self.current
        top = int(tokens[begin:end].max(initial=0))  # recorded, so a run checks its vocab_size before launch
        top = top if shard.max_token is None or not shard.tokens else max(top, shard.max_token)
        self.current = ShardInfo(shard.name, shard.tokens + end - begin, shard.documents + last - first, top)

    def flush(self) -> None:
        for file in self.files:
            file.flush()

    def state(self) -> dict[str, Any]:
        shard = self.current
        return {
            "closed": [[s.name, s.tokens, s.documents, s.max_token] for s in self.closed],
            "open": None if shard is None else [shard.name, shard.tokens, shard.documents, shard.max_token],
        }

    def finish(self) -> SplitInfo:
        self._close()
        return SplitInfo(tuple(self.closed))


class ShardWriter:
    """Both splits' writers, and the rule that sends each document to one of them."""

    def __init__(self, folder: Path, dtype: np.dtype[Any], masked: bool, shard_tokens: int, seed: int,
                 val_fraction: float, state: dict[str, Any] | None = None):  # fmt: skip
        self.seed, self.val_fraction = seed, val_fraction
        self.splits = {
            split: SplitWriter(folder, split, dtype, masked, shard_tokens, None if state is None else state[split])
            for split in SPLITS
        }

    @property
    def documents(self) -> int:
        """Documents written so far: the number the next one gets."""
        return sum(s.documents for w in self.splits.values() for s in (*w.closed, *filter(None, [w.current])))

    @property
    def tokens(self) -> int:
        return sum(s.tokens for w in self.splits.values() for s in (*w.closed, *filter(None, [w.current])))

    def add(self, encoded: Encoded) -> None:
        lengths = encoded.lengths
        numbers = np.arange(self.documents, self.documents + len(lengths), dtype=np.int64)
        held = held_out(self.seed, numbers, self.val_fraction)
        if not held.any():
            self.splits["train"].add(encoded.tokens, lengths, encoded.mask)
            return
        per_token = np.repeat(held, lengths)
        for split, docs, toks in (("train", ~held, ~per_token), ("val", held, per_token)):
            mask = None if encoded.mask is None else encoded.mask[toks]
            self.splits[split].add(encoded.tokens[toks], lengths[docs], mask)

    def flush(self) -> None:
        for writer in self.splits.values():
            writer.flush()

    def state(self) -> dict[str, Any]:
        return {split: writer.state() for split, writer in self.splits.items()}

    def finish(self) -> dict[str, SplitInfo]:
        """Close every shard; the splits that hold documents (``val`` only when some were held out)."""
        done = {split: writer.finish() for split, writer in self.splits.items()}
        return {split: info for split, info in done.items() if info.shards}
