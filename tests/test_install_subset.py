"""Installing a lower subset of the packages works and pulls in no other polyshard package:
polyshard-mesh with polyshard-collectives and one strategy package (cp), and
polyshard-mesh with polyshard-checkpoint, whose command line inspects, reshards and exports, and
polyshard-data, which prepares and reads a corpus with numpy alone (no torch imported)."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SUBSETS = {
    # packages to install -> (an import that must work from them, packages that must stay absent). The cp
    # row installs collectives too (its metadata must pull no tp or trainer); that collectives' code
    # needs no cp is tests/test_layering.py's import check, so mesh + collectives alone is not rebuilt here.
    ("mesh", "collectives", "cp"): (
        "from polyshard.cp import context_parallel_attention; from polyshard.collectives import copy_to",
        ("tp", "ep", "trainer"),
    ),
    ("mesh", "checkpoint"): (
        "from polyshard.checkpoint import Checkpoint, export, write_resharded",
        ("collectives", "tp", "trainer"),
    ),
    ("mesh", "data"): (  # mesh only for the probe's own import; data needs nothing of it
        "from polyshard.data.loader import ShardedLoader; from polyshard.data.prepared import open_prepared",
        ("collectives", "checkpoint", "trainer"),
    ),
}

# Run with only polyshard-data: prepare a small text through its command, read it back through the loader.
DATA_ALONE = """
import pathlib, subprocess, sys
import numpy as np
pathlib.Path("a.txt").write_text("to be or not to be " * 200)
subprocess.run([sys.executable, "-m", "polyshard.data", "prepare", "a.txt", "prepared", "--quiet"], check=True,
               capture_output=True)
from polyshard.data.examples import Windows
from polyshard.data.loader import ShardedLoader
from polyshard.data.prepared import open_prepared
loader = ShardedLoader(Windows(open_prepared("prepared").train, 17), batch_size=4, rank=1, world_size=2, seed=0,
                       shuffle=True)
rows = loader.next_batch()["tokens"]
assert rows.shape == (4, 17) and bytes(rows[0].astype(np.uint8)) in ("to be or not to be " * 201).encode()
assert "torch" not in sys.modules
print("ok")
"""

# Run in the fresh venv with only polyshard-mesh and polyshard-checkpoint: save a two-rank-shaped
# checkpoint without processes, then inspect, reshard and export it through the package's own command.
CHECKPOINT_ALONE = """
import subprocess, sys, torch
from safetensors.torch import load_file
from polyshard.checkpoint import LocalTensor, save_checkpoint
from polyshard.mesh import Replicate, TensorPlacement
w = torch.arange(12.0).reshape(4, 3)
record = TensorPlacement("w", (4, 3), (("dp", Replicate()),))
save_checkpoint("run/checkpoints", 5, {"model/w": LocalTensor(w, record)}, mesh_axes={"dp": 1})
def cli(*args):
    command = [sys.executable, "-m", "polyshard.checkpoint", *args]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout
assert "step 5, mesh {'dp': 1}" in cli("inspect", "run")
cli("reshard", "run/checkpoints/step_00000005", "moved", "--mesh", "dp=2")
cli("export", "moved", "w.safetensors")
assert torch.equal(load_file("w.safetensors")["w"], w)
print("ok")
"""


@pytest.mark.system
@pytest.mark.parametrize("packages", list(SUBSETS), ids="+".join)
def test_subset_installs_alone(tmp_path, packages):
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
        [py, "-m", "pip", "install", "--quiet", *(str(ROOT / "packages" / name) for name in packages)],
        check=True,
        timeout=600,
    )
    installed = sorted(p.name.split("-")[0] for p in site.glob("polyshard*.dist-info"))
    assert installed == sorted(f"polyshard_{name}" for name in packages)
    usage, absent = SUBSETS[packages]
    probe = (
        f"import importlib.util as u, polyshard.mesh; {usage};"
        f"print(*(u.find_spec('polyshard.' + name) is None for name in {absent!r}),"
        f" polyshard.mesh.__file__.startswith({str(site)!r}))"
    )
    # Without PYTHONPATH: a checkout run with its package folders on the path would find them all.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    out = subprocess.check_output([py, "-c", probe], text=True, cwd=tmp_path, env=env).split()
    assert out == ["True"] * (len(absent) + 1)
    if "checkpoint" in packages:
        assert subprocess.check_output([py, "-c", CHECKPOINT_ALONE], text=True, cwd=tmp_path, env=env).split() == ["ok"]
    if "data" in packages:
        assert subprocess.check_output([py, "-c", DATA_ALONE], text=True, cwd=tmp_path, env=env).split() == ["ok"]
