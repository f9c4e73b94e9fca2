"""The trainer's folders are layers: each imports only from its own layer or those below it (read from
the source, every import counted, also those inside functions). That no modules import each other round
a circle is tests/test_layering.py's check, over every package.

    errors <- config <- data <- tasks <- engine <- checkpointing <- loop <- runtime
"""

from pathlib import Path

from tests.test_layering import module_imports

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "packages" / "trainer" / "src"
LAYERS = ["errors", "extras", "config", "data", "tasks", "engine", "checkpointing", "loop", "runtime", "evaluation"]


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / "polyshard" / "trainer").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path) -> set[str]:
    return {n for n in module_imports(path) if n.startswith("polyshard.trainer.")}


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
