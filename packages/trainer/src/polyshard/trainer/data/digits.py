"""scikit-learn's bundled 8x8 handwritten digits (1,797 images), held in memory."""

from __future__ import annotations

import numpy as np

from polyshard.data.examples import Arrays
from polyshard.trainer.data.language import RunData


def digits_splits(val_fraction: float, seed: int = 0) -> RunData:
    """``image`` (1, 8, 8) float32 in [0, 1] and ``label``; the test split is seeded."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8); pixels are 0..16
    order = np.random.default_rng(seed).permutation(len(images))
    num_test = int(round(len(images) * val_fraction))
    images, labels = images[order], digits.target[order].astype(np.int64)
    train = Arrays({"image": images[num_test:], "label": labels[num_test:]})
    return RunData([train], [1.0], ["digits"], Arrays({"image": images[:num_test], "label": labels[:num_test]}))
