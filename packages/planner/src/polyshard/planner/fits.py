"""Before launch: does the job fit in this machine's memory?

The planner's estimate for the heaviest rank (:func:`polyshard.planner.search.memory_of`: model states
to the byte, activations counted from what each block saves) is compared with what the ranks of this
node can use: on GPUs each rank has a device of its own, so one rank's estimate is set against the
smallest device's memory; on CPU the node's ranks share the host, so their sum is set against its
physical memory, and each process's own overhead (:data:`WORKER_OVERHEAD`) with them. A job that cannot
fit is refused with both figures and the fix, before a process starts: allocating until the machine fails
is the slow way to learn it.

The process count is held against the machine too (:func:`check_processes`): its cores and its memory,
whatever the model, for ``polyshard train`` and every benchmark that starts processes.
"""

from __future__ import annotations

import os

from polyshard.planner.search import memory_of
from polyshard.trainer.config import Config
from polyshard.trainer.errors import ConfigError

WORKER_OVERHEAD = 320 << 20
"""Bytes one worker process holds before any model: the interpreter, torch, polyshard and a gloo group.
Measured: a bare training worker (``import polyshard.trainer.runtime.worker``, one gloo all-reduce) holds
313 MB resident (224 MB of it its own, the rest shared library pages), torch 2.13 on CPU; issue 46 saw
64 workers take 12 GB. Counted once per rank, on top of the planner's estimate."""
PROCESSES_PER_CORE = 8
"""More processes than this many per core are refused: the test suite and ``make demo`` run 8 ranks on
2 cores (4 per core) and still finish, slowly (a 4 KB all-reduce takes ~30 ms there); at 8 per core each
rank gets an eighth of a core and gloo's timeouts and startup (~1.5 s per rank) dominate, so a larger count
is a typo or a plan for another machine (--dry-run shows it; --force launches it anyway)."""
ANYWHERE = float(4 << 40)  # bytes one rank could have on any machine: 4 TiB, a large host's whole memory
FIXES = (
    "--set training.global_batch_size=..., --set parallel.zero_stage=3, "
    "--set training.activation_checkpointing=full, or a smaller model"
)


def machine_memory() -> tuple[float, str, bool]:
    """(bytes, what they are, shared by the node's ranks): the smallest GPU's memory when torch sees
    GPUs, else the host's physical memory."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count():
        smallest = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
        return float(smallest), "device memory per GPU", False
    return host_memory(), "host memory", True  # inf when the system gives no figure: nothing to compare


def check_fits(
    config: Config, nproc: int, memory: tuple[float, str, bool] | None = None, anywhere: bool = False
) -> float:
    """The estimate per rank; a :class:`ConfigError` with the estimate and the fix when the ``nproc`` ranks
    of this node cannot hold it. ``memory``: :func:`machine_memory`'s answer (given by tests). With
    ``anywhere``, the machine is the largest there is (:data:`ANYWHERE` per rank): a plan for a cluster
    passes, a size no machine holds does not."""
    available, what, shared = (ANYWHERE, "", False) if anywhere else memory if memory is not None else machine_memory()
    per_rank = memory_of(config).total
    need = (per_rank + WORKER_OVERHEAD) * nproc if shared else per_rank
    if need > available:
        than = f"this machine's {available / 2**30:,.1f} GiB of {what}"
        if anywhere:
            than = f"the {available / 2**30:,.0f} GiB one rank may have on any machine"
        own = ""
        if shared:  # the processes' own memory shares the host with the model's
            own = f" + {WORKER_OVERHEAD / 2**30:.1f} GiB the worker process holds itself"
        ranks = f" x {nproc} ranks = {need / 2**30:,.1f} GiB" if shared and nproc > 1 else ""
        raise ConfigError(
            f"the job needs about {per_rank / 2**30:,.1f} GiB per rank (the planner's estimate, as --dry-run "
            f"prints it{own}){ranks}, more than {than}; make it smaller ({FIXES}), or pass --force to launch anyway"
        )
    return per_rank


def host_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or taskset's share), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this system (macOS)
        return os.cpu_count() or 1


def host_memory() -> float:
    """The host's physical memory in bytes (inf when the system gives no figure)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return float("inf")


def check_processes(nproc: int, cores: int | None = None, memory: float | None = None, flag: str = "--nproc") -> None:
    """A :class:`ConfigError` naming this machine's cores and memory when it cannot hold ``nproc`` processes:
    more than :data:`PROCESSES_PER_CORE` per core, or more than its memory holds of their own overhead
    (:data:`WORKER_OVERHEAD` each, before any model). ``cores``, ``memory``: given by tests; ``flag``: the
    option that gave the count, for the message."""
    cores = host_cores() if cores is None else cores
    memory = host_memory() if memory is None else memory
    overhead = nproc * WORKER_OVERHEAD
    if nproc <= PROCESSES_PER_CORE * cores and overhead <= memory:
        return
    most = max(1, min(PROCESSES_PER_CORE * cores, int(memory // WORKER_OVERHEAD)))
    why = (
        f"more than {PROCESSES_PER_CORE} per core"
        if nproc > PROCESSES_PER_CORE * cores
        else f"their own ~{WORKER_OVERHEAD / 2**30:.1f} GiB each, {overhead / 2**30:,.1f} GiB before any model, "
        "is more than the memory"
    )
    raise ConfigError(
        f"{flag} {nproc}: this machine has {cores} cores and {memory / 2**30:,.1f} GiB of memory, too little for "
        f"{nproc} processes ({why}); give {flag} {most} or fewer, or pass --force to start them anyway"
    )
