"""Typed errors raised on worker ranks, checked in the parent.

A worker cannot hand back an exception to match with ``pytest.raises``, so it
records what happened instead and the test function makes the assertion::

    def _body():
        return caught(Mesh, {"dp": 4})           # in the worker

    def test_something(distributed):
        for result in distributed.run(2, _body):  # in the parent
            assert_caught(result, MeshError, "has 8 ranks")
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any


def caught(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, str] | None:
    """Call ``fn``; return ``(type name, message)`` of the exception it raised, or None if it returned."""
    try:
        fn(*args, **kwargs)
    except Exception as err:
        return type(err).__name__, str(err)
    return None


def assert_caught(result: tuple[str, str] | None, error: type[BaseException], match: str) -> None:
    """Like ``pytest.raises(error, match=match)`` on a result of :func:`caught`."""
    assert result is not None, f"expected {error.__name__} matching {match!r}; nothing was raised"
    name, message = result
    assert name == error.__name__, f"expected {error.__name__}, got {name}: {message}"
    assert re.search(match, message), f"{name} message {message!r} does not match {match!r}"
