"""Before launch: does the job fit in this machine's memory?

The planner's estimate for the heaviest rank (:func:`polyshard.planner.search.memory_of`: model states
to the byte, activations counted from what each block saves) is compared with what the ranks of this
node can use: on GPUs each rank has a device of its own, so one rank's estimate is set against the
smallest device's memory; on CPU the node's ranks share the host, so their sum is set against its
physical memory. A job that cannot fit is refused with both figures and the fix, before a process
starts: allocating until the machine fails is the slow way to learn it.
"""

from __future__ import annotations

import os

from polyshard.planner.search import memory_of
from polyshard.trainer.config import Config
from polyshard.trainer.errors import ConfigError

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
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "host memory", True
    except (ValueError, OSError, AttributeError):  # no figure on this system: nothing to compare with
        return float("inf"), "host memory", True


def check_fits(
    config: Config, nproc: int, memory: tuple[float, str, bool] | None = None, anywhere: bool = False
) -> float:
    """The estimate per rank; a :class:`ConfigError` with the estimate and the fix when the ``nproc`` ranks
    of this node cannot hold it. ``memory``: :func:`machine_memory`'s answer (given by tests). With
    ``anywhere``, the machine is the largest there is (:data:`ANYWHERE` per rank): a plan for a cluster
    passes, a size no machine holds does not."""
    available, what, shared = (ANYWHERE, "", False) if anywhere else memory if memory is not None else machine_memory()
    per_rank = memory_of(config).total
    need = per_rank * nproc if shared else per_rank
    if need > available:
        than = f"this machine's {available / 2**30:,.1f} GiB of {what}"
        if anywhere:
            than = f"the {available / 2**30:,.0f} GiB one rank may have on any machine"
        ranks = f" x {nproc} ranks = {need / 2**30:,.1f} GiB" if shared and nproc > 1 else ""
        raise ConfigError(
            f"the job needs about {per_rank / 2**30:,.1f} GiB per rank{ranks} (the planner's estimate, as "
            f"--dry-run prints it), more than {than}; make it "
            f"smaller ({FIXES}), or pass --force to launch anyway"
        )
    return per_rank
