"""Start ``torch.distributed`` from torchrun's environment or an explicit store."""

from __future__ import annotations

import datetime
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from polyshard.mesh.errors import DistributedInitError, MeshError


@dataclass(frozen=True)
class DistributedContext:
    """What :func:`init_distributed` started: this process's rank, the world and its device."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError as err:
        raise DistributedInitError(f"environment variable {name}={value!r} is not an integer") from err


def default_backend() -> str:
    """NCCL when CUDA devices are present, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_distributed(
    *,
    backend: str | None = None,
    store: dist.Store | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    mesh_axes: Mapping[str, int] | None = None,
    timeout_s: float = 600.0,
) -> DistributedContext:
    """Initialise the default process group once and return the context.

    Without ``store`` it reads torchrun's variables (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT). With ``store`` the caller gives
    ``rank`` and ``world_size`` too. ``mesh_axes``, when given, is checked
    against the world size *before* any process group is created.
    ``timeout_s`` bounds every collective, so a lost peer fails instead of
    hanging forever.
    """
    rank = rank if rank is not None else _env_int("RANK")
    world_size = world_size if world_size is not None else _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK")
    if rank is None or world_size is None:
        raise DistributedInitError(
            "no rank/world size: launch with torchrun (which sets RANK and WORLD_SIZE) "
            "or pass rank=, world_size= and store="
        )
    if mesh_axes is not None and math.prod(mesh_axes.values()) != world_size:
        raise MeshError(
            f"mesh {dict(mesh_axes)} has {math.prod(mesh_axes.values())} ranks but the job has "
            f"{world_size} processes; choose axis sizes whose product is {world_size}"
        )
    backend = backend or default_backend()
    if local_rank is None:
        local_rank = rank % max(torch.cuda.device_count(), 1) if backend == "nccl" else 0
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise DistributedInitError(
                f"torch.distributed is already running as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {rank} of {world_size}"
            )
        return DistributedContext(rank, world_size, local_rank, dist.get_backend(), device)

    if store is None and ("MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ):
        raise DistributedInitError("MASTER_ADDR and MASTER_PORT must be set (torchrun sets them) or pass store=")
    if store is None and "TORCHELASTIC_RUN_ID" in os.environ:
        store = _torchrun_store(rank, world_size, timeout_s)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if backend == "nccl" else None,
    )
    return DistributedContext(rank, world_size, local_rank, backend, device)


LOOPBACK = ("127.0.0.1", "localhost")


def tcp_store(
    host_name: str,
    port: int,
    world_size: int | None = None,
    is_master: bool = False,
    timeout: datetime.timedelta = datetime.timedelta(seconds=300),
    wait_for_workers: bool = True,
    multi_tenant: bool = False,
    master_listen_fd: int | None = None,
    use_libuv: bool = True,
) -> dist.TCPStore:
    """``dist.TCPStore`` with the same arguments, except that a server for a loopback address listens
    on loopback only (torch's server listens on every network interface whatever the address)."""
    if is_master and master_listen_fd is None and host_name in LOOPBACK:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("127.0.0.1", port))
        except OSError as err:  # another process hosts it; the caller may join as a client
            listener.close()
            raise RuntimeError(f"127.0.0.1:{port} is taken: {err}") from err
        listener.listen(1024)
        master_listen_fd = listener.detach()  # the store owns the socket from here on
    return dist.TCPStore(
        host_name, port, world_size, is_master, timeout, wait_for_workers, multi_tenant, master_listen_fd, use_libuv
    )


def _torchrun_store(rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """The store a torchrun worker group meets in.

    With one agent (the static one-node rendezvous) the agent hosts it, and a restarted worker group
    (``--max-restarts``) meets in the same store, which still holds the old workers' addresses: its
    keys go under a prefix per attempt (the agent counts attempts in TORCHELASTIC_RESTART_COUNT for
    all its workers alike). Otherwise rank 0 hosts a new one each round (polyshard's agent asks torch
    for that), bound to loopback when the address is loopback.
    """
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = tcp_store(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not agent_hosts,
        timeout=datetime.timedelta(seconds=timeout_s),
        multi_tenant=True,
    )
    if not agent_hosts:
        return store
    return dist.PrefixStore(f"polyshard/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
