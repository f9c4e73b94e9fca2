"""No process outlives its job, a local job takes no connection from the network, and a hang ends
with an error that names the collective, the group and the rank that stopped.

Before: killing `polyshard` left the workers training on their own; the rendezvous store listened
on every interface; a stopped rank hung the job for 600 s and the error named no collective,
group or peer.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time

import pytest

from tests.docs.troubleshooting import assert_page_quotes
from tests.reliability._jobs import (
    CONFIG,
    LONG,
    LOOPBACK,
    POLYSHARD,
    job_processes,
    kill_all,
    listening_addresses,
    start,
    training_started,
    wait_for,
    worker_pid,
)


@pytest.mark.system
def test_a_local_job_listens_on_loopback_only_and_dies_with_its_launcher(tmp_path):
    job = start(tmp_path, *LONG)
    try:
        wait_for(lambda: training_started(tmp_path), 120, "the first checkpoint")
        pids = job_processes(tmp_path)
        assert len(pids) == 4  # polyshard, torchrun's agent, two workers
        addresses = listening_addresses(pids)
        assert addresses and all(a.split(":")[0] in LOOPBACK for a in addresses), addresses
        job.kill()  # SIGKILL: the launcher gets no chance to clean up
        took = wait_for(lambda: not job_processes(tmp_path), 10, "every process of the job to end")
        print(f"all processes gone {took:.1f} s after the launcher was killed")
    finally:
        kill_all(tmp_path)
        job.communicate()


@pytest.mark.system
def test_ctrl_c_stops_every_process_and_keeps_the_checkpoints(tmp_path):
    from polyshard.checkpoint import open_checkpoint

    job = start(tmp_path, *LONG)
    try:
        wait_for(lambda: training_started(tmp_path), 120, "the first checkpoint")
        os.killpg(job.pid, signal.SIGINT)  # what a terminal sends on Ctrl-C
        _, err = job.communicate(timeout=20)
        assert job.returncode == 130
        assert not job_processes(tmp_path)
        latest = open_checkpoint(tmp_path / "checkpoints")  # the newest complete one verifies
        assert latest.step >= 2
        # One line, not torchrun's warnings: what is kept and the command that continues (same --out).
        command = ["polyshard", "train", str(CONFIG), *LONG, "--out", str(tmp_path), "--resume"]
        assert err.splitlines() == [
            f"interrupted: {latest.folder} is the last complete checkpoint; continue with: {shlex.join(command)}"
        ]
        resumed = subprocess.run([*POLYSHARD, *command[1:], "--dry-run"], capture_output=True, text=True, timeout=120)
        assert resumed.returncode == 0, resumed.stderr  # the line runs as printed: --resume finds the checkpoint
    finally:
        kill_all(tmp_path)


@pytest.mark.system
def test_a_stopped_rank_fails_the_job_naming_the_collective_group_and_rank(tmp_path):
    job = start(tmp_path, *LONG, "--set", "parallel.timeout_s=10")
    try:
        wait_for(lambda: training_started(tmp_path), 120, "the first checkpoint")
        os.kill(worker_pid(tmp_path, 1), signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = job.communicate(timeout=60)
        took = time.monotonic() - stopped
        assert took < 30, f"the job ended {took:.0f} s after the hang"
        assert job.returncode == 4, err
        report = next(line for line in err.splitlines() if line.startswith("communication failure"))
        assert "rank 0:" in report and "on the dp group (ranks [0, 1])" in report  # op, group and its ranks
        assert any(op in report for op in ("all_reduce on", "all_gather on", "barrier on", "broadcast on"))
        assert "No heartbeat from rank 1" in report and "timeout_s=10" in report
        assert_page_quotes("communication failure", report)  # the troubleshooting page's heading for it
        assert json.loads((tmp_path / "summary.json").read_text())["silent_ranks"] == [1]
        wait_for(lambda: not job_processes(tmp_path), 10, "every process of the job to end")
    finally:
        kill_all(tmp_path)
