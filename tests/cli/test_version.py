"""`polyshard --version`: every polyshard distribution's version (or "not installed") and torch's."""

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import tomllib
from typer.testing import CliRunner

from polyshard.cli import version as versions
from polyshard.cli.main import app

ROOT = Path(__file__).resolve().parents[2]


def _printed(output: str) -> dict[str, str]:
    return dict(line.split(maxsplit=1) for line in output.strip().splitlines())


def test_version_lists_every_distribution_of_the_repository_and_torch():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    printed = _printed(result.output)
    projects = [*ROOT.glob("packages/*/pyproject.toml"), ROOT / "apps/cli/pyproject.toml"]
    projects.append(ROOT / "benchmarks/pyproject.toml")
    names = {tomllib.loads(p.read_text())["project"]["name"] for p in projects}
    assert names == set(versions.DISTRIBUTIONS)  # a new package gets its line
    assert set(printed) == names | {"torch"}
    for name in names:
        assert printed[name] == version(name)  # every one is installed in the project's venv
    import torch

    assert printed["torch"] == torch.__version__


def test_a_distribution_not_installed_says_so(monkeypatch):
    def without_tp(name: str) -> str:
        if name == "polyshard-tp":
            raise PackageNotFoundError(name)
        return version(name)

    monkeypatch.setattr(versions, "version", without_tp)
    printed = _printed(CliRunner().invoke(app, ["--version"]).output)
    assert printed["polyshard-tp"] == "not installed"
    assert printed["polyshard-mesh"] == version("polyshard-mesh")
