"""The messages the troubleshooting page quotes, and whether a message a test produced matches one.

The page's headings are ``### `quoted text` ``; ``…`` stands for the values of a run. A message
matches a heading when the heading's pieces between the ``…`` occur in it in order.
Used by tests/docs/test_troubleshooting.py and by the system test that stops a rank.
"""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "troubleshooting.md"


def quotes() -> list[str]:
    """Every heading's quoted text, in page order."""
    return re.findall(r"^### `(.+)`$", PAGE.read_text(), re.M)


def matches(quote: str, message: str) -> bool:
    """Whether ``message`` holds the pieces of ``quote`` (split on ``…``) in order."""
    at = 0
    for piece in (p.strip() for p in quote.split("…")):
        if not piece:
            continue
        found = message.find(piece, at)
        if found < 0:
            return False
        at = found + len(piece)
    return True


def quote_starting(prefix: str) -> str:
    """The one heading whose quoted text starts with ``prefix``."""
    found = [q for q in quotes() if q.startswith(prefix)]
    assert len(found) == 1, f"{PAGE.name}: {len(found)} headings start with {prefix!r}"
    return found[0]


def assert_page_quotes(prefix: str, message: str) -> None:
    """The heading starting with ``prefix`` quotes ``message`` (what a run printed)."""
    quote = quote_starting(prefix)
    assert matches(quote, message), f"{PAGE.name} quotes {quote!r}; the run printed {message!r}"
