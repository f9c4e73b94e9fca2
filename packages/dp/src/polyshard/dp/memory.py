"""Bytes a rank holds for parameters, gradients and optimizer state, counted from live storages.

The ZeRO paper's accounting (1910.02054, section 3.1) for Ψ parameters on N
ranks with mixed-precision Adam (bf16 params and grads, fp32 master, m, v):

    plain DP  2Ψ + 2Ψ + 12Ψ        = 16Ψ
    stage 1   2Ψ + 2Ψ + 12Ψ/N      = 4Ψ + 12Ψ/N
    stage 2   2Ψ + 2Ψ/N + 12Ψ/N    = 2Ψ + 14Ψ/N
    stage 3   2Ψ/N + 2Ψ/N + 12Ψ/N  = 16Ψ/N

In fp32 (no mixed precision) parameters and gradients take 4 bytes and the
optimizer state K = 8 (m, v): the parameters are their own masters, so
stage 1 is 8Ψ + 8Ψ/N (12Ψ at N = 2, as ``ZeroRedundancyOptimizer``), stage 2
4Ψ + 12Ψ/N, stage 3 16Ψ/N. Beyond the formulas a rank holds only ZeRO's
padding (dim 0 padded to a multiple of N), one presence flag per parameter
in each gradient row, and AdamW's scalar ``step`` per parameter
(``tests/dp/test_memory_and_ledger.py`` pins each byte).

Hybrid sharding (a ``replicate_group``, FSDP2's HSDP): N above is the shard
group's size, not the number of data ranks. With dp = R x N ranks (R copies
of each shard) a rank holds exactly what ZeRO on N ranks holds, e.g. fp32
stage 3 16Ψ/N rather than 16Ψ/(RN): sharding over fewer ranks costs memory
and keeps the reduce-scatter and gathers inside the (fast) shard group; only
each rank's 1/N of the gradients crosses to the other copies, in one
all-reduce (``tests/dp/test_hybrid.py`` pins bytes and ledger).

:func:`bytes_held` measures instead of computing: it sums the sizes of the
distinct storages behind the tensors, so views (gradients that live inside a
bucket) are counted once and freed storages (ZeRO-3 parameters between uses)
count zero.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from polyshard.dp.wrapper import DataParallelWrapper

if TYPE_CHECKING:
    from polyshard.dp.zero_optimizer import ZeroOptimizer


@dataclass(frozen=True)
class MemoryReport:
    params: int
    grads: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_state


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors`` not already in ``seen`` (data pointers; updated)."""
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def bytes_held(model: DataParallelWrapper, optimizer: torch.optim.Optimizer | ZeroOptimizer) -> MemoryReport:
    """Measure ``model`` (a polyshard.dp wrapper) and ``optimizer`` (a ZeroOptimizer or torch optimizer)."""
    held = model.memory_tensors()
    seen: set[int] = set()
    params = storage_bytes(held["params"], seen)
    grads = storage_bytes(held["grads"], seen)
    inner = cast(torch.optim.Optimizer, getattr(optimizer, "optimizer", optimizer))  # a ZeroOptimizer's inner one
    return MemoryReport(params, grads, storage_bytes(_optimizer_tensors(inner), seen))
