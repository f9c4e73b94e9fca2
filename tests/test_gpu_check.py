"""apps/gpu_check.py gets as far as "no CUDA device" on a machine like the GPU one: Python with only
what its image holds (torch, transformers, safetensors, tokenizers, typer and what they require; no
`datasets`, no matplotlib), polyshard read from the source tree, no network. It imports everything it
needs, generates and prepares its data, checks every run's config against that data, then stops with
its own exit status. Passing here means no other wheel has to travel to the GPU machine."""

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ("torch", "transformers", "safetensors", "tokenizers", "typer")  # what the GPU machine's image holds
EXIT_NO_CUDA = 77


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements_closure(roots: tuple[str, ...]) -> set[str]:
    """The distributions installing ``roots`` brings: requirements without extras, recursively."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = _canonical(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:  # a platform's requirement this venv lacks
            continue
        todo += [re.split(r"[\s;<>=!~\[(]", r, maxsplit=1)[0] for r in requires if "extra ==" not in r]
    return seen


def _image_site_packages(folder: Path) -> Path:
    """A site-packages holding only the image's distributions: links to this venv's files of each."""
    folder.mkdir()
    for name in sorted(_requirements_closure(IMAGE)):
        try:
            files = importlib.metadata.distribution(name).files or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for top in {f.parts[0] for f in files if f.parts[0] != ".."}:
            source = Path(str(importlib.metadata.distribution(name).locate_file(top)))
            if source.exists() and not (folder / top).exists():
                (folder / top).symlink_to(source)
    return folder


def test_gpu_check_stops_at_no_cuda_after_its_data(tmp_path):
    site_packages = _image_site_packages(tmp_path / "site-packages")
    assert not any((site_packages / absent).exists() for absent in ("datasets", "matplotlib", "polyshard"))
    # -S: no site processing, so nothing of this venv but the image's distributions is importable.
    result = subprocess.run(
        [sys.executable, "-S", "apps/gpu_check.py"],
        cwd=ROOT,
        env={"PYTHONPATH": str(site_packages), "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == EXIT_NO_CUDA, result.stdout + result.stderr  # stopped, not crashed
    assert "no CUDA device: data prepared" in result.stdout
