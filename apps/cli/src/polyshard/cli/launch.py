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


def torchrun_command(nproc: int, module: str, args: Sequence[str], torchrun_args: Sequence[str] = ()) -> list[str]:
    """The torchrun command line; ``torchrun_args`` (e.g. --nnodes, --rdzv-endpoint) replace the local defaults."""
    given = {a.split("=")[0] for a in torchrun_args if a.startswith("--")}
    defaults = []
    if not given & {"--nnodes", "--rdzv-endpoint", "--rdzv_endpoint", "--master-addr", "--master_addr"}:
        # One node: rendezvous on loopback at a free port.
        defaults = ["--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *defaults,
        f"--nproc-per-node={nproc}",
        *torchrun_args,
        "-m",
        module,
        *args,
    ]


def run_local(nproc: int, module: str, args: Sequence[str], torchrun_args: Sequence[str] = ()) -> int:
    """Run ``python -m module args`` on ``nproc`` ranks of this node; return the exit code."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(torchrun_command(nproc, module, args, torchrun_args), env=env)
