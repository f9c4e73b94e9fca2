"""Shared fixtures: `distributed` runs a function on N live worker processes.

    def _body(x):                       # module level, so workers can import it
        ...                             # torch.distributed is initialised here
        return value

    def test_something(distributed):
        results = distributed.run(4, _body, x)   # one result per rank

Workers of each world size are started once per session and reused.
"""

import random

import pytest

from polyshard.mesh.testing import PoolCache


@pytest.fixture(scope="session")
def distributed():
    pools = PoolCache()
    yield pools
    pools.close()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small local text file of Shakespeare-ish words: no download, the same text every run."""
    rng = random.Random(0)
    words = "the king queen lord love death night day sweet fair heaven earth sword crown blood".split()
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(300)))
    return str(path)
