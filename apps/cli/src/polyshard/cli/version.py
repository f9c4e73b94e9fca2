"""``polyshard --version``: the version of every polyshard distribution and of torch.

polyshard is a set of distributions under one namespace (DESIGN.md): a user may install only a few
of them, so each is listed with its own version, or as not installed, never one number for all.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# Every distribution of the project, in the order the packages depend on each other (mesh at the bottom).
DISTRIBUTIONS: tuple[str, ...] = tuple(
    f"polyshard-{name}"
    for name in (
        "mesh", "collectives", "tp", "pp", "dp", "ep", "cp", "models", "data", "checkpoint", "trainer",
        "planner", "cli", "bench",
    )
)  # fmt: skip
NOT_INSTALLED = "not installed"


def installed_version(distribution: str) -> str:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return NOT_INSTALLED


def versions_text() -> str:
    """One line per distribution and one for torch: ``polyshard-mesh 0.1.0``."""
    names = (*DISTRIBUTIONS, "torch")
    width = max(map(len, names))
    return "\n".join(f"{name:<{width}} {installed_version(name)}" for name in names)
