"""Whether a ``.zst`` file holds whole frames: zstandard's stream reader ends quietly where a file was
cut short inside a frame, so a truncated corpus would be prepared as if complete.

The check walks the frame and block headers (RFC 8878, section 3.1) with seeks, never decompressing:
a frame is a magic number, a header, blocks each with a 3-byte header (last-block flag, type, size)
and an optional 4-byte checksum; a skippable frame is a magic number and a size. The walk reads a few
bytes per 128 KB block, so it costs little next to reading the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

from polyshard.data.errors import DataError

_MAGIC = 0xFD2FB528
_SKIPPABLE = 0x184D2A50  # the top 28 bits; the low 4 are free
_RLE = 1  # block type whose content is one byte repeated


def check_zstd_frames(path: Path) -> None:
    """A :class:`DataError` naming ``path`` unless it is a sequence of complete zstd frames."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        while file.tell() < size:
            _frame(file, path, size)


def _read(file: IO[bytes], count: int, path: Path) -> bytes:
    data = file.read(count)
    if len(data) != count:
        raise DataError(f"{path}: the file ends inside a zstd frame (it was cut short); copy or compress it again")
    return data


def _skip(file: IO[bytes], count: int, path: Path, size: int) -> None:
    if file.tell() + count > size:
        raise DataError(f"{path}: the file ends inside a zstd frame (it was cut short); copy or compress it again")
    file.seek(count, 1)


def _frame(file: IO[bytes], path: Path, size: int) -> None:
    magic = int.from_bytes(_read(file, 4, path), "little")
    if magic & 0xFFFFFFF0 == _SKIPPABLE:
        _skip(file, int.from_bytes(_read(file, 4, path), "little"), path, size)
        return
    if magic != _MAGIC:
        raise DataError(f"{path}: bytes at offset {file.tell() - 4} are not a zstd frame; check or replace the file")
    descriptor = _read(file, 1, path)[0]
    single_segment, checksum = descriptor >> 5 & 1, descriptor >> 2 & 1
    dict_bytes = (0, 1, 2, 4)[descriptor & 3]
    content_bytes = (single_segment, 2, 4, 8)[descriptor >> 6]
    _skip(file, (0 if single_segment else 1) + dict_bytes + content_bytes, path, size)
    while True:
        header = int.from_bytes(_read(file, 3, path), "little")
        last, kind, length = header & 1, header >> 1 & 3, header >> 3
        if kind == 3:
            raise DataError(f"{path}: a zstd block of a reserved type at offset {file.tell() - 3}; replace the file")
        _skip(file, 1 if kind == _RLE else length, path, size)
        if last:
            break
    _skip(file, 4 * checksum, path, size)
