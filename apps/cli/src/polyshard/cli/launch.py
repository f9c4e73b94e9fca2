"""Start N local worker processes through torchrun (``torch.distributed.run``).

torchrun is the same launcher that carries a job to many nodes; locally we
pin the rendezvous to 127.0.0.1 and one intra-op thread per worker so N
workers share the cores without oversubscribing them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, module: str, args: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "-m",
        module,
        *args,
    ]


def run_local(nproc: int, module: str, args: Sequence[str]) -> int:
    """Run ``python -m module args`` on ``nproc`` local ranks; return the exit code."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(torchrun_command(nproc, module, args), env=env)
