"""`polyshard train` checks the config before starting anything; `--dry-run` prints the plan."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
POLYSHARD = [sys.executable, "-m", "polyshard.cli.main"]


@pytest.mark.long  # a CLI process (7 s); every shipped config still dry-runs in make test
def test_dry_run_prints_mesh_groups_and_memory():
    config = ROOT / "apps/configs/gpt-shakespeare-3d.toml"
    result = subprocess.run(
        POLYSHARD + ["train", str(config), "--dry-run"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "8 processes" in result.stdout and "pp x dp x tp" in result.stdout
    assert "memory per rank (estimate" in result.stdout
    assert "stage 0 on pp rank 0: layers 0-2" in result.stdout and "stage 1 on pp rank 1: layers 3-5" in result.stdout


def test_config_errors_stop_before_any_process(tmp_path):
    config = ROOT / "apps/configs/gpt-tiny-tp.toml"
    cmd = POLYSHARD + ["train", str(config), "--set", "parallel.tp=3", "--out", str(tmp_path / "run")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "config error: parallel.tp=3 does not divide model.num_heads=4" in result.stderr
    assert not (tmp_path / "run").exists()  # nothing was launched or written


def test_a_field_the_family_does_not_have_is_named_with_the_family():
    # Before: the ViT accepted a router, experts and a rotary base it never reads, and exited 0.
    config = ROOT / "apps/configs/vit-digits-3d.toml"
    overrides = ["--set", "model.router='sigmoid'", "--set", "model.num_experts=7", "--set", "model.rope_theta=5.0"]
    result = subprocess.run(
        POLYSHARD + ["train", str(config), "--dry-run", *overrides], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "config error: model.router is not a setting of model.kind='vit'" in result.stderr
    assert "its settings are: kind, preset, hidden" in result.stderr and "image_size" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.long
def test_profile_steps_past_the_run_stop_before_any_process(tmp_path):
    config = ROOT / "apps/configs/gpt-tiny-pp.toml"
    overrides = ["--set", "training.steps=10", "--set", "logging.profile_steps=[5,12]"]
    cmd = POLYSHARD + ["train", str(config), *overrides, "--out", str(tmp_path / "run")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "config error: logging.profile_steps=[5, 12] ends past training.steps=10" in result.stderr
    assert not (tmp_path / "run").exists()


def test_every_shipped_config_dry_runs_as_it_stands(tmp_path):
    """What `polyshard train CONFIG --dry-run` checks (settings, every mesh, the data: prepared into the
    cache) and prints, for every config in apps/configs/ with no flag added: planning configs at real scale
    train on synthetic rows (data.source = "synthetic"), so none needs the user's files. A dry run starts
    no process, so this stays fast."""
    from polyshard.planner.dry_run import describe
    from polyshard.trainer import prepare_launch, read_settings

    configs = sorted((ROOT / "apps/configs").glob("*.toml"))
    assert len(configs) >= 20
    for path in configs:
        launch = prepare_launch(read_settings(path, []), out=tmp_path / "run", nproc=None)
        assert "memory per rank" in describe(launch.config), path.name
        assert not (tmp_path / "run").exists()  # a dry run writes nothing


@pytest.mark.long
def test_bench_matmul_reports_tflops():
    result = subprocess.run(
        POLYSHARD + ["bench", "matmul", "--size", "128", "--iters", "2"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "TFLOP/s" in result.stdout


@pytest.mark.long
def test_inspect_and_export_reject_a_modified_shard(distributed, tmp_path):
    distributed.run(2, _save_small, str(tmp_path))
    folder = next(tmp_path.glob("step_*"))
    ok = subprocess.run(POLYSHARD + ["inspect", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "sha256 verified" in ok.stdout and "[4, 3]" in ok.stdout
    shard = folder / "rank_00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-5])
    for command in (["inspect", str(folder)], ["export", str(folder), str(tmp_path / "out.safetensors")]):
        bad = subprocess.run(POLYSHARD + command, capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and "rank_00001.safetensors does not match its sha256" in bad.stderr
    assert not (tmp_path / "out.safetensors").exists()  # nothing half-written


def _save_small(root):
    import torch
    import torch.distributed as dist

    from polyshard.checkpoint import LocalTensor, save_checkpoint
    from polyshard.mesh import Shard, TensorPlacement

    rank = dist.get_rank()
    record = TensorPlacement("w", (4, 3), (("tp", Shard(0)),))
    piece = torch.arange(12.0).reshape(4, 3)[2 * rank : 2 * rank + 2]
    save_checkpoint(root, 1, {"model/w": LocalTensor(piece, record)}, mesh_axes={"tp": 2})


@pytest.mark.long
def test_init_from_a_missing_checkpoint_stops_before_any_process(tmp_path):
    config = ROOT / "apps/configs/gpt-tiny-dp.toml"
    cmd = POLYSHARD + ["train", str(config), "--init-from", str(tmp_path), "--out", str(tmp_path / "run")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "holds no complete checkpoint" in result.stderr
    both = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=120)
    assert both.returncode == 2 and "not both" in both.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.long
def test_an_out_file_or_a_resume_without_checkpoints_stops_before_any_process(tmp_path):
    # Before: both were accepted and failed inside the workers with tracebacks.
    config = ROOT / "apps/configs/gpt-tiny-dp.toml"
    (tmp_path / "file").write_text("not a folder")
    as_file = subprocess.run(
        POLYSHARD + ["train", str(config), "--out", str(tmp_path / "file")], capture_output=True, text=True, timeout=120
    )
    assert as_file.returncode == 2 and "--out" in as_file.stderr and "is a file" in as_file.stderr
    nothing = subprocess.run(
        POLYSHARD + ["train", str(config), "--out", str(tmp_path / "run"), "--resume"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert nothing.returncode == 2 and "--resume: no complete checkpoint under" in nothing.stderr
    assert "Traceback" not in as_file.stderr + nothing.stderr and not (tmp_path / "run").exists()


@pytest.mark.long
def test_inspect_of_a_run_falls_back_past_a_corrupt_newest_checkpoint(distributed, tmp_path):
    distributed.run(2, _save_small, str(tmp_path))
    older = next(tmp_path.glob("step_*"))
    newer = tmp_path / "step_00000002"
    import shutil

    shutil.copytree(older, newer)
    (newer / "rank_00000.safetensors").write_bytes(b"damaged")
    result = subprocess.run(POLYSHARD + ["inspect", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"skipping {newer}" in result.stderr and f"checkpoint {older}" in result.stdout
    named = subprocess.run(POLYSHARD + ["inspect", str(newer)], capture_output=True, text=True, timeout=120)
    assert named.returncode == 2  # a step folder named by the user is taken as named, never replaced


@pytest.mark.long  # a CLI process (6 s)
def test_compile_needs_a_cpp_compiler_and_says_so_before_any_process(tmp_path):
    """--compile is training.compile; on a CPU without a C++ compiler inductor cannot build kernels."""
    config = ROOT / "apps/configs/gpt-tiny-dp.toml"
    cmd = POLYSHARD + ["train", str(config), "--compile", "--out", str(tmp_path / "run")]
    empty = tmp_path / "bin"
    empty.mkdir()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "PATH": str(empty)})
    assert result.returncode == 2, result.stderr
    assert "config error: training.compile = true on CPU needs a C++ compiler" in result.stderr
    assert not (tmp_path / "run").exists()
