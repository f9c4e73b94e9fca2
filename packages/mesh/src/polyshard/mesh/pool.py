"""Run a function on N local processes (CPU, gloo), keeping the processes alive.

Starting a process and a gloo group costs seconds, so a :class:`WorkerPool`
starts its N workers once and then runs any number of functions on them::

    pool = WorkerPool(4)
    results = pool.run(check_all_reduce, 1024)   # one return value per rank
    pool.close()

The function must be importable by name (defined at module top level), and so
must its arguments and return value be picklable. Inside it,
``torch.distributed`` is initialised with the pool's world size.

Failures: if any rank raises, :meth:`WorkerPool.run` raises
:class:`WorkerFailure` with every failing rank's traceback. If a rank has not
answered within ``timeout_s`` (a hang, or peers stuck in a collective waiting
for a rank that died), the pool is killed and the call fails instead of
hanging. A pool that failed is closed (:class:`polyshard.mesh.testing.PoolCache`
starts a new one on the next call). Rendezvous uses 127.0.0.1 only.

Production code uses it too: the planner's calibration and ``polyshard bench plan`` measure
on live pools.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, cast

_STARTUP_TIMEOUT_S = 120.0
# After one rank fails, how long the others get to finish or fail on their own
# before the pool is killed (they may be blocked in a collective with it).
_FAILURE_GRACE_S = 5.0


class WorkerFailure(AssertionError):
    """One or more ranks raised, died or hung; the message holds their tracebacks."""


def _worker_main(rank: int, world_size: int, conn: Connection, port_conn: Connection | None) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from polyshard.mesh.init import init_distributed

    # Two cores are shared by every rank: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1", 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
        )
        assert port_conn is not None  # rank 0 is always given the port pipe
        port_conn.send(store.port)
        port_conn.close()
    else:
        port = conn.recv()
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=datetime.timedelta(seconds=60))
    init_distributed(backend="gloo", store=store, rank=rank, world_size=world_size, timeout_s=120)
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:
            break
        try:
            task = pickle.loads(message)
            if task is None:
                break
            fn, args, kwargs = task
            reply = ("ok", fn(*args, **kwargs))
        except BaseException:  # report everything, including assertion errors, to the parent
            reply = ("error", traceback.format_exc())
        finally:
            _destroy_subgroups()
        try:
            conn.send(reply)
        except Exception:
            conn.send(("error", "result could not be pickled:\n" + traceback.format_exc()))
    dist.destroy_process_group()


def _destroy_subgroups() -> None:
    """Free the groups a task created (meshes, new_group) so they do not pile up."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    world = dist.group.WORLD
    for group in list(c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)


class WorkerPool:
    """``world_size`` live worker processes with an initialised gloo group."""

    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.closed = False
        ctx = mp.get_context("spawn")
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        port_recv, port_send = ctx.Pipe(duplex=False)
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            args = (rank, world_size, child, port_send if rank == 0 else None)
            proc = ctx.Process(target=_worker_main, args=args, daemon=True, name=f"polyshard-rank{rank}")
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
            if rank == 0:
                port_send.close()
                if not port_recv.poll(_STARTUP_TIMEOUT_S):
                    self.close()
                    raise WorkerFailure("rank 0 did not open its rendezvous store in time")
                port = port_recv.recv()
            else:
                parent.send(port)
        for rank, conn in enumerate(self._conns):
            if not conn.poll(_STARTUP_TIMEOUT_S):
                self.close()
                raise WorkerFailure(f"rank {rank} did not join the process group in {_STARTUP_TIMEOUT_S}s")
            conn.recv()

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results."""
        if self.closed:
            raise WorkerFailure("this pool was closed after an earlier failure")
        payload = pickle.dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(payload)
        results: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout_s
        first_error = 0.0
        while pending:
            limit = deadline if not errors else min(deadline, first_error + _FAILURE_GRACE_S)
            ready = wait([self._conns[r] for r in pending], timeout=max(0.0, limit - time.monotonic()))
            if not ready:
                break
            for rank in [self._conns.index(cast(Connection, c)) for c in ready]:  # wait() returns what it got
                conn = self._conns[rank]
                pending.discard(rank)
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    status, value = "error", f"rank {rank} died (exit code {self._procs[rank].exitcode})"
                if status == "ok":
                    results[rank] = value
                else:
                    if not errors:
                        first_error = time.monotonic()
                    errors[rank] = value
        if errors or pending:
            self.close()
            parts = [f"--- rank {r} raised ---\n{tb}" for r, tb in sorted(errors.items())]
            if pending:
                why = "after another rank failed" if errors else f"within {timeout_s}s"
                parts.append(f"--- ranks {sorted(pending)} did not finish {why}; the pool was killed ---")
            raise WorkerFailure(
                f"{getattr(fn, '__name__', fn)} failed on {self.world_size} ranks:\n" + "\n".join(parts)
            )
        return results

    def close(self) -> None:
        """Stop the workers (politely if they are idle, by force otherwise)."""
        if self.closed:
            return
        self.closed = True
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 3.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
