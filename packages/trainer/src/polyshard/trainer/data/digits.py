"""scikit-learn's bundled 8x8 handwritten digits (1,797 images) as ``datasets`` splits."""

from __future__ import annotations

import datasets
import numpy as np


def digits_splits(val_fraction: float, seed: int = 0) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, test) with ``image`` (1, 8, 8) float32 in [0, 1] and ``label``; the split is seeded."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8); pixels are 0..16
    order = np.random.default_rng(seed).permutation(len(images))
    num_test = int(round(len(images) * val_fraction))
    table = datasets.Dataset.from_dict({"image": images[order], "label": digits.target[order].astype(np.int64)})
    return table.select(range(num_test, len(images))), table.select(range(num_test))
