"""Reading a prepared dataset: any range of a split's token stream, its loss mask, and where its
documents start, without reading anything else.

:func:`open_prepared` checks the manifest and every file's size (:func:`~polyshard.data.format.read_manifest`)
and, given the run's tokenizer, that the folder was prepared with the same one. Opening reads
nothing: a shard's files are opened when a read first touches them, and at most :data:`OPEN_SHARDS`
stay open, so a corpus of ten thousand shards needs no more file handles than one of ten.

Each read is a positioned read (``os.pread``) of exactly the bytes asked for, into a fresh array. A
memory map would do the same through page faults, but a mapped page counts in the process's resident
memory for as long as the map lives, and the kernel maps the page cache in large folios (up to 2 MB
here: 1.5-2 MB of RSS per random 258-byte window read measured on Linux 6.18), so a rank's memory
would grow with every window it ever read. With positioned reads what a process holds is the rows of
its batch; the file's pages stay in the kernel's page cache, shared by every rank and reclaimable.
A document lookup is a binary search of positioned reads into the offsets file.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from polyshard.data.errors import DataError
from polyshard.data.format import (
    DOCS,
    DOCS_DTYPE,
    MASK,
    MASK_DTYPE,
    MASKED,
    TOKENS,
    Manifest,
    ShardInfo,
    read_manifest,
    tokenizer_info,
)
from polyshard.data.tokenizer import Tokenizer

OPEN_SHARDS = 32


class Column:
    """One file of a shard as an array of ``count`` elements, read by positioned reads."""

    def __init__(self, path: Path, dtype: np.dtype[Any], count: int):
        if path.stat().st_size != count * dtype.itemsize:  # it may have changed since the manifest was read
            raise DataError(f"{path} changed size while the run reads it; prepare the dataset again")
        self.path, self.dtype, self.count = path, dtype, count
        self.fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return self.count

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Elements ``[lo, hi)``."""
        size = self.dtype.itemsize
        data = os.pread(self.fd, (hi - lo) * size, lo * size)
        if len(data) != (hi - lo) * size:
            raise DataError(f"{self.path} ended early while the run read it; prepare the dataset again")
        return np.frombuffer(data, dtype=self.dtype)

    def __getitem__(self, index: int) -> int:
        return int(self.read(index, index + 1)[0])

    def searchsorted(self, value: int, right: bool) -> int:
        """Where ``value`` goes in this sorted column (numpy's ``side='right'`` or ``'left'``)."""
        lo, hi = 0, self.count
        while lo < hi:
            mid = (lo + hi) // 2
            if self[mid] < value or right and self[mid] == value:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def close(self) -> None:
        fd, self.fd = self.fd, -1  # never closed twice: the number may belong to another file by then
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            self.close()


class Split:
    """One split (``train`` or ``val``): its shards' token streams end to end."""

    def __init__(self, folder: Path, manifest: Manifest, shards: tuple[ShardInfo, ...]):
        self.folder, self.dtype, self.has_mask = folder, manifest.np_dtype, manifest.kind in MASKED
        self.shards = shards
        self.token_starts = np.concatenate([[0], np.cumsum([s.tokens for s in shards], dtype=np.int64)])
        self.doc_starts = np.concatenate([[0], np.cumsum([s.documents for s in shards], dtype=np.int64)])
        self.tokens, self.documents = int(self.token_starts[-1]), int(self.doc_starts[-1])
        self._maps: OrderedDict[tuple[int, str], Column] = OrderedDict()

    def _map(self, shard: int, suffix: str) -> Column:
        key = (shard, suffix)
        if key in self._maps:
            self._maps.move_to_end(key)
            return self._maps[key]
        info = self.shards[shard]
        dtype, count = {
            TOKENS: (self.dtype, info.tokens),
            DOCS: (DOCS_DTYPE, info.documents),
            MASK: (MASK_DTYPE, info.tokens),
        }[suffix]
        column = Column(self.folder / (info.name + suffix), dtype, count)
        if suffix == DOCS and count and (column[0] != 0 or column[count - 1] >= info.tokens):
            raise DataError(
                f"{column.path}: document offsets outside the shard's {info.tokens} tokens; prepare it again"
            )
        self._maps[key] = column
        while len(self._maps) > OPEN_SHARDS:
            self._maps.popitem(last=False)[1].close()
        return column

    def _pieces(self, start: int, stop: int, suffix: str) -> list[np.ndarray]:
        if not 0 <= start <= stop <= self.tokens:
            raise IndexError(f"tokens [{start}, {stop}) outside the split's {self.tokens}")
        pieces = []
        shard = int(np.searchsorted(self.token_starts, start, side="right")) - 1
        while start < stop:
            base = int(self.token_starts[shard])
            end = min(stop, int(self.token_starts[shard + 1]))
            if end > start:
                pieces.append(self._map(shard, suffix).read(start - base, end - base))
            start, shard = end, shard + 1
        return pieces

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the split's stream as int64 (a copy; the map is never written)."""
        pieces = self._pieces(start, stop, TOKENS)
        return np.concatenate(pieces).astype(np.int64) if pieces else np.empty(0, np.int64)

    def read_mask(self, start: int, stop: int) -> np.ndarray:
        """Whether the loss counts each token of ``[start, stop)`` (fine-tuning pairs: their responses)."""
        if not self.has_mask:
            return np.ones(stop - start, dtype=bool)
        pieces = self._pieces(start, stop, MASK)
        return np.concatenate(pieces).astype(bool) if pieces else np.empty(0, bool)

    def read_mask_bytes(self, start: int, stop: int) -> np.ndarray:
        """The mask bytes of ``[start, stop)`` as stored (uint8): a preference pair's part of each token."""
        if not self.has_mask:
            raise ValueError(f"{self.folder} has no mask: its documents are plain text")
        pieces = self._pieces(start, stop, MASK)
        return np.concatenate(pieces) if pieces else np.empty(0, MASK_DTYPE)

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        """Stream positions in ``(start, stop)`` where a document begins (sorted, int64)."""
        found = []
        first = int(np.searchsorted(self.token_starts, start, side="right")) - 1
        last = int(np.searchsorted(self.token_starts, stop, side="left"))
        for shard in range(max(first, 0), min(last, len(self.shards))):
            base = int(self.token_starts[shard])
            docs = self._map(shard, DOCS)
            lo, hi = docs.searchsorted(start - base, right=True), docs.searchsorted(stop - base, right=False)
            found.append(docs.read(lo, hi).astype(np.int64) + base)
        return np.concatenate(found) if found else np.empty(0, np.int64)

    def document(self, index: int) -> tuple[int, int]:
        """The stream range ``[start, stop)`` of document ``index``."""
        if not 0 <= index < self.documents:
            raise IndexError(f"document {index} outside the split's {self.documents}")
        shard = int(np.searchsorted(self.doc_starts, index, side="right")) - 1
        local = index - int(self.doc_starts[shard])
        docs, base = self._map(shard, DOCS), int(self.token_starts[shard])
        end = docs[local + 1] if local + 1 < len(docs) else self.shards[shard].tokens
        return base + docs[local], base + end


@dataclass(frozen=True)
class Prepared:
    folder: Path
    manifest: Manifest
    train: Split
    val: Split | None

    @property
    def vocab_size(self) -> int:
        return self.manifest.tokenizer.vocab_size


def open_prepared(folder: str | Path, tokenizer: Tokenizer | None = None) -> Prepared:
    """The prepared dataset in ``folder``, checked; with ``tokenizer``, refused unless it was prepared
    with that same tokenizer (name, vocabulary and file hash)."""
    path = Path(folder).expanduser()
    manifest = read_manifest(path)
    if tokenizer is not None:
        _check_tokenizer(path, manifest, tokenizer)
    for info in manifest.splits.values():
        for shard in info.shards:
            check_offsets(path / (shard.name + DOCS), shard)
    splits: dict[str, Any] = {k: Split(path, manifest, v.shards) for k, v in manifest.splits.items()}
    val = splits.get("val")
    return Prepared(path, manifest, splits["train"], val if val is not None and val.tokens else None)


_OFFSETS_BLOCK = 1 << 22  # offsets read at a time: 32 MB


def check_offsets(path: Path, shard: ShardInfo) -> None:
    """Every document offset of ``shard`` is inside it and none runs backwards (the first is 0): a damaged
    or edited ``.docs`` file would otherwise cut rows at wrong places and train on them silently."""
    previous = 0
    for lo in range(0, shard.documents, _OFFSETS_BLOCK):
        count = min(_OFFSETS_BLOCK, shard.documents - lo)
        block = np.fromfile(path, DOCS_DTYPE, count, offset=lo * DOCS_DTYPE.itemsize)
        steps = np.diff(block, prepend=previous)
        bad = np.flatnonzero((steps < 0) | (block >= shard.tokens) | (block < 0))
        if lo == 0 and block[0] != 0 or len(bad):
            at = lo + (int(bad[0]) if len(bad) else 0)
            raise DataError(
                f"{path}: document offset {at} is {int(block[at - lo])}, not in order inside the shard's "
                f"{shard.tokens} tokens (offsets start at 0 and never run backwards); the folder is damaged: "
                "prepare it again"
            )
        previous = int(block[-1])


def _check_tokenizer(folder: Path, manifest: Manifest, tokenizer: Tokenizer) -> None:
    ours, theirs = tokenizer_info(tokenizer), manifest.tokenizer
    if (ours.sha256, ours.vocab_size) != (theirs.sha256, theirs.vocab_size):
        raise DataError(
            f"{folder} was prepared with the tokenizer {theirs.name!r} ({theirs.vocab_size} tokens, sha256 "
            f"{theirs.sha256[:12]}), not the run's {ours.name!r} ({ours.vocab_size} tokens, "
            f"sha256 {ours.sha256[:12]}); "
            "set data.tokenizer to the one it was prepared with, or prepare it again with the run's"
        )
