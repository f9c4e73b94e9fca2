"""Report files the user names (``--json``, ``--svg``): checked before anything runs.

The output rule every writer keeps (polyshard.checkpoint.output for checkpoints and exports): nothing that
exists is replaced unless the user says so with ``--overwrite``. A report is small and written whole at the
end, so the check is the whole rule here: an existing file without ``--overwrite``, a folder or a link in the
report's place, or a parent folder that does not exist, is refused in one line before a process starts.
"""

from __future__ import annotations

from pathlib import Path

from polyshard.cli.errors import fail


def report_file(command: str, option: str, path: Path | None, overwrite: bool) -> Path | None:
    """``path`` (absolute) if a report may be written there, else exit 2 naming ``option`` and the fix."""
    if path is None:
        return None
    if path.is_symlink():
        fail(command, f"{option} {path} is a link; give the file itself")
    if path.is_dir():
        fail(command, f"{option} {path} is a folder; give a file name inside it")
    if path.exists() and not overwrite:
        fail(command, f"{option} {path} exists; give another name, or --overwrite to replace it")
    if not path.parent.is_dir():
        fail(command, f"{option} {path}: the folder {path.parent} does not exist")
    return path.resolve()


def report_args(command: str, path: Path | None, overwrite: bool) -> list[str]:
    """``["--json", FILE]`` for a benchmark module that writes its own records, once ``path`` is checked."""
    report = report_file(command, "--json", path, overwrite)
    return [] if report is None else ["--json", str(report)]
