"""Fixtures the trainer tests share."""

import random

import pytest


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small local text file of Shakespeare-ish words: no download, the same text every run."""
    rng = random.Random(0)
    words = "the king queen lord love death night day sweet fair heaven earth sword crown blood".split()
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(300)))
    return str(path)
