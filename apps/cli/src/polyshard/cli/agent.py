"""torchrun's agent (``torch.distributed.run``) with two guards a job needs.

- **Loopback only.** torch's rendezvous store listens on every network interface, even when the
  rendezvous address is 127.0.0.1. When the address given is loopback we hand the store a socket
  bound to 127.0.0.1, so a local run accepts no connection from the network. Multi-node runs
  bind as torchrun does, where the user's ``--rdzv-endpoint`` / ``--master-addr`` says.
- **No orphans.** The agent dies with the ``polyshard`` process that started it; torchrun then
  stops its workers, and each worker also dies with the agent (see ``polyshard.trainer.lifetime``).
  A worker stopped with SIGSTOP is woken so that it dies too.

A failed worker group is summarised in one line (which rank failed first, its exit code); the
workers print their own errors. The exit code is the first failed worker's.

Run as ``python -m polyshard.cli.agent <torchrun options> -m module args``.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from polyshard.trainer.lifetime import die_with_parent

LOOPBACK = ("127.0.0.1", "localhost")


def loopback_tcp_store(
    host_name: str,
    port: int,
    world_size: int | None = None,
    is_master: bool = False,
    timeout: timedelta = timedelta(seconds=300),
    wait_for_workers: bool = True,
    multi_tenant: bool = False,
    master_listen_fd: int | None = None,
    use_libuv: bool = True,
) -> dist.TCPStore:
    """``dist.TCPStore`` with the same arguments; a server for a loopback address listens on loopback only."""
    if is_master and master_listen_fd is None and host_name in LOOPBACK:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("127.0.0.1", port))
        except OSError as err:  # another agent on this machine hosts it: torch then joins as a client
            listener.close()
            raise RuntimeError(f"127.0.0.1:{port} is taken: {err}") from err
        listener.listen(1024)
        master_listen_fd = listener.detach()  # the store owns the socket from here on
    return dist.TCPStore(
        host_name, port, world_size, is_master, timeout, wait_for_workers, multi_tenant, master_listen_fd, use_libuv
    )


def _wake_then_close(close):
    """A worker stopped with SIGSTOP holds the death signal pending forever and torchrun waits 30 s
    before SIGKILL; SIGCONT after the signal lets it die at once."""

    def wrapped(self, death_sig=None):
        close(self, death_sig)
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass

    return wrapped


def main() -> None:
    die_with_parent()
    # The two rendezvous backends a polyshard job uses (static for one node, c10d for several) build
    # their store through these module attributes.
    static_tcp_rendezvous.TCPStore = loopback_tcp_store
    c10d_rendezvous_backend.TCPStore = loopback_tcp_store
    # The c10d backend's node 0 also serves the workers' store, at --local-addr (127.0.0.1 for two
    # "nodes" on one machine): loopback only there too.
    DynamicRendezvousHandler._create_tcp_store_server = lambda self, addr, port: loopback_tcp_store(
        addr, port, is_master=True, multi_tenant=True
    )
    if hasattr(signal, "SIGCONT"):
        SubprocessHandler.close = _wake_then_close(SubprocessHandler.close)
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(sys.argv[1:]))
    except SignalException as stop:  # torchrun stopped its workers before raising this
        print(f"torchrun agent: {stop}; its workers are stopped", file=sys.stderr)
        raise SystemExit(128 + int(stop.sigval)) from None
    except ChildFailedError as failed:  # the workers printed their own errors; summarise, keep the code
        rank, first = failed.get_first_failure()
        others = sorted(set(failed.failures) - {rank})
        more = f" (then {len(others)} more: ranks {others})" if others else ""
        print(f"torchrun agent: rank {rank} failed first, exit code {first.exitcode}{more}", file=sys.stderr)
        raise SystemExit(first.exitcode if first.exitcode > 0 else 1) from None


if __name__ == "__main__":
    main()
