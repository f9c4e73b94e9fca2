"""The output folder of ``prepare``: checked before any work, the finished folder published by renames,
and what a kill during publishing left undone by the next run.

A prepare writes into ``.<out>.prepare-tmp`` beside ``out``. Publishing moves a prepared dataset
already at ``out`` aside to ``.<out>.old``, renames the new one into place, then deletes the old one:
a kill between the renames leaves the old one whole, and the next prepare into ``out`` moves it back
(:func:`recover`). No link is followed: an output, temporary or old folder that is a link is refused,
and a link inside the temporary folder is not a prepare's file.

This is the output rule of ``polyshard.checkpoint.output`` (export, reshard, saves) for ``prepare``:
nothing replaced without ``--overwrite``, never the source or a folder in or around it, links and a
file where a folder belongs refused in one line. Its temporary folder has a fixed name, not a random
one, because a prepare killed midway resumes from it; a folder of that name holding anything a prepare
does not write is refused, never emptied. (data sits beside checkpoint, not below it: it cannot import it.)
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

from polyshard.data.errors import DataError
from polyshard.data.format import _BARE, DOCS, FORMAT, MANIFEST, MASK, TOKENS

PROGRESS = "progress.json"
TEMP_SUFFIX = ".prepare-tmp"
OLD_SUFFIX = ".old"


def is_prepared(folder: Path) -> bool:
    try:
        path = folder / MANIFEST
        return not path.is_symlink() and bool(json.loads(path.read_text()).get("format") == FORMAT)
    except (OSError, ValueError, AttributeError, RecursionError):
        return False


def temp_of(out: Path) -> Path:
    return out.with_name("." + out.name + TEMP_SUFFIX)


def _old(out: Path) -> Path:
    """Where a replaced output waits while the new one moves in; restored by the next run if a kill
    came between the two renames (:func:`recover`)."""
    return out.with_name("." + out.name + OLD_SUFFIX)


def check_out(out: Path, source: Path | None, overwrite: bool) -> None:
    """Before any work: ``out`` can be written, and is neither the source, inside it, nor around it."""
    if not out.parent.is_dir():
        raise DataError(f"{out.parent} does not exist; create it, or choose another output folder")
    for path in (out, temp_of(out), _old(out)):
        if path.is_symlink():  # writing or renaming there would act on whatever the link points to
            raise DataError(f"{path} is a link; give a real folder as the output (links are not followed)")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise DataError(f"cannot write in {out.parent} (read-only or not yours); choose an output folder you can write")
    recover(out)
    if _old(out).exists():  # still there: not a prepare's, and a replaced output is moved there
        raise DataError(f"{_old(out)} is in the way (a replaced output is moved there first); move it away")
    if source is not None:
        here, there = out.resolve(), source.resolve()
        if here == there or here.is_relative_to(there) or there.is_relative_to(here):
            raise DataError(
                f"the output {out} is the source {source}, inside it or around it; "
                "write the prepared dataset to a folder outside the source"
            )
    if out.exists() and not out.is_dir():
        raise DataError(f"{out} exists and is not a folder; choose another output folder")
    if out.is_dir() and any(out.iterdir()):
        if not is_prepared(out):
            raise DataError(f"{out} is a folder that is not a prepared dataset; choose another (it is never deleted)")
        if not overwrite:
            raise DataError(f"{out} is already a prepared dataset; pass --overwrite (overwrite=True) to replace it")


def ours(path: Path) -> bool:
    """A file a prepare writes into its temporary folder."""
    name = path.name
    ours = name in (PROGRESS, PROGRESS + ".tmp", MANIFEST, MANIFEST + ".tmp")
    real = path.is_file() and not path.is_symlink()  # a link was put there by someone else: never written through
    return real and (ours or name.endswith((TOKENS, DOCS, MASK)) and bool(_BARE.match(name)))


def publish(temp: Path, out: Path) -> None:
    """Rename the finished folder into place; a prepared dataset already there is moved aside first and
    deleted only after. A kill between the renames leaves it whole under :func:`_old`, and the next
    prepare into ``out`` moves it back (:func:`recover`)."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    old = _old(out)
    if out.exists():
        out.rename(old)
    temp.rename(out)
    _delete_old(old)


def _delete_old(old: Path) -> None:
    """The replaced output, its manifest first: a kill part way leaves a folder that is no longer a
    prepared dataset, which :func:`recover` then deletes rather than restores."""
    if old.is_dir():
        (old / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(old)


def recover(out: Path) -> None:
    """Undo what a kill during :func:`_publish` left: the previous output moved aside and nothing in its
    place is moved back; a replaced one whose deletion was cut short (no manifest, only shard files) goes."""
    old = _old(out)
    if not old.is_dir() or old.is_symlink():
        return
    if not out.exists() and is_prepared(old):
        old.rename(out)
    elif out.exists() and all(ours(p) for p in old.iterdir()):
        _delete_old(old)


class WriteError(DataError):
    """A write that failed: a full disk, a read-only or forbidden folder (the message says which)."""

    def __init__(self, where: str | Path, reason: str, fix: str):
        super().__init__(f"cannot write {where} ({reason}); {fix}")
        self.where, self.reason = where, reason


def write_error(err: OSError, out: Path) -> WriteError:
    """A failed write as one line: the file, the reason, the fix. numpy's ``tofile`` reports a short write
    with no errno, so a disk with (almost) nothing free counts as full too."""
    where = err.filename or out
    if err.errno in (errno.ENOSPC, errno.EDQUOT) or _nearly_full(out.parent):
        reason = "the disk is full"
        fix = "free space (or choose a folder on another disk) and run again: it resumes where it stopped"
    elif err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        reason, fix = err.strerror or str(err), "choose an output folder you can write, or fix its permissions"
    else:
        reason, fix = err.strerror or str(err), "check the output folder and its disk"
    return WriteError(where, reason, fix)


def _nearly_full(folder: Path) -> bool:
    try:
        return shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False
