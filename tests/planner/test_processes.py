"""The process count against the machine (issue 46): ``--layout auto --nproc 64`` on a 2-core, 24 GiB
machine started 64 workers. Now a count past 8 per core, or past what the memory holds of the processes'
own overhead, is refused before anything starts, naming the cores and the memory; ``--force`` launches
anyway. 8 processes on 2 cores (the test suite's and ``make demo``'s) stay allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from polyshard.planner import fits
from polyshard.planner.fits import PROCESSES_PER_CORE, WORKER_OVERHEAD, check_processes
from polyshard.trainer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
GIB = float(1 << 30)


def test_the_rule_counts_cores_and_the_processes_own_memory():
    check_processes(8, cores=2, memory=24 * GIB)  # the suite's and the demo's 8 ranks on 2 cores
    check_processes(PROCESSES_PER_CORE * 2, cores=2, memory=24 * GIB)
    with pytest.raises(ConfigError, match=r"^--nproc 17: this machine has 2 cores and 24.0 GiB of memory, .*per core"):
        check_processes(17, cores=2, memory=24 * GIB)
    # 64 cores but 8 GiB: 64 workers' own ~0.3 GiB each do not fit, whatever the model
    with pytest.raises(ConfigError, match=r"64 cores and 8.0 GiB .* before any model.*give --nproc (\d+) or fewer"):
        check_processes(64, cores=64, memory=8 * GIB)
    most = int(8 * GIB // WORKER_OVERHEAD)
    check_processes(most, cores=64, memory=8 * GIB)  # the count the message offers passes


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """This test's machine (2 cores, 24 GiB) and the workers `polyshard train` tried to start."""
    from polyshard.cli import train as train_cli

    started: list[int] = []
    monkeypatch.setattr(fits, "host_cores", lambda: 2)
    monkeypatch.setattr(fits, "host_memory", lambda: 24 * GIB)
    monkeypatch.setattr(train_cli, "run_local", lambda nproc, *args, **kwargs: started.append(nproc) or 0)
    return started


def _train(*args: str):
    from polyshard.cli.main import app

    return CliRunner().invoke(app, ["train", *args])


def test_layout_auto_on_64_processes_is_refused_before_the_planner(machine, tmp_path):
    config = str(ROOT / "apps/configs/gpt-tiny-dp.toml")
    result = _train(config, "--layout", "auto", "--nproc", "64", "--out", str(tmp_path / "run"))
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "config error: --nproc 64: this machine has 2 cores and 24.0 GiB of memory, too little for 64 processes "
        "(more than 8 per core); give --nproc 16 or fewer, or pass --force to start them anyway"
    )
    assert machine == [] and not (tmp_path / "run").exists()


def test_eight_processes_on_two_cores_still_launch_and_force_passes_the_check(machine, tmp_path):
    config = str(ROOT / "apps/configs/gpt-shakespeare-3d.toml")  # make demo's: pp2 x dp2 x tp2
    result = _train(config, "--out", str(tmp_path / "demo"), "--set", "training.steps=1")
    assert result.exit_code == 0, result.output
    big = [str(ROOT / "apps/configs/gpt-tiny-dp.toml"), "--nproc", "32", "--out", str(tmp_path / "big")]
    big += ["--set", "parallel.dp=32", "--set", "training.global_batch_size=32"]
    refused = _train(*big)
    assert refused.exit_code == 2 and "--nproc 32: this machine has 2 cores" in refused.stderr
    forced = _train(*big, "--force")
    assert forced.exit_code == 0, forced.output
    assert machine == [8, 32]
