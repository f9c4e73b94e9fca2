"""Two torchrun agents on one machine stand for two nodes (c10d rendezvous on 127.0.0.1, each node
started by its own `polyshard train`, as the README and apps/slurm/train.sbatch do it). The dp2 x tp2
job they run together has the losses of the same job under one agent, bit for bit: the ranks, groups
and data are the same; only the launch differs."""

from __future__ import annotations

import json
import subprocess

import pytest

from polyshard.cli.launch import free_port
from tests.reliability._jobs import POLYSHARD, ROOT, job_processes, listening_addresses, wait_for

CONFIG = ROOT / "apps/configs/gpt-tiny-tp.toml"
JOB = [
    *("--set", "parallel.dp=2", "--set", "parallel.tp=2", "--set", "training.steps=4"),
    *("--set", "eval.every=0", "--set", "eval.sample_tokens=0"),
]


@pytest.mark.system
def test_two_agents_as_two_nodes_train_like_one(tmp_path):
    single = subprocess.run(
        [*POLYSHARD, "train", str(CONFIG), "--out", str(tmp_path / "one"), *JOB], capture_output=True, text=True
    )
    assert single.returncode == 0, single.stderr
    port, out = free_port(), tmp_path / "two"
    node = [
        *(POLYSHARD + ["train", str(CONFIG), "--out", str(out), "--nproc", "2", *JOB]),
        *("--torchrun=--nnodes=2", "--torchrun=--rdzv-backend=c10d", f"--torchrun=--rdzv-endpoint=127.0.0.1:{port}"),
        *("--torchrun=--rdzv-id=two-nodes", "--torchrun=--local-addr=127.0.0.1"),
    ]
    agents = [subprocess.Popen(node, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    wait_for(lambda: len(job_processes(out)) == 8 or any(a.poll() is not None for a in agents), 120, "8 processes")
    addresses = listening_addresses(job_processes(out))
    assert all(a.startswith("0100007F:") for a in addresses), addresses  # the rendezvous binds where it was told
    for agent in agents:
        _, err = agent.communicate(timeout=300)
        assert agent.returncode == 0, err
    losses = [json.loads((o / "summary.json").read_text())["losses"] for o in (tmp_path / "one", out)]
    assert losses[0] == losses[1] and len(losses[0]) == 4
