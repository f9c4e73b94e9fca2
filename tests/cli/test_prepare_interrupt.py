"""Ctrl-C in `polyshard prepare` ends with one line: what is kept and that the same command resumes; the
command started again says it resumed and how much was already done. The interrupt is raised where a
real one lands (between two chunks), at a chosen chunk, so nothing here depends on timing."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from polyshard.cli.main import app
from polyshard.data import prepare as preparing
from polyshard.data.interrupted import kept


def _corpus(folder: Path) -> Path:
    folder.mkdir()
    for i in range(12):
        (folder / f"doc-{i:02d}.txt").write_text(f"document {i}: " + "the king and the queen " * (i + 3))
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _prepare(source: Path, out: Path):
    return CliRunner().invoke(app, ["prepare", str(source), str(out), "--workers", "1", "--quiet"])


def test_ctrl_c_says_what_is_kept_and_the_rerun_says_it_resumed(tmp_path, monkeypatch):
    source = _corpus(tmp_path / "corpus")
    monkeypatch.setattr(preparing, "MIN_CHUNK_BYTES", 256)  # several chunks, each recorded as it is written
    saves = []
    save = preparing._save_progress

    def interrupted_at_the_fourth(temp, state):
        saves.append(state)
        if len(saves) == 4:
            raise KeyboardInterrupt  # as SIGINT would, between two chunks
        save(temp, state)

    monkeypatch.setattr(preparing, "_save_progress", interrupted_at_the_fourth)
    out = tmp_path / "data"
    result = _prepare(source, out)
    done = kept(out)
    assert result.exit_code == 130 and done is not None and 0 < done.documents < 12
    assert result.output.splitlines()[-1] == (
        f"interrupted: {done.documents:,} documents ({done.tokens:,} tokens) are kept in {done.folder}; "
        "run the same command again to resume from there"
    )
    assert "Traceback" not in result.output and not out.exists()

    monkeypatch.setattr(preparing, "_save_progress", save)
    result = _prepare(source, out)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == (
        f"resuming an interrupted prepare of {out}: {done.documents:,} documents ({done.tokens:,} tokens) were "
        "done and are kept; the source is read again from the start (to hash it) and tokenized from where it stopped"
    )
    assert kept(out) is None  # the temporary folder became the dataset
    assert _prepare(source, tmp_path / "whole").exit_code == 0
    assert _files(out) == _files(tmp_path / "whole")  # the same bytes as a run never interrupted


def test_ctrl_c_before_anything_was_written_says_so(tmp_path, monkeypatch):
    source = _corpus(tmp_path / "corpus")

    def interrupted_at_once(temp, state):
        raise KeyboardInterrupt

    monkeypatch.setattr(preparing, "_save_progress", interrupted_at_once)
    result = _prepare(source, tmp_path / "data")
    assert result.exit_code == 130
    assert result.output.splitlines()[-1] == (
        "interrupted: no documents were written yet; run the same command again to start over"
    )
