"""Synthetic token rows (Megatron-LM's mock data): for benchmarks and planning configs, no file read.

Row ``k`` of a set is drawn from its own generator, seeded by ``(seed, stream, first + k)``, so a row
is the same whichever rank, loader or batch reads it, and the sample order (:mod:`polyshard.data.order`)
treats the set exactly as it treats prepared windows. Tokens are uniform over ``[0, vocab_size)``:
nothing to learn beyond the unigram floor, ln(vocab_size) nats, which is what throughput, memory and
layout planning need (the shapes and the arithmetic of real rows, none of the reading).
"""

from __future__ import annotations

import numpy as np

from polyshard.data.examples import Rows

TRAIN_STREAM, VAL_STREAM = 0, 1  # training and validation rows never share a generator


class SyntheticTokens:
    """``count`` rows of ``width`` uniform tokens in ``[0, vocab_size)``, each seeded by its index.

    ``segments``: also give each row's document ids (one document per row: all zeros), as text rows do
    when ``data.document_mask`` asks for them.
    """

    def __init__(
        self, vocab_size: int, width: int, count: int, *, seed: int = 0, stream: int = TRAIN_STREAM,
        segments: bool = False,
    ):  # fmt: skip
        if vocab_size < 1 or width < 1 or count < 0:
            raise ValueError(f"synthetic rows need vocab_size >= 1, width >= 1, count >= 0; got {vocab_size}, "
                             f"{width}, {count}")  # fmt: skip
        self.vocab_size, self.width, self.count = vocab_size, width, count
        self.seed, self.stream, self.segments = seed, stream, segments

    def __len__(self) -> int:
        return self.count

    def row(self, index: int) -> np.ndarray:
        """Row ``index``'s tokens (int64, ``width`` of them): the same numbers on every call and process."""
        if not 0 <= index < self.count:
            raise IndexError(f"synthetic row {index} of {self.count}")
        generator = np.random.default_rng([self.seed, self.stream, index])
        return generator.integers(0, self.vocab_size, size=self.width, dtype=np.int64)

    def rows(self, indices: np.ndarray) -> Rows:
        tokens = np.stack([self.row(int(k)) for k in indices]).reshape(len(indices), self.width)
        out: Rows = {"tokens": tokens}
        if self.segments:
            out["segments"] = np.zeros_like(tokens)
        return out
