"""Finding a source: what a ``SOURCE`` argument names (a file, a folder of them, a ``save_to_disk``
folder or a dataset name), checked before any reading: it exists, holds usable files inside it, and
(for arrow sources) has the needed columns as strings."""

from __future__ import annotations

from pathlib import Path

from polyshard.data.errors import DataError
from polyshard.data.format import KINDS
from polyshard.data.hub import DiskDataset, HubDataset
from polyshard.data.sources import (
    JSONL,
    PARQUET,
    SPLIT_ON,
    SUFFIXES,
    TEXT,
    Fields,
    Source,
    check_arrow_schema,
    check_within,
    parquet_schema,
)
from polyshard.data.zstd_frames import check_zstd_frames


def open_source(spec: str | Path, fields: Fields) -> Source:
    """The source ``spec`` names, checked: it exists, holds usable files, and (for arrow sources) has the
    needed columns as strings. A :class:`DataError` naming the file and the fix otherwise."""
    _check_fields(fields)
    path = Path(spec).expanduser()
    label = str(spec)
    if path.is_dir() and _is_saved_dataset(path):
        _no_dataset_of_preferences(label, fields)
        return DiskDataset(label, path, fields)
    if path.is_dir():
        files = sorted(
            (p for p in path.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES) and not _hidden(p, path)),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        for p in files:
            check_within(path, p, "source folder")
        if not files:
            raise DataError(f"{path} holds no {', '.join(SUFFIXES)} files; give a folder of them, or one file")
    elif path.is_file():
        if not path.name.endswith(SUFFIXES):
            raise DataError(f"{path} is not a {', '.join(SUFFIXES)} file; give one of those (or a folder of them)")
        files = [path]
    elif _looks_like_a_path(str(spec), path):
        raise DataError(f"{path}: no such file or folder; give a text, JSON lines or parquet file or a folder")
    else:
        _no_dataset_of_preferences(label, fields)
        return HubDataset(label, fields)
    if fields.kind == "preferences" and not all(p.name.endswith(JSONL) for p in files):
        other = next(p for p in files if not p.name.endswith(JSONL))
        raise DataError(
            f'{other}: preference pairs are read from .jsonl files ({{"prompt", "chosen", "rejected"}} per line); '
            "convert it, or give only the .jsonl files"
        )
    if fields.kind == "pairs" and any(p.name.endswith(TEXT) for p in files):
        text = next(p for p in files if p.name.endswith(TEXT))
        raise DataError(f"{text}: fine-tuning pairs need .jsonl (or .parquet) files with prompt and response fields")
    for p in files:
        if p.name.endswith(PARQUET):
            check_arrow_schema(parquet_schema(p), fields, str(p))
        if p.name.endswith(".zst"):
            check_zstd_frames(p)
    return Source(label, files, fields)


def _check_fields(fields: Fields) -> None:
    if fields.kind not in KINDS:
        raise DataError(f"kind={fields.kind!r}; choose one of {list(KINDS)}")
    if fields.split_on not in SPLIT_ON:
        raise DataError(f"split_on={fields.split_on!r}; choose one of {SPLIT_ON}")
    if fields.max_document_bytes < 1:
        raise DataError(f"max_document_bytes={fields.max_document_bytes}; give at least 1")
    if fields.kind == "pairs" and fields.prompt_field == fields.response_field:
        raise DataError(f"the prompt and response fields are both {fields.prompt_field!r}; name two fields")


def _no_dataset_of_preferences(label: str, fields: Fields) -> None:
    """Preference rows may be text, ids or messages per line: read from .jsonl, not from arrow's typed columns."""
    if fields.kind == "preferences":
        raise DataError(
            f"{label}: preference pairs are read from a .jsonl file (or a folder of them), not a dataset; "
            'write its rows as {"prompt", "chosen", "rejected"} lines'
        )


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _is_saved_dataset(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _looks_like_a_path(spec: str, path: Path) -> bool:
    """A missing local path, rather than a dataset name such as ``roneneldan/TinyStories``."""
    if spec.startswith((".", "/", "~")) or path.name.endswith(SUFFIXES) or spec.count("/") > 1:
        return True
    return "/" in spec and Path(spec.split("/")[0]).exists()
