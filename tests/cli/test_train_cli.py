"""`polyshard train` checks the config before starting anything; `--dry-run` prints the plan."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
POLYSHARD = [sys.executable, "-m", "polyshard.cli.main"]


def test_dry_run_prints_mesh_groups_and_memory():
    config = ROOT / "apps/configs/gpt-shakespeare-3d.toml"
    result = subprocess.run(
        POLYSHARD + ["train", str(config), "--dry-run"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "8 processes" in result.stdout and "pp x dp x tp" in result.stdout
    assert "memory per rank (estimate)" in result.stdout


def test_config_errors_stop_before_any_process(tmp_path):
    config = ROOT / "apps/configs/gpt-tiny-tp.toml"
    cmd = POLYSHARD + ["train", str(config), "--set", "parallel.tp=3", "--out", str(tmp_path / "run")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "config error: parallel.tp=3 does not divide model.num_heads=4" in result.stderr
    assert not (tmp_path / "run").exists()  # nothing was launched or written


def test_every_example_config_is_valid():
    from polyshard.trainer.config import load_config
    from polyshard.trainer.constraints import validate
    from polyshard.trainer.plan import describe

    configs = sorted((ROOT / "apps/configs").glob("*.toml"))
    assert len(configs) >= 7
    for path in configs:
        config = load_config(path)
        validate(config, world_size=config.parallel.world_size)
        assert "memory per rank" in describe(config)


def test_bench_matmul_reports_tflops():
    result = subprocess.run(
        POLYSHARD + ["bench", "matmul", "--size", "128", "--iters", "2"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "TFLOP/s" in result.stdout
