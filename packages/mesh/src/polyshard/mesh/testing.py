"""Test support: one live :class:`~polyshard.mesh.pool.WorkerPool` per world size, kept across tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polyshard.mesh.pool import WorkerFailure, WorkerPool

__all__ = ["PoolCache", "WorkerFailure", "WorkerPool"]


class PoolCache:
    """One live :class:`WorkerPool` per world size, restarted after a failure."""

    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def run(
        self, world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0, **kwargs: Any
    ) -> list[Any]:
        pool = self._pools.get(world_size)
        if pool is None or pool.closed:
            pool = self._pools[world_size] = WorkerPool(world_size)
        return pool.run(fn, *args, timeout_s=timeout_s, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
