"""The command blocks of the guides and the README, and running them as a reader would type them.

Every ```` ```bash ```` (or ``sh``, ``shell``, ``python``) block of ``docs/guides/*.md`` and
``README.md`` has one of these markers on the line above it::

    <!-- runs -->                 `make test` runs it: cheap (help, dry runs, the planner, inspect)
    <!-- runs: long -->           `make test-long` runs it: it trains
    <!-- illustration: why -->    not run, and the comment says why (the reader's own files, many nodes)

A page's runnable blocks run in page order in one scratch folder that holds the repository's tracked
files and nothing else (a fresh clone: no ``runs/``, no ``data/``), with ``.venv`` linked in and its
``bin`` first on PATH, as after ``make setup`` and ``source .venv/bin/activate``. Each block runs
whole in its own ``bash -e`` (a ``python`` block in the environment's python): the first command that
fails fails the test, with the block's output. Files carry from block to block; variables a block
exports do not.
``make test`` runs a page's ``runs`` blocks and ``make test-long`` its ``runs: long`` blocks, each kind
in page order on a fresh clone of its own: a block may use the files only of earlier blocks of its kind.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs" / "guides").glob("*.md")) + [ROOT / "README.md"]
COMMAND_LANGUAGES = ("bash", "sh", "shell", "python")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
MARKER = re.compile(r"<!-- (runs(?:: long)?|illustration: [^>]*\S) -->\n$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    text: str
    marker: str | None  # "runs", "runs: long", "illustration: ..." or None (unmarked)

    @property
    def runs(self) -> bool:
        return self.marker is not None and self.marker.startswith("runs")

    @property
    def long(self) -> bool:
        return self.marker == "runs: long"

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def command_blocks(page: Path) -> list[Block]:
    """The page's fenced blocks in a command language, with the marker on the line above each."""
    text = page.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        if match[1] not in COMMAND_LANGUAGES:
            continue
        before = text[: match.start()]
        marker = MARKER.match(before[before.rfind("\n", 0, len(before) - 1) + 1 :])
        line = before.count("\n") + 1
        blocks.append(Block(page, line, match[1], match[2], marker[1] if marker else None))
    return blocks


def fresh_clone(scratch: Path) -> Path:
    """``scratch`` filled with the repository's tracked files as the working tree has them (a clone's
    layout, with this checkout's uncommitted edits), and ``.venv`` linked to this one."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():  # listed but deleted in the working tree: a clone of the edit would not have it
            target = scratch / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target, follow_symlinks=False)
    return link_venv(scratch)


def link_venv(folder: Path) -> Path:
    """``folder/.venv``: a link to the environment running the tests (``make setup``'s ``.venv``)."""
    (folder / ".venv").symlink_to(Path(sys.executable).parent.parent)
    return folder


def run_block(block: Block, clone: Path, timeout_s: float = 420) -> None:
    """Run ``block`` in ``clone`` as typed; raise AssertionError with its output if a command fails."""
    venv = clone / ".venv"
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}
    env.pop("PYTHONPATH", None)  # the installed packages, as a user's shell has them
    env["COLUMNS"] = "120"
    python = [str(venv / "bin" / "python"), "-c", block.text]
    argv = python if block.language == "python" else ["bash", "-e", "-x", "-c", block.text]
    done = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise AssertionError(
            f"{block.where}: the block exited {done.returncode}\n{block.text}\n"
            f"--- stdout (last 3000 characters)\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-5000:]}"
        )
