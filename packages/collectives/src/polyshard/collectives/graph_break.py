"""``eager``: run a function as written under ``torch.compile``, a graph break around it.

torch's ``torch.compiler.disable`` is untyped; this keeps the decorated function's signature for mypy.
polyshard marks its collectives (and the layers that exchange tokens or keys) with it, so a compiled
transformer block is compiled pieces between eager collectives: polyshard-tp's README says why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

F = TypeVar("F", bound=Callable[..., Any])


def eager(fn: F) -> F:
    """``fn`` unchanged when nothing is compiled; under torch.compile, a graph break that runs it eagerly."""
    return cast(F, torch.compiler.disable(fn))  # type: ignore[no-untyped-call]  # torch leaves it untyped
