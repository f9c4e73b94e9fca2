"""The seeded order of a training set: a permutation of ``[0, n)`` that holds no array of ``n``.

A run visits its examples (windows of the token stream, or documents) in a seeded random order that
changes every epoch. Holding that order as an array (``torch.randperm``, or Megatron-LM's cached
shuffle index) costs 8 bytes per example: 80 GB per rank for the 10^10 windows of a 10 TB corpus.
:class:`Permutation` instead computes the ``i``-th element on demand: a balanced Feistel network
over the smallest even number of bits that covers ``n``, keyed by (seed, epoch), with cycle walking
(an output at or past ``n`` is permuted again until it lands inside). A Feistel network is a
bijection for any round function, so every example comes exactly once per epoch; the domain is
less than 4n, so a value walks fewer than 4 times on average. Memory: a few integers, whatever n is.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
_M64 = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


def _key(seed: int, epoch: int, round_: int) -> np.uint64:
    value = _mix(np.array([(seed * 0x9E3779B97F4A7C15 + epoch * 0xD1B54A32D192ED03 + round_) & _M64], np.uint64))
    return np.uint64(value[0])


class Permutation:
    """``perm[i]`` for ``i`` in ``[0, n)``: a seeded bijection of ``[0, n)`` onto itself."""

    def __init__(self, n: int, seed: int, epoch: int = 0):
        if n < 1:
            raise ValueError(f"a permutation of {n} elements")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = [_key(seed, epoch, r) for r in range(ROUNDS)]

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half)
        left, right = x >> shift, x & self.mask
        with np.errstate(over="ignore"):
            for key in self.keys:
                left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << shift) | right

    def __getitem__(self, index: np.ndarray | int) -> np.ndarray:
        """The permuted positions of ``index`` (an int or an int array), as int64."""
        x = np.atleast_1d(np.asarray(index, dtype=np.int64))
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"positions outside [0, {self.n})")
        y = self._feistel(x.astype(np.uint64))
        outside = y >= np.uint64(self.n)
        while outside.any():  # cycle walking: a bijection of the domain restricted to [0, n)
            y[outside] = self._feistel(y[outside])
            outside = y >= np.uint64(self.n)
        return y.astype(np.int64)
