"""argparse types every benchmark's flags use: a count or a size is a whole number of at least one (a
zero or negative ``--iters`` or ``--hidden`` used to fail inside the workers, after they started).
``polyshard bench`` parses the flags with the module's own parser before any process starts."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value}: give at least {low}")
        return value

    parse.__name__ = f"integer >= {low}"  # argparse names the type so in its message
    return parse


positive = at_least(1)
"""An integer >= 1: counts (iterations, layers, heads) and sizes (hidden, sequence lengths)."""
