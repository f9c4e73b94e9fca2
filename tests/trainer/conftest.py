"""The trainer tests' shared fixtures (tests/conftest.py's ``distributed`` and ``corpus`` apply here too)."""

import pytest

from tests.trainer._layouts import Parity


@pytest.fixture(scope="session")
def parity(distributed, tmp_path_factory):
    """Trains a config on a named layout and on one process and compares them (tests/trainer/_layouts.py);
    each reference is trained once per session."""
    return Parity(distributed, tmp_path_factory.mktemp("parity"))
