"""Examples of a prepared split: what row ``k`` of a training or validation set holds.

* :class:`Windows`: fixed-length windows of the split's token stream, end to end (text, and packed
  fine-tuning pairs). Window ``k`` is tokens ``[(first + k) w, (first + k + 1) w)``; no index array
  is built, whatever the corpus's size.
* :class:`Documents`: one document per row, cut or padded (fine-tuning pairs, ``data.packing = false``).

Rows are numpy arrays of ``width`` tokens: ``tokens``; ``labels`` where the split has a loss mask
(``IGNORE_INDEX`` where the loss skips a token: prompts and padding); ``segments`` when asked, each
token's document within its row (0, 1, 2, ...: the attention of ``data.document_mask`` stays inside
one). Anything with ``len`` and ``rows(indices)`` is an :class:`Examples` to the loader.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from polyshard.data.prepared import Split

IGNORE_INDEX = -100  # the label of a position the loss skips (a prompt or padding); PyTorch's default

Rows = dict[str, np.ndarray]


class Examples(Protocol):
    def __len__(self) -> int: ...

    def rows(self, indices: np.ndarray) -> Rows:
        """The rows of the examples ``indices`` (int64), stacked in that order."""
        ...


class Windows:
    def __init__(self, split: Split, width: int, *, first: int = 0, count: int | None = None, segments: bool = False):
        total = split.tokens // width
        self.split, self.width, self.first, self.segments = split, width, first, segments
        self.count = total - first if count is None else count
        if not (0 <= first and 0 <= self.count and first + self.count <= total):
            raise ValueError(f"windows [{first}, {first}+{count}) of {total}")

    def __len__(self) -> int:
        return self.count

    def rows(self, indices: np.ndarray) -> Rows:
        w = self.width
        starts = [(self.first + int(k)) * w for k in indices]
        out: Rows = {"tokens": np.stack([self.split.read(s, s + w) for s in starts]).reshape(len(starts), w)}
        if self.split.has_mask:
            mask = np.stack([self.split.read_mask(s, s + w) for s in starts]).reshape(len(starts), w)
            out["labels"] = np.where(mask, out["tokens"], IGNORE_INDEX)
        if self.segments:
            positions = np.arange(w)
            out["segments"] = np.stack(
                [np.searchsorted(self.split.document_starts(s, s + w) - s, positions, side="right") for s in starts]
            ).reshape(len(starts), w)
        return out


class Documents:
    def __init__(
        self,
        split: Split,
        width: int,
        pad_id: int,
        *,
        first: int = 0,
        count: int | None = None,
        segments: bool = False,
    ):
        self.split, self.width, self.pad_id, self.first, self.segments = split, width, pad_id, first, segments
        self.count = split.documents - first if count is None else count

    def __len__(self) -> int:
        return self.count

    def rows(self, indices: np.ndarray) -> Rows:
        w = self.width
        tokens = np.full((len(indices), w), self.pad_id, dtype=np.int64)
        labels = np.full((len(indices), w), IGNORE_INDEX, dtype=np.int64)
        for row, k in enumerate(indices):
            start, stop = self.split.document(self.first + int(k))
            stop = min(stop, start + w)  # a response longer than the row is cut at its end, as trl's max_length
            ids, mask = self.split.read(start, stop), self.split.read_mask(start, stop)
            tokens[row, : len(ids)] = ids
            labels[row, : len(ids)] = np.where(mask, ids, IGNORE_INDEX)
        out = {"tokens": tokens, "labels": labels}
        if self.segments:  # one document per row: the padding after it is never attended to or scored
            out["segments"] = np.zeros_like(tokens)
        return out

    def longest_prompt(self) -> tuple[int, int]:
        """(the longest run of unscored tokens that opens a document, and which document): a prompt that
        leaves a row no room for its response is found before training. One short read per document."""
        worst, which = 0, -1
        for k in range(self.count):
            start, stop = self.split.document(self.first + k)
            scored = np.flatnonzero(self.split.read_mask(start, min(stop, start + self.width)))
            if not len(scored):  # no room in the row: how long the prompt is, for the message
                scored = np.flatnonzero(self.split.read_mask(start, stop))
            prompt = int(scored[0]) if len(scored) else stop - start
            if prompt > worst:
                worst, which = prompt, k
        return worst, which


class Arrays:
    """Examples held in memory as equal-length arrays (small built-in sets: the digits images; tests)."""

    def __init__(self, columns: dict[str, np.ndarray]):
        lengths = {len(v) for v in columns.values()}
        if len(lengths) != 1:
            raise ValueError(f"columns of different lengths {sorted(lengths)}")
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def rows(self, indices: np.ndarray) -> Rows:
        return {k: v[indices] for k, v in self.columns.items()}


class Concat:
    """Several example sets one after another (the validation sets of a mixture's sources)."""

    def __init__(self, parts: list[Examples]):
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def rows(self, indices: np.ndarray) -> Rows:
        owner = np.searchsorted(self.starts, indices, side="right") - 1
        pieces = [(np.flatnonzero(owner == p), p) for p in range(len(self.parts)) if (owner == p).any()]
        return merge(
            [(where, self.parts[p].rows(indices[where] - self.starts[p])) for where, p in pieces], len(indices)
        )


def merge(parts: list[tuple[np.ndarray | list[int], Rows]], size: int) -> Rows:
    """``size`` rows put together from ``parts``, each (the positions it fills, its rows). Where some parts
    have labels and others (text) do not, a text row's labels are its tokens: every token is a target."""
    if any("labels" in rows for _, rows in parts):
        for _, rows in parts:
            rows.setdefault("labels", rows["tokens"])
    out: Rows = {}
    for key, first in parts[0][1].items():
        out[key] = np.empty((size, *first.shape[1:]), dtype=first.dtype)
        for where, rows in parts:
            out[key][where] = rows[key]
    return out
