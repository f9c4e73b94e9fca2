"""A user's mistake that only a worker sees is one line on the terminal, exit 2; torchrun's agent leaves
no torchelastic_* folder in the temp folder. Before: three lines (ours, torch's error record, the
agent's summary) and a torchelastic_* folder left by every `polyshard train`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from polyshard.cli.launch import torchrun_command

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.system  # a whole job through torchrun (11 s)
def test_a_user_error_on_every_rank_is_one_line_and_nothing_is_left_in_tmp(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    out = tmp_path / "run"
    out.mkdir()
    cmd = torchrun_command(2, "tests.reliability._user_error_worker", [str(out)])
    env = {**os.environ, "TMPDIR": str(temp), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("DataError on rank "), lines
    assert list(temp.iterdir()) == [], "torchrun's agent left its log folder"
    assert sys.executable == cmd[0]
