"""`polyshard bench comm` launches real torchrun workers and writes JSON records."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

POLYSHARD = [sys.executable, "-m", "polyshard.cli.main"]


@pytest.mark.long
@pytest.mark.slow
def test_bench_comm_two_processes(tmp_path: Path):
    out = tmp_path / "comm.json"
    cmd = POLYSHARD + ["bench", "comm", "--nproc", "2", "--sizes", "4K,64K", "--iters", "2", "--json", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert "busbw GB/s" in result.stdout and "all_to_all" in result.stdout
    records = json.loads(out.read_text())
    assert {r["op"] for r in records} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"}
    keys = {"op", "world_size", "bytes", "time_s", "algbw_gbps", "busbw_gbps"}
    assert all(set(r) == keys and r["world_size"] == 2 for r in records)


@pytest.mark.long
def test_bench_comm_rejects_unknown_ops():
    cmd = POLYSHARD + ["bench", "comm", "--ops", "all_reduce,telepathy"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "unknown ops ['telepathy']" in result.stderr
