"""Elastic world size: a job of two 2-process "nodes" (two torchrun agents, --nnodes=1:2,
parallel.dp='auto') loses one node mid-run. The surviving agent restarts its workers, which lay
themselves out again (dp 4 -> 2), resume from the latest complete checkpoint through the online
reshard path and keep the global batch (each data rank takes 8 examples instead of 4). The losses
equal an uninterrupted dp=4 run's: bitwise up to the checkpoint, within float32 summation-order
round-off after it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import pytest

from polyshard.cli.launch import free_port
from tests.reliability._jobs import CONFIG, POLYSHARD, kill_all, wait_for

JOB = [
    *("--set", "parallel.dp=auto", "--set", "training.steps=12", "--set", "eval.every=0"),
    *("--set", "eval.sample_tokens=0", "--set", "checkpoint.every=2", "--set", "checkpoint.keep=10"),
    *("--set", "parallel.timeout_s=20"),
]


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _descendants(pid: int) -> list[int]:
    children = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    parent = int(f.read().split(") ")[1].split()[1])
            except OSError:
                continue
            if parent == pid:
                children.append(int(entry.name))
    return children + [d for c in children for d in _descendants(c)]


@pytest.mark.system
def test_a_job_that_loses_a_node_continues_on_the_rest(tmp_path):
    whole = subprocess.run(
        [*POLYSHARD, "train", str(CONFIG), "--out", str(tmp_path / "whole"), "--nproc", "4", *JOB],
        capture_output=True,
        text=True,
    )
    assert whole.returncode == 0, whole.stderr
    out, port = tmp_path / "elastic", free_port()
    node = [
        *(POLYSHARD + ["train", str(CONFIG), "--out", str(out), "--nproc", "2", *JOB]),
        *("--torchrun=--nnodes=1:2", "--torchrun=--rdzv-backend=c10d", f"--torchrun=--rdzv-endpoint=127.0.0.1:{port}"),
        *("--torchrun=--rdzv-id=elastic", "--torchrun=--local-addr=127.0.0.1", "--torchrun=--max-restarts=3"),
        "--torchrun=--rdzv-conf=last_call_timeout=5",
    ]
    # The node at the rendezvous endpoint hosts the rendezvous store and must be the one that stays
    # (as on a cluster, where the endpoint is a stable host): start it first and let it bind.
    survivor = subprocess.Popen(node, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: _listening(port), 120, "the rendezvous endpoint")
    lost = subprocess.Popen(node, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (out / "checkpoints" / "step_00000004" / "index.json").exists(), 240, "step 4's checkpoint")
        for pid in [lost.pid, *_descendants(lost.pid)]:  # the node is gone at once, agent and workers
            os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        stdout, stderr = survivor.communicate(timeout=400)
        print(f"the surviving node finished {time.monotonic() - started:.0f} s after the other was lost")
    finally:
        kill_all(out)
        lost.communicate()
    assert survivor.returncode == 0, stderr
    assert "(2 processes, mesh {'pp': 1, 'dp': 2, 'ep': 1, 'cp': 1, 'tp': 1}): resuming" in stdout
    losses = [json.loads((o / "summary.json").read_text())["losses"] for o in (tmp_path / "whole", out)]
    assert len(losses[1]) == 12
    assert losses[1][:4] == losses[0][:4]  # the same dp=4 job up to the checkpoint
    # After it dp=2 sums the same 16 examples in another order: float32 round-off only.
    assert losses[1][4:] == pytest.approx(losses[0][4:], rel=1e-5)
