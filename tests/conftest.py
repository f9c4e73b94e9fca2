"""Shared fixtures: `distributed` runs a function on N live worker processes.

    def _body(x):                       # module level, so workers can import it
        ...                             # torch.distributed is initialised here
        return value

    def test_something(distributed):
        results = distributed.run(4, _body, x)   # one result per rank

Workers of each world size are started once per session and reused.
"""

import pytest

from polyshard.mesh.testing import PoolCache


@pytest.fixture(scope="session")
def distributed():
    pools = PoolCache()
    yield pools
    pools.close()
