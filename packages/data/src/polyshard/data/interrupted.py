"""What an interrupted ``prepare`` keeps: the documents its progress record says are written, in the
temporary folder beside the output, where the same command started again resumes (:mod:`.prepare`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyshard.data.output import PROGRESS, temp_of


@dataclass(frozen=True)
class Kept:
    folder: Path
    """The temporary folder that holds them."""
    documents: int
    tokens: int

    def __str__(self) -> str:
        return f"{self.documents:,} documents ({self.tokens:,} tokens)"


def kept(out: str | Path) -> Kept | None:
    """What an interrupted prepare of ``out`` left to resume from; None when nothing was recorded."""
    folder = temp_of(Path(out).expanduser())
    try:
        state = json.loads((folder / PROGRESS).read_text())
        # each split's record is ShardWriter.state(): closed shards and the open one, [name, tokens, documents, top]
        shards = [s for name in ("train", "val") if name in state for s in _shards(state[name])]
        return Kept(folder, sum(int(s[2]) for s in shards), sum(int(s[1]) for s in shards))
    except (OSError, ValueError, KeyError, TypeError, IndexError):  # no record, or not one we can read
        return None


def _shards(split: dict[str, Any]) -> list[list[Any]]:
    return [*split["closed"], *([split["open"]] if split["open"] else [])]
