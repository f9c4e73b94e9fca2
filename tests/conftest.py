"""Shared fixtures: `distributed` runs a function on N live worker processes; `parity` trains a config on a
named layout and on one process and compares them (tests/_layouts.py).

    def _body(x):                       # module level, so workers can import it
        ...                             # torch.distributed is initialised here
        return value

    def test_something(distributed):
        results = distributed.run(4, _body, x)   # one result per rank

Workers of each world size are started once per session and reused.
"""

import os
import random
import tempfile

import pytest

from polyshard.mesh.testing import PoolCache
from tests._layouts import Parity

# One inductor cache for every compile test (training.compile), in this process and the worker processes it
# spawns (they inherit the environment): a block graph compiled once is a cache hit for every later test, and
# for the next session too. Kept apart from a user's own cache; set TORCHINDUCTOR_CACHE_DIR to choose another.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"polyshard-tests-inductor-{os.getuid()}")
)


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


@pytest.fixture(scope="session")
def parity(distributed, tmp_path_factory):
    """Trains a config on a named layout and on one process and compares them (tests/_layouts.py); each
    reference is trained once per session."""
    return Parity(distributed, tmp_path_factory.mktemp("parity"))
