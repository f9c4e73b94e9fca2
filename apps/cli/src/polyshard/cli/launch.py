"""Start N local worker processes through torchrun (``torch.distributed.run``).

torchrun is the same launcher that carries a job to many nodes; locally we
pin the rendezvous to 127.0.0.1 (listening on loopback only, see ``agent.py``)
and one intra-op thread per worker so N workers share the cores without
oversubscribing them. Ctrl-C stops the agent and every worker; this process
waits for them, so none outlives the command.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Sequence


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def torchrun_command(nproc: int, module: str, args: Sequence[str], torchrun_args: Sequence[str] = ()) -> list[str]:
    """The torchrun command line; ``torchrun_args`` (e.g. --nnodes, --rdzv-endpoint) replace the local defaults."""
    given = {a.split("=")[0] for a in torchrun_args if a.startswith("--")}
    defaults = []
    if not given & {"--nnodes", "--rdzv-endpoint", "--rdzv_endpoint", "--master-addr", "--master_addr"}:
        # One node: rendezvous on loopback at a free port.
        defaults = ["--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    if not given & {"--rdzv-id", "--rdzv_id"}:
        # A job id of its own: checkpoints record it, and only a restart of this job resumes by itself.
        defaults.append(f"--rdzv-id={uuid.uuid4().hex}")
    return [
        sys.executable,
        "-m",
        "polyshard.cli.agent",
        *defaults,
        f"--nproc-per-node={nproc}",
        *torchrun_args,
        "-m",
        module,
        *args,
    ]


def run_local(
    nproc: int,
    module: str,
    args: Sequence[str],
    torchrun_args: Sequence[str] = (),
    interrupted: Callable[[], str] | None = None,
) -> int:
    """Run ``python -m module args`` on ``nproc`` ranks of this node; return the exit code. After Ctrl-C,
    once every process has stopped, the one line ``interrupted()`` gives is printed (what is kept, how
    to continue), or a plain one."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    agent = subprocess.Popen(torchrun_command(nproc, module, args, torchrun_args), env=env)
    try:
        code = agent.wait()
    except KeyboardInterrupt:  # the terminal sent SIGINT to the agent and the workers too
        try:
            agent.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            agent.kill()  # its workers die with it (parent-death signal)
            agent.wait()
        code = INTERRUPTED
    if code in (INTERRUPTED, -signal.SIGINT):  # also when the agent ended before our own handler ran
        line = interrupted() if interrupted is not None else "interrupted: every process stopped"
        print(line, file=sys.stderr)
        return INTERRUPTED
    return code


INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


# How long the agent gets to stop its workers after Ctrl-C before it is killed.
STOP_GRACE_S = 10
