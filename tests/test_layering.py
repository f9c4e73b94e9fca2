"""Packages depend only downward: mesh <- collectives <- {tp, pp, dp, ep, cp} <- models <- trainer <- planner
<- cli, and mesh <- checkpoint <- models, data <- trainer.

Reads every import in every package's source (and its pyproject dependencies)
and fails when one points sideways or up.
"""

import ast
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]

# package -> the polyshard packages it may import (besides itself)
ALLOWED = {
    "mesh": set(),
    "collectives": {"mesh"},
    "checkpoint": {"mesh"},  # needs no model code: only placement records
    "data": set(),  # prepared datasets need no torch and no process group
    "tp": {"mesh", "collectives"},
    "pp": {"mesh", "collectives"},
    "dp": {"mesh", "collectives"},
    "ep": {"mesh", "collectives"},
    "cp": {"mesh", "collectives"},
    # the families: common blocks and one folder each; their plans name tp styles and ep's layers, their
    # Hugging Face adapters name checkpoint tensors
    "models": {"mesh", "collectives", "checkpoint", "tp", "ep", "cp"},
    "trainer": {"mesh", "data", "collectives", "checkpoint", "tp", "pp", "dp", "ep", "cp", "models"},
    "planner": {"mesh", "data", "collectives", "checkpoint", "tp", "pp", "dp", "ep", "cp", "models", "trainer"},
    "cli": {"mesh", "data", "collectives", "checkpoint", "tp", "pp", "dp", "ep", "cp", "models", "trainer", "planner"},
}


def _package_dirs():
    dirs = {p.name: p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists()}
    dirs["cli"] = ROOT / "apps" / "cli"
    return dirs


def _imported_polyshard_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "polyshard" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_every_package_is_known_and_namespaced():
    dirs = _package_dirs()
    assert set(dirs) <= set(ALLOWED), f"add {set(dirs) - set(ALLOWED)} to ALLOWED with its downward deps"
    for name, folder in dirs.items():
        assert (folder / "src" / "polyshard" / name).is_dir()
        assert not (folder / "src" / "polyshard" / "__init__.py").exists(), "polyshard is a PEP 420 namespace"


def test_imports_point_only_downward():
    violations = []
    for name, folder in _package_dirs().items():
        for path in sorted((folder / "src").rglob("*.py")):
            for target in _imported_polyshard_packages(path) - {name}:
                if target not in ALLOWED[name]:
                    violations.append(f"{path.relative_to(ROOT)} imports polyshard.{target}")
    assert not violations, "imports that point sideways or up:\n" + "\n".join(violations)


def test_declared_dependencies_point_only_downward():
    for name, folder in _package_dirs().items():
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        assert project["name"] == f"polyshard-{name}" and project["version"]
        deps = {re.split(r"[<>=!~ \[]", d)[0] for d in project.get("dependencies", [])}
        ours = {d.removeprefix("polyshard-") for d in deps if d.startswith("polyshard-")}
        assert ours <= ALLOWED[name], f"{name} declares {ours - ALLOWED[name]}"
        used = set()
        for path in (folder / "src").rglob("*.py"):
            used |= _imported_polyshard_packages(path) - {name}
        assert used <= ours, f"polyshard-{name} imports {used - ours} without declaring them in pyproject.toml"


def test_the_checker_catches_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from polyshard.tp import layers\nimport polyshard.trainer.config\n")
    assert _imported_polyshard_packages(bad) == {"tp", "trainer"}
