"""Installing only polyshard-mesh and polyshard-collectives works and pulls in no other polyshard package."""

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.long
def test_mesh_and_collectives_install_alone(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    # Reuse this environment's torch instead of installing 700 MB again: a .pth line adds the
    # directory to sys.path without running the editable-install hooks that live there.
    (site / "torch_from_dev_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [py, "-m", "pip", "install", "--quiet", str(ROOT / "packages/mesh"), str(ROOT / "packages/collectives")],
        check=True,
        timeout=600,
    )
    installed = sorted(p.name.split("-")[0] for p in site.glob("polyshard*.dist-info"))
    assert installed == ["polyshard_collectives", "polyshard_mesh"]
    probe = (
        "import importlib.util as u, polyshard.collectives, polyshard.mesh;"
        "from polyshard.collectives import copy_to; from polyshard.mesh import MeshLayout;"
        "print(u.find_spec('polyshard.tp') is None, u.find_spec('polyshard.trainer') is None,"
        f" polyshard.mesh.__file__.startswith({str(site)!r}))"
    )
    out = subprocess.check_output([py, "-c", probe], text=True, cwd=tmp_path).split()
    assert out == ["True", "True", "True"]
