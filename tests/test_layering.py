"""Packages depend only downward: mesh <- collectives <- {tp, pp, dp, ep, cp} <- models <- trainer <- planner
<- cli, and mesh <- checkpoint <- models, data <- trainer. The benchmarks (polyshard-bench) sit beside the
library: they may import every library package, only the cli imports them, and no library does.

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
}
# The benchmarks may import the whole library; the cli, the benchmarks too.
ALLOWED["bench"] = ALLOWED["planner"] | {"planner"}
ALLOWED["cli"] = ALLOWED["bench"] | {"bench"}
APPS = {"bench", "cli"}  # beside or above the library; every other entry is a library distribution


def _package_dirs():
    dirs = {p.name: p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists()}
    dirs["bench"] = ROOT / "benchmarks"
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


def test_no_library_imports_or_declares_the_benchmarks():
    libraries = {name: folder for name, folder in _package_dirs().items() if name not in APPS}
    assert {"mesh", "tp", "planner"} <= set(libraries) and not any("bench" in ALLOWED[n] for n in libraries)
    found = []
    for name, folder in libraries.items():
        found += [
            str(p.relative_to(ROOT))
            for p in (folder / "src").rglob("*.py")
            if "bench" in _imported_polyshard_packages(p)
        ]
        found += [f"{name}: {p.relative_to(ROOT)}" for p in (folder / "src").rglob("*bench*")]
        deps = tomllib.loads((folder / "pyproject.toml").read_text())["project"].get("dependencies", [])
        found += [f"polyshard-{name} depends on {d}" for d in deps if d.startswith("polyshard-bench")]
    assert not found, "benchmarks belong in benchmarks/ (polyshard.bench), not in a library:\n" + "\n".join(found)


def test_the_checker_catches_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from polyshard.tp import layers\nimport polyshard.trainer.config\n")
    assert _imported_polyshard_packages(bad) == {"tp", "trainer"}


# -- no module circles, in any package ---------------------------------------------------------------


def module_imports(path: Path) -> set[str]:
    """Every polyshard module or name ``path`` imports (also inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n.startswith("polyshard.")}


def _module_graph() -> dict[str, set[str]]:
    modules = {}
    for folder in _package_dirs().values():
        for path in sorted((folder / "src").rglob("*.py")):
            parts = path.relative_to(folder / "src").with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        # A package's __init__ re-exporting its own modules is not a circle: its modules import each
        # other by their own names, never through the package (checked here by leaving that edge out).
        targets = {t for t in module_imports(path) if t in modules} - {name}
        graph[name] = {t for t in targets if not name.startswith(t + ".") and not t.startswith(name + ".")}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return out


def test_no_modules_import_each_other_round_a_circle():
    assert _circles(_module_graph()) == []


def test_the_circle_finder_finds_one():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The nn.Modules the strategy packages may define: each is a parallel form of a layer a model defines, or a
# wrapper around a whole model. A transformer's own modules (attention, MLPs, norms, the block, the MoE
# layer's router and experts) live in polyshard.models.
PARALLEL_MODULES = {
    "tp": {"ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ReplicatedKVLinear"},
    "cp": {"ContextParallelAttention"},  # wraps a model's attention core
    "dp": {"DataParallel", "FullyShardedDataParallel"},  # wrap a whole model
    "ep": set(),  # shards any polyshard.ep.ExpertLayer; defines none
    "pp": {"Stage"},  # a stage's layers in order (nn.Sequential with side inputs)
}


def _module_classes(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ClassDef):
            bases = {ast.unparse(b) for b in node.bases}
            if any(b.startswith(("nn.", "torch.nn.")) or b == "Module" for b in bases):  # Module, Sequential...
                found.add(node.name)
    return found


def test_strategy_packages_define_no_model_modules():
    for package, allowed in PARALLEL_MODULES.items():
        source = ROOT / "packages" / package / "src"
        defined = set().union(*(_module_classes(p) for p in source.rglob("*.py")))
        assert defined == allowed, (
            f"polyshard.{package} defines {sorted(defined - allowed)} (model modules belong in polyshard.models)"
        )
