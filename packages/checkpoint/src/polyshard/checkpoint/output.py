"""The one rule for everything this package writes: exports (one file, a Hugging Face folder), reshards
and checkpoint saves.

- Nothing that exists is replaced unless the caller asked (``overwrite``, the command line's
  ``--overwrite``), and then only a file by a file and a folder by a folder.
- Nothing is written onto, inside or around what is being read (``protected``: the checkpoint and the
  run's ``checkpoints/`` folder), asked or not: an export must never destroy its own source.
- A destination that is a link (dangling or not) is refused: writing there acts on whatever it names.
- The work goes to a temporary name that is ours alone (:mod:`tempfile` makes it unique, with
  :data:`TEMP_PREFIX`, beside the destination so the last rename stays on one disk). It is renamed into
  place when complete and removed on every other exit; a user's ``<dest>.tmp`` or ``.tmp-<dest>`` is
  never touched.

Every refusal is a :class:`CheckpointError` in one line naming the path and the fix.
(``polyshard.data.output`` keeps the same rule for ``prepare``; data sits beside this package, not
below it, so it cannot import this module.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from polyshard.checkpoint.errors import CheckpointError

_UMASK = os.umask(0o022)  # read once, at import (os.umask both sets and returns it), and put back
os.umask(_UMASK)
TEMP_PREFIX = ".polyshard-tmp-"
"""How every temporary file and folder we make starts; :func:`stale_temporaries` finds a killed save's by it."""


def reading(folder: Path) -> tuple[Path, ...]:
    """What writing must stay out of while ``folder`` (a checkpoint step folder) is read: the folder
    and, in a run, the ``checkpoints/`` folder that holds it with the run's other saves."""
    folder = Path(folder)
    return (folder, folder.parent) if folder.parent.name == "checkpoints" else (folder,)


def check_destination(
    destination: str | Path,
    *,
    folder: bool,
    overwrite: bool = False,
    protected: Iterable[Path] = (),
    make_parents: bool = False,
) -> Path:
    """``destination`` checked before any work: a new file (``folder=False``) or folder, or with
    ``overwrite`` an existing one of the same kind; outside everything ``protected``. With
    ``make_parents`` missing parent folders may be created (:func:`new_folder`), else they must exist."""
    destination = Path(destination)
    kind = "folder" if folder else "file"
    if destination.is_symlink():
        raise CheckpointError(f"{destination} is a link; give a real path for the {kind} (links are not followed)")
    _check_parents(destination.parent, make_parents)
    here = destination.parent.resolve() / destination.name
    for path in protected:
        there = Path(path).resolve()
        if here == there or here.is_relative_to(there) or there.is_relative_to(here):
            raise CheckpointError(
                f"{destination} lies in, on or around {there}, which this command reads; write the {kind} outside "
                "it (--overwrite does not change this)"
            )
    if destination.exists():
        if destination.is_dir() != folder:
            found = "folder" if destination.is_dir() else "file"
            raise CheckpointError(f"{destination} is a {found}, not a {kind}; give a new {kind} to write")
        if not overwrite:
            raise CheckpointError(f"{destination} exists; pass --overwrite to replace it, or give a new {kind}")
    return destination


def _check_parents(parent: Path, make: bool) -> None:
    """Each existing part of ``parent`` is a folder (a file or a dangling link there is one line, not a
    NotADirectoryError); a missing part is created later only when ``make``."""
    for part in (parent, *parent.parents):
        if part.is_symlink() and not part.exists():
            raise CheckpointError(f"{part} is a link to nothing; give a destination in a real folder")
        if part.exists():
            if not part.is_dir():
                raise CheckpointError(f"{part} is a file, not a folder; give a destination in a folder")
            if not os.access(part, os.W_OK | os.X_OK):
                raise CheckpointError(f"cannot write in {part} (read-only or not yours); choose another destination")
            return
        if not make:
            raise CheckpointError(f"{parent} does not exist; create it or choose another destination")


def _make_parents(destination: Path) -> list[Path]:
    """Create the folders above ``destination`` (checked by :func:`check_destination` with ``make_parents``);
    returns those it made, deepest first."""
    made = [part for part in (destination.parent, *destination.parent.parents) if not part.exists()]
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _cannot_write(destination, err) from err
    return made


@contextlib.contextmanager
def new_file(destination: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """A temporary file of ours beside ``destination`` to write; renamed onto it when the block ends
    without error, removed otherwise."""
    try:
        handle, name = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{destination.name}-", dir=destination.parent)
    except OSError as err:
        raise _cannot_write(destination, err) from err
    os.close(handle)
    tmp = Path(name)
    tmp.chmod(0o666 & ~_UMASK)  # mkstemp makes it private: the finished file gets the usual permissions
    try:
        yield tmp
        _check_still_new(destination, overwrite)
        os.replace(tmp, destination)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def new_folder(destination: Path, *, overwrite: bool = False, make_parents: bool = False) -> Iterator[Path]:
    """A temporary folder of ours beside ``destination`` to fill; put in its place (see :func:`publish_folder`)
    when the block ends without error, removed otherwise, with the parents it made (``make_parents``)."""
    made = _make_parents(destination) if make_parents else []
    tmp = temporary_folder(destination)
    done = False
    try:
        yield tmp
        publish_folder(tmp, destination, overwrite=overwrite)
        done = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in [] if done else made:  # deepest first: each is empty once the one below it is gone
            with contextlib.suppress(OSError):
                parent.rmdir()


def temporary_folder(destination: Path) -> Path:
    """A new, empty folder of ours beside ``destination`` (the caller removes it on failure)."""
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{destination.name}-", dir=destination.parent))
    except OSError as err:
        raise _cannot_write(destination, err) from err
    tmp.chmod(0o777 & ~_UMASK)  # mkdtemp makes it private: the finished folder gets the usual permissions
    return tmp


def _cannot_write(destination: Path, err: OSError) -> CheckpointError:
    return CheckpointError(f"cannot write in {destination.parent} ({err.strerror or err}); choose another destination")


def publish_folder(tmp: Path, destination: Path, *, overwrite: bool = False) -> None:
    """Rename the finished ``tmp`` to ``destination``. A folder already there (replaced only with
    ``overwrite``) is first renamed to a temporary name of ours and deleted once the new one is in place."""
    _check_still_new(destination, overwrite)
    if not destination.exists():
        tmp.rename(destination)
        return
    old = temporary_folder(destination)
    os.rename(destination, old)  # onto our empty folder: POSIX rename replaces an empty directory
    tmp.rename(destination)
    shutil.rmtree(old, ignore_errors=True)


def _check_still_new(destination: Path, overwrite: bool) -> None:
    """What appeared at ``destination`` while we wrote is not replaced unless asked."""
    if destination.is_symlink() or (destination.exists() and not overwrite):
        raise CheckpointError(f"{destination} appeared while it was written; nothing was replaced, run again")


def stale_temporaries(root: Path, name: str) -> list[Path]:
    """Temporary folders of ours for ``name`` under ``root`` that a killed writer left (real folders only)."""
    return [p for p in root.glob(f"{TEMP_PREFIX}{name}-*") if p.is_dir() and not p.is_symlink()]
