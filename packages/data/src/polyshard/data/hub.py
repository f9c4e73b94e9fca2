"""Sources read through Hugging Face ``datasets``: a ``save_to_disk`` folder, or a dataset name streamed.

A saved folder is memory-mapped arrow: it is sliced a batch of rows at a time, never loaded whole, and
its arrow files are hashed for the manifest. A name is streamed (``streaming=True``, split ``train``)
when online; the manifest records the name with no size or hash (the rows are not files here).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from polyshard.data.errors import DataError
from polyshard.data.format import SourceInfo
from polyshard.data.sources import (
    ARROW_ROWS,
    READ_BYTES,
    Cursor,
    Fields,
    Part,
    Source,
    check_arrow_schema,
    check_within,
)


def _datasets(what: str) -> ModuleType:
    try:
        import datasets
    except ImportError as err:
        raise DataError(f"{what} needs the datasets library: pip install datasets") from err
    module: ModuleType = datasets
    return module


class DiskDataset(Source):
    """A folder written by ``Dataset.save_to_disk`` (or a ``DatasetDict``'s, whose ``train`` split is read)."""

    def __init__(self, label: str, path: Path, fields: Fields):
        datasets = _datasets(str(path))
        for inner in path.rglob("*"):  # a link to arrow files elsewhere is refused before the library opens it
            check_within(path, inner, "saved dataset folder")
            if inner.name == "state.json":
                _check_state(path, inner)
        try:
            dataset = datasets.load_from_disk(str(path))
        except Exception as err:  # the library raises many kinds for a damaged folder
            raise DataError(f"{path}: datasets cannot load this saved folder ({type(err).__name__}: {err})") from err
        if isinstance(dataset, datasets.DatasetDict):
            if "train" not in dataset:
                raise DataError(f"{path} holds the splits {list(dataset)}, none named 'train'; give a split's folder")
            dataset = dataset["train"]
        check_arrow_schema(dataset.data.schema, fields, str(path))
        files = sorted(Path(f["filename"]) for f in dataset.cache_files)
        for file in files:  # state.json may name files by any path: only those inside the folder are read
            check_within(path, file, "saved dataset folder")
        super().__init__(label, files, fields)
        self.dataset = dataset.with_format("arrow")

    def _stream(self, start: Cursor, chunk_bytes: int, on_read: Callable[[int], None]) -> Iterator[tuple[Part, Cursor]]:
        rows = len(self.dataset)
        total = self.total_bytes or 0
        for begin in range(start[1], rows, ARROW_ROWS):
            table = self.dataset[begin : begin + ARROW_ROWS]
            on_read(total * table.num_rows // max(rows, 1))
            data = {c: table.column(c) for c in self.fields.columns}
            yield Part("arrow", self.label, begin, data), (0, begin + table.num_rows, 1)
        self._infos = [_hash_file(f, self.label) for f in self.files]


def _check_state(folder: Path, state: Path) -> None:
    """The arrow files a ``state.json`` names lie inside ``folder`` (it may name any relative path)."""
    try:
        raw = json.loads(state.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:
        raise DataError(f"{state}: not a datasets state file ({err}); save the dataset again") from err
    files = raw.get("_data_files") if isinstance(raw, dict) else None
    for entry in files if isinstance(files, list) else []:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if isinstance(name, str):
            check_within(folder, state.parent / name, "saved dataset folder")


def _hash_file(path: Path, label: str) -> SourceInfo:
    sha = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(READ_BYTES):
            sha.update(block)
    return SourceInfo(f"{label}/{path.name}", path.stat().st_size, sha.hexdigest())


class HubDataset(Source):
    """A dataset name, streamed from the hub (``datasets.load_dataset(name, split="train", streaming=True)``)."""

    def __init__(self, label: str, fields: Fields):
        super().__init__(label, [], fields)
        self.total_bytes = None
        datasets = _datasets(f"the dataset name {label!r}")
        try:
            self.dataset = datasets.load_dataset(label, split="train", streaming=True)
        except Exception as err:  # offline, unknown name, no train split: the library raises many kinds
            raise DataError(
                f"{label!r} is neither a local file or folder nor a dataset that could be streamed "
                f"({type(err).__name__}: {err}); give a .txt/.jsonl/.parquet file or folder, or a dataset name"
            ) from err
        names = self.dataset.column_names
        missing = [c for c in fields.columns if names is not None and c not in names]
        if missing:
            raise DataError(f"dataset {label!r} has no {missing} column (it has {names}); name the right field")

    def fingerprint(self) -> list[Any]:
        return [self.label]

    def _stream(self, start: Cursor, chunk_bytes: int, on_read: Callable[[int], None]) -> Iterator[tuple[Part, Cursor]]:
        import pyarrow as pa

        row = start[1]
        for batch in self.dataset.skip(row).iter(batch_size=ARROW_ROWS):
            data = {c: pa.array(batch[c], type=pa.large_string()) for c in self.fields.columns}
            count = len(data[self.fields.columns[0]])
            on_read(sum(int(a.nbytes) for a in data.values()))
            yield Part("arrow", self.label, row, data), (0, row + count, 1)
            row += count
        self._infos = [SourceInfo(self.label, 0, "")]
