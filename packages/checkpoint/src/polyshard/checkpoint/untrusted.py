"""Files we read but did not write, in one place: a checkpoint's ``index.json``, a Hugging Face folder's
``config.json`` and ``model.safetensors.index.json``, and every file they name.

Two rules, whatever the file's role:

- :func:`check_inside`: no file of a folder we read may resolve outside that folder (a link to a file
  elsewhere is refused, so nothing outside the folder the user named is ever read);
- :func:`read_json`: JSON is read with its size bounded (memory) and its nesting bounded (a deeply
  nested file is one line naming it, never a ``RecursionError`` in whatever walks it later).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from polyshard.checkpoint.errors import CheckpointError

MAX_JSON_BYTES = 64 << 20
"""A config or a weight map: a few KB to a few MB even for the largest published models."""
MAX_DEPTH = 64
"""Our index nests about 10 deep (ranks, records, placements), a Hugging Face config 4; 64 is far past both."""


def check_inside(folder: Path, path: Path) -> None:
    """``path`` (a file of ``folder``) resolves inside ``folder``; a link out of it is refused. A snapshot
    of the Hugging Face cache (``models--org--name/snapshots/<commit>``) holds links into the model's
    ``blobs/``: for it, inside is the model's cache folder (:mod:`polyshard.checkpoint.hf_cache`)."""
    target, inside = path.resolve(), _model_cache_folder(Path(folder).resolve())
    if target == inside or not target.is_relative_to(inside):
        raise CheckpointError(
            f"{path} leads outside {folder} (to {target}); copy the file into the folder (no link out of a "
            "folder we read is followed)"
        )


def _model_cache_folder(folder: Path) -> Path:
    """``models--org--name`` for a folder ``models--org--name/snapshots/<commit>`` of a Hugging Face cache;
    ``folder`` itself otherwise."""
    repo = folder.parent.parent
    if folder.parent.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
        return repo
    return folder


def read_json(folder: Path, path: Path, *, limit: int = MAX_JSON_BYTES, fix: str = "") -> Any:
    """``path`` (a file of ``folder``) parsed as JSON, checked inside the folder, at most ``limit`` bytes
    and :data:`MAX_DEPTH` levels deep; a :class:`CheckpointError` naming it otherwise (``fix`` appended)."""
    check_inside(folder, path)
    size = path.stat().st_size
    if size > limit:
        raise CheckpointError(f"{path} is {size:,} bytes, more than the {limit:,} such a file may be{fix}")
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}{fix}") from err
    except RecursionError as err:  # the parser recursed past Python's limit
        raise CheckpointError(f"{path} is JSON nested too deeply (more than {MAX_DEPTH} levels){fix}") from err
    if _depth(value) > MAX_DEPTH:  # parsed, but deep enough to break whatever walks it recursively
        raise CheckpointError(f"{path} is JSON nested too deeply (more than {MAX_DEPTH} levels){fix}")
    return value


def _depth(value: Any) -> int:
    """How deep lists and objects nest in ``value``, walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH:  # no need to walk further once past the bound
                stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest
