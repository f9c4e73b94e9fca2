"""A one-line progress bar on stderr: source bytes read, MB/s and the time left, documents and tokens."""

from __future__ import annotations

import sys
import time
from typing import TextIO

_EVERY = 0.25  # seconds between redraws on a terminal
_EVERY_LOG = 10.0  # seconds between lines when stderr is a file


class Progress:
    def __init__(self, total_bytes: int | None, enabled: bool = True, stream: TextIO | None = None):
        self.total = total_bytes
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = self.stream.isatty()
        self.read_bytes = 0
        self.documents = 0
        self.tokens = 0
        self.started = self.drawn = time.perf_counter()

    def read(self, count: int) -> None:
        """``count`` more bytes of the source were read."""
        self.read_bytes += count

    def update(self, documents: int, tokens: int) -> None:
        self.documents, self.tokens = documents, tokens
        now = time.perf_counter()
        if self.enabled and now - self.drawn >= (_EVERY if self.terminal else _EVERY_LOG):
            self.drawn = now
            self._draw(end="\r" if self.terminal else "\n")

    def done(self) -> None:
        if self.enabled:
            self._draw(end="\n")

    def line(self) -> str:
        seconds = max(time.perf_counter() - self.started, 1e-9)
        rate = self.read_bytes / seconds
        mb = self.read_bytes / 1e6
        where = f"{mb:,.1f} MB"
        eta = ""
        if self.total:
            where = f"{mb:,.1f}/{self.total / 1e6:,.1f} MB ({100 * self.read_bytes / self.total:.0f}%)"
            left = max(self.total - self.read_bytes, 0) / rate if rate else 0.0
            eta = f", ETA {int(left) // 60}:{int(left) % 60:02d}"
        return (
            f"prepare: {where}, {rate / 1e6:.1f} MB/s{eta}, {self.documents:,} documents, "
            f"{self.tokens / 1e6:,.1f}M tokens, {seconds:.0f} s"
        )

    def _draw(self, end: str) -> None:
        self.stream.write(self.line().ljust(100 if self.terminal else 0) + end)
        self.stream.flush()
