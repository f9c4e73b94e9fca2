"""Report files the user names (--json, --svg) follow the output rule: an existing file is replaced only
with --overwrite, and a folder, a link or a missing parent is refused in one line before anything runs."""

import pytest
from typer.testing import CliRunner

from polyshard.cli.main import app

SCHEDULE = ["schedule", "1f1b", "--stages", "2", "--microbatches", "2"]


def _run(*args):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("option", ["--json", "--svg"])
def test_an_existing_report_is_kept_unless_overwrite(tmp_path, option):
    report = tmp_path / "report"
    report.write_text("the user's own")
    result = _run(*SCHEDULE, option, str(report))
    assert result.exit_code == 2 and "exists; give another name, or --overwrite" in result.output
    assert report.read_text() == "the user's own"
    assert _run(*SCHEDULE, option, str(report), "--overwrite").exit_code == 0
    assert report.read_text() != "the user's own"


def test_folders_links_and_missing_parents_are_refused_before_anything_runs(tmp_path):
    (tmp_path / "target").write_text("outside")
    (tmp_path / "link.json").symlink_to(tmp_path / "target")
    for path, message in [
        (tmp_path, "is a folder"),
        (tmp_path / "link.json", "is a link"),
        (tmp_path / "no" / "such.json", "does not exist"),
    ]:
        result = _run(*SCHEDULE, "--json", str(path), "--overwrite")
        assert result.exit_code == 2 and message in result.output, result.output
        assert "Traceback" not in result.output and "bubble" not in result.output  # refused before simulating
    assert (tmp_path / "target").read_text() == "outside"


def test_plan_and_bench_keep_an_existing_json(tmp_path):
    report = tmp_path / "plan.json"
    report.write_text("{}")
    for args in (["plan", "tiny", "--devices", "2"], ["bench", "comm", "--nproc", "2"], ["bench", "tp"]):
        result = _run(*args, "--json", str(report))
        assert result.exit_code == 2 and "--overwrite" in result.output, (args, result.output)
    assert report.read_text() == "{}"


def test_calibrate_checks_its_out_before_measuring_and_makes_the_default_folder(tmp_path, monkeypatch):
    import polyshard.cli.plan as plan

    kept = tmp_path / "profile.json"
    kept.write_text("{}")
    result = _run("plan", "--calibrate", "--quick", "--out", str(kept))
    assert result.exit_code == 2 and "--overwrite" in result.output and kept.read_text() == "{}"
    default = tmp_path / "fresh" / "cache" / "profile.json"  # a fresh machine: no folder yet
    monkeypatch.setattr(plan, "DEFAULT_PROFILE", default)
    monkeypatch.setattr("polyshard.planner.calibrate.calibrate", lambda **_: (_ for _ in ()).throw(SystemExit(7)))
    assert _run("plan", "--calibrate", "--quick", "--out", str(default)).exit_code == 7  # got past the check
    assert default.parent.is_dir()
