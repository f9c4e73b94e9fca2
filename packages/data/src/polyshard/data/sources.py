"""Where a corpus comes from: finding its files, checking them, and streaming them in chunks of documents.

A source is one of

- a ``.txt`` file or a folder of them: one document per file, or per blank-line-separated block
  (``split_on="blank"``);
- ``.jsonl`` / ``.jsonl.gz`` / ``.jsonl.zst`` files, one JSON object per line (a text field, or a
  prompt and a response for ``kind="pairs"``, DPO's prompt, chosen and rejected for ``kind="preferences"``);
- ``.parquet`` files, read in row batches with pyarrow;
- a folder written by ``datasets.Dataset.save_to_disk`` (memory-mapped arrow, sliced, never loaded);
- a dataset name that ``datasets.load_dataset(name, split="train", streaming=True)`` can stream.

A folder may mix the file kinds; its files are read in the order of their paths (sorted). The main
process only reads bytes (hashing each file as it streams by) and cuts them at document boundaries
into :class:`Chunk` s of about ``chunk_bytes``; parsing, checking and tokenizing happen in the workers
(:mod:`polyshard.data.encode`), so a malformed line is reported there, with its file and line number.

Each chunk carries the :data:`Cursor` just past it, so an interrupted run restarts by reading the
source again (it must be hashed whole anyway) and tokenizing only what lies past the last chunk written.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

from polyshard.data.errors import DataError
from polyshard.data.format import SourceInfo

TEXT = (".txt",)
JSONL = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET = (".parquet",)
SUFFIXES = TEXT + JSONL + PARQUET
SPLIT_ON = ("file", "blank")
READ_BYTES = 1 << 20  # bytes read from a file at a time
ARROW_ROWS = 2048  # rows of an arrow source per batch
_BLANK_LINE = re.compile(rb"\n[ \t\r\f\v]*\n")
DOCUMENT_LIMIT = 16 << 20
"""Bytes of one document (a text file read whole, a blank-line block, a JSON line, a row), at most: what
one document costs in memory is bounded whatever the source holds. A longer one is refused, named."""

Cursor = tuple[int, int, int]
"""(file index, offset, line): where reading resumes. The offset is in the file's (decompressed)
bytes for text and JSON lines, a row for arrow sources; line is the 1-based number of the next line."""
START: Cursor = (0, 0, 1)


@dataclass(frozen=True)
class Fields:
    """What a document is: plain text, or a prompt and a response (and which fields hold them)."""

    kind: str = "text"
    split_on: str = "file"
    text_field: str = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"
    max_document_bytes: int = DOCUMENT_LIMIT

    @property
    def columns(self) -> tuple[str, ...]:
        if self.kind == "preferences":  # their names are fixed (text or ids: preference_rows' rule)
            return ("prompt", "chosen", "rejected")
        return (self.text_field,) if self.kind == "text" else (self.prompt_field, self.response_field)


@dataclass(frozen=True)
class Part:
    """A piece of one file for a worker: ``form`` is "file" (a whole text file, one document),
    "blank" (text cut at a blank line), "jsonl" (whole lines) or "arrow" (a batch of rows)."""

    form: str
    where: str
    """The file (or dataset) it comes from, for messages."""
    first: int
    """Its first line (1-based) or row (0-based)."""
    data: bytes | dict[str, Any]
    """Raw bytes, or for "arrow" one pyarrow array per needed column."""

    @property
    def nbytes(self) -> int:
        if isinstance(self.data, bytes):
            return len(self.data)
        return sum(int(a.nbytes) for a in self.data.values())


@dataclass
class Chunk:
    parts: list[Part] = field(default_factory=list)
    end: Cursor = START

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


class Source:
    """A checked source: its label, files, total size, and :meth:`chunks`. After the chunks have been
    read to the end, :meth:`infos` gives every file's name, size and sha256."""

    def __init__(self, label: str, files: list[Path], fields: Fields):
        self.label = label
        self.files = files
        self.fields = fields
        self.total_bytes: int | None = sum(f.stat().st_size for f in files)
        self._infos: list[SourceInfo] = []

    def fingerprint(self) -> list[Any]:
        """What must be unchanged for an interrupted run to resume: each file's path, size and mtime."""
        return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in self.files]

    def infos(self) -> tuple[SourceInfo, ...]:
        return tuple(self._infos)

    def chunks(self, start: Cursor, chunk_bytes: int, on_read: Callable[[int], None]) -> Iterator[Chunk]:
        """Chunks of about ``chunk_bytes`` from ``start`` on; everything before ``start`` is read and
        hashed but not returned."""
        chunk = Chunk(end=start)
        for part, end in self._stream(start, chunk_bytes, on_read):
            chunk.parts.append(part)
            chunk.end = end
            if chunk.nbytes >= chunk_bytes:
                yield chunk
                chunk = Chunk(end=end)
        if chunk.parts:
            yield chunk

    def _stream(self, start: Cursor, chunk_bytes: int, on_read: Callable[[int], None]) -> Iterator[tuple[Part, Cursor]]:
        """Every part from ``start`` on, each with the cursor just past it."""
        for index, path in enumerate(self.files):
            hashed = _Hashing(path, on_read)
            yield from self._parts(index, path, hashed, start, chunk_bytes)
            self._infos.append(hashed.finish(str(path)))

    def _parts(
        self, index: int, path: Path, hashed: _Hashing, start: Cursor, chunk_bytes: int
    ) -> Iterator[tuple[Part, Cursor]]:
        name = str(path)
        skip = start[1:] if index == start[0] else (0, 1) if index > start[0] else None
        if path.name.endswith(PARQUET):
            rows = 0 if skip is None else skip[0]
            yield from _parquet_parts(index, path, self.fields.columns, rows, skip is None, hashed)
            return
        with _open_text(hashed, path) as stream:
            if skip is None:
                return  # finished before the restart point; read only to hash it
            limit = self.fields.max_document_bytes
            if path.name.endswith(TEXT) and self.fields.split_on == "file":
                data = _read_or_fail(stream, limit + 1, path)
                if len(data) > limit:
                    raise too_long(
                        f"{path} (one document: the whole file)", limit, "split the file, or use --split-on blank"
                    )
                if data:
                    yield Part("file", name, 1, data), (index + 1, 0, 1)
                return
            offset, line = skip
            _discard(stream, offset)
            form, cut = ("jsonl", _after_last_newline) if path.name.endswith(JSONL) else ("blank", _after_blank_line)
            try:
                for data in _blocks(stream, chunk_bytes, cut, path, limit):
                    yield Part(form, name, line, data), (index, offset + len(data), line + data.count(b"\n"))
                    offset, line = offset + len(data), line + data.count(b"\n")
            except _TooLong:
                what, hint = (
                    ("line", "split it into several lines")
                    if form == "jsonl"
                    else ("the document starting at line", "put blank lines between its parts")
                )
                raise too_long(f"{path}, {what} {line}", limit, hint) from None


# -- checking ---------------------------------------------------------------------------------------


def check_within(folder: Path, path: Path, what: str) -> None:
    """Read nothing outside the folder the user named: a link there to a file elsewhere is refused."""
    target = path.resolve()
    if not target.is_relative_to(folder.resolve()):
        raise DataError(
            f"{path} leads to {target}, outside the {what} {folder}; copy the file into the folder, or name it directly"
        )


def check_arrow_schema(schema: Any, fields: Fields, where: str) -> None:
    """Every needed column is there and holds strings."""
    import pyarrow as pa

    for column in fields.columns:
        if column not in schema.names:
            flag = "--text-field" if fields.kind == "text" else "--prompt-field / --response-field"
            raise DataError(f"{where}: no {column!r} column (it has {schema.names}); name the right one with {flag}")
        kind = schema.field(column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
            raise DataError(f"{where}: column {column!r} holds {kind}, not strings; name a text column")


# -- reading -----------------------------------------------------------------------------------------


class _Hashing(io.RawIOBase):
    """A file read through sha256 and a byte count (the progress bar's), as it streams."""

    def __init__(self, path: Path, on_read: Callable[[int], None]):
        try:
            self.file: io.BufferedReader = open(path, "rb")  # noqa: SIM115 (closed by finish)
        except OSError as err:
            raise DataError(f"{path}: cannot read it ({err.strerror}); check its permissions") from err
        self.sha = hashlib.sha256()
        self.size = 0
        self.on_read = on_read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        count = self.file.readinto(buffer) or 0
        self.sha.update(memoryview(buffer)[:count])
        self.size += count
        self.on_read(count)
        return count

    def finish(self, name: str) -> SourceInfo:
        """Read what is left (trailing bytes a decompressor did not need) and close."""
        while self.readinto(bytearray(READ_BYTES)):
            pass
        self.file.close()
        return SourceInfo(name, self.size, self.sha.hexdigest())


def _open_text(hashed: _Hashing, path: Path) -> IO[bytes]:
    raw = io.BufferedReader(hashed, READ_BYTES)
    if path.name.endswith(".gz"):
        return cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="rb"))
    if path.name.endswith(".zst"):
        try:
            import zstandard
        except ImportError as err:
            raise DataError(f"{path}: .zst files need the zstandard library: pip install zstandard") from err
        return cast(IO[bytes], zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
    return raw


def _discard(stream: IO[bytes], count: int) -> None:
    while count > 0:
        got = len(stream.read(min(count, READ_BYTES)))
        if not got:
            return
        count -= got


class _TooLong(Exception):
    """No cut within the document limit: one document is longer than it."""


def too_long(what: str, limit: int, hint: str) -> DataError:
    return DataError(
        f"{what} is longer than {limit / 2**20:g} MiB, the limit of one document; {hint}, or raise the limit "
        "(--max-document-mb)"
    )


def _blocks(stream: IO[bytes], size: int, cut: Callable[[bytes], int], path: Path, limit: int) -> Iterator[bytes]:
    """The stream in blocks of about ``size`` bytes, each ending where ``cut`` says (or at the end); more
    than ``limit`` bytes with no cut is :class:`_TooLong`, so one document never fills memory."""
    pending: list[bytes] = []
    held = 0
    while True:
        data = _read_or_fail(stream, size, path)
        if not data:
            if pending:
                yield b"".join(pending)
            return
        at = cut(data)
        if at <= 0:
            pending.append(data)
            held += len(data)
            if held > limit:
                raise _TooLong
            continue
        yield b"".join([*pending, data[:at]])
        pending, held = [data[at:]], len(data) - at


def _read_or_fail(stream: IO[bytes], size: int, path: Path) -> bytes:
    try:
        return stream.read(size)
    except DataError:
        raise
    except Exception as err:  # gzip (OSError, EOFError) and zstandard (ZstdError) on damaged data
        raise DataError(f"{path}: cannot read or decompress it ({err}); check or replace the file") from err


def _after_last_newline(data: bytes) -> int:
    return data.rfind(b"\n") + 1


def _after_blank_line(data: bytes) -> int:
    """Just past the last blank line (only whitespace) in ``data``: no document spans the cut."""
    last = 0
    for match in _BLANK_LINE.finditer(data, max(0, len(data) - (1 << 16))):
        last = match.end()
    return last


def parquet_schema(path: Path) -> Any:
    pq = _pyarrow_parquet(path)
    try:
        return pq.read_schema(path)
    except Exception as err:  # pyarrow raises its own error types for a file that is not parquet
        raise DataError(f"{path}: not a parquet file pyarrow can read ({err})") from err


def _pyarrow_parquet(path: Path) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise DataError(f"{path}: parquet sources need pyarrow: pip install pyarrow (datasets brings it)") from err
    return pq


def _parquet_parts(
    index: int, path: Path, columns: tuple[str, ...], first_row: int, skip_all: bool, hashed: _Hashing
) -> Iterator[tuple[Part, Cursor]]:
    """Row batches of the needed columns; the file's bytes count for the progress bar as rows go by
    (pyarrow reads the file itself, so it is hashed in one pass of its own)."""
    pq = _pyarrow_parquet(path)
    hashed.on_read, report = (lambda n: None), hashed.on_read
    if skip_all:
        report(path.stat().st_size)
        return
    try:
        reader = pq.ParquetFile(path)
        total = reader.metadata.num_rows or 1
        row = 0
        for batch in reader.iter_batches(batch_size=ARROW_ROWS, columns=list(columns)):
            begin, row = row, row + batch.num_rows
            report(path.stat().st_size * (row - begin) // total)
            if row <= first_row:
                continue
            batch = batch.slice(max(0, first_row - begin))
            data = {c: batch.column(c) for c in columns}
            yield Part("arrow", str(path), max(begin, first_row), data), (index, row, 1)
    except DataError:
        raise
    except Exception as err:  # a damaged file: pyarrow's own error types
        raise DataError(f"{path}: pyarrow cannot read it ({err})") from err
