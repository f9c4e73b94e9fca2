"""How the command line refuses: one line on stderr, exit status 2, no traceback, and a bounded length.

A message may quote what the user gave (a list from --set, a key of a file): a value of ten million
characters would otherwise become a message as long. :func:`bounded` keeps the first
:data:`MAX_MESSAGE_CHARS` characters and says how many it cut; every refusal goes through :func:`fail`.
"""

from __future__ import annotations

from typing import NoReturn

import typer

MAX_MESSAGE_CHARS = 2000
"""The longest message printed whole: room for a field, its value, the allowed range and a fix."""


def bounded(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``message`` on one line (newlines become spaces), cut to ``limit`` characters with a note of how
    many were cut."""
    line = " ".join(message.splitlines())
    if len(line) <= limit:
        return line
    return f"{line[:limit]}... ({len(line) - limit:,} more characters cut)"


def fail(kind: str, err: object) -> NoReturn:
    """Print ``<kind> error: <message>`` as one bounded line on stderr and exit 2."""
    typer.echo(f"{kind} error: {bounded(str(err))}", err=True)
    raise typer.Exit(2)
