"""How far a block of code raises this process's peak memory, on CUDA or on the CPU.

On CUDA: the allocator's peak during the block over what was allocated when it began. On the CPU: the
process's peak resident set (``ru_maxrss``) over its resident set when the block began; that peak is
the process's whole life's, so measure one block per process, before anything larger ran::

    with PeakGrowth(device) as peak:
        layer(x).sum().backward()
    print(peak.bytes)
"""

from __future__ import annotations

import resource
from types import TracebackType

import torch


def resident_bytes() -> int:
    """This process's resident set now (``/proc/self/statm``)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


class PeakGrowth:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.bytes = 0
        self._base = 0

    def __enter__(self) -> PeakGrowth:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            self._base = resident_bytes()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self._base
        else:
            self.bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self._base
