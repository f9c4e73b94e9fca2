"""The trainer's folders are layers: each imports only from its own layer or those below it, and no
two modules import each other, directly or round a longer circle (read from the source, every import
counted, also those inside functions).

    errors <- config <- data <- tasks <- engine <- checkpointing <- loop <- runtime
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "packages" / "trainer" / "src"
LAYERS = ["errors", "config", "data", "tasks", "engine", "checkpointing", "loop", "runtime"]


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / "polyshard" / "trainer").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n.startswith("polyshard.trainer.")}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    # "from polyshard.models import spec_of" names the package; "import ...models.gpt.gpt2" a module.
    return {name: {n for n in _imports(path) if n in modules} - {name} for name, path in modules.items()}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[2]) if len(parts) > 2 and parts[2] in LAYERS else None  # None: the front door


def test_every_folder_is_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in (SRC / "polyshard" / "trainer").iterdir()}
    assert tops - {"__init__", "__pycache__"} == set(LAYERS), "add the new folder to LAYERS, in its place"


def test_imports_point_only_to_the_same_layer_or_below():
    upward = []
    for module, targets in _graph().items():
        here = _layer(module)
        for target in targets:
            there = _layer(target)
            if here is not None and there is not None and there > here:
                upward.append(f"{module} imports {target}")
    assert not upward, "imports that point up a layer:\n" + "\n".join(sorted(upward))


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


def test_no_module_imports_round_a_circle():
    # A package's __init__ re-exporting its own modules is not a circle: its modules import each other
    # by their own names, never through the package (checked here by leaving the package out).
    graph = {
        module: {t for t in targets if not module.startswith(t + ".")}
        for module, targets in _graph().items()
        if module != "polyshard.trainer"
    }
    assert _circles(graph) == []


def test_the_circle_finder_finds_one():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
