"""torchrun's agent (``torch.distributed.run``) with two guards a job needs.

- **Loopback only.** torch's rendezvous store listens on every network interface, even when the
  rendezvous address is 127.0.0.1. When the address given is loopback the store gets a socket
  bound to 127.0.0.1 (``polyshard.mesh.init.tcp_store``; the workers' own store too), so a local
  run accepts no connection from the network. Multi-node runs bind as torchrun does, where the
  user's ``--rdzv-endpoint`` / ``--master-addr`` / ``--local-addr`` say.
- **No orphans.** The agent dies with the ``polyshard`` process that started it; torchrun then
  stops its workers, and each worker also dies with the agent (see ``polyshard.trainer.runtime.lifetime``).
  A worker stopped with SIGSTOP is woken so that it dies too.

A failed worker group is summarised in one line (which rank failed first, its exit code); the
workers print their own errors. The exit code is the first failed worker's (128 + n when signal n
killed it).

Run as ``python -m polyshard.cli.agent <torchrun options> -m module args``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable

from torch.distributed.elastic.multiprocessing.api import SignalException, SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from polyshard.mesh.init import tcp_store
from polyshard.trainer import die_with_parent


def _wake_then_close(close: Callable[..., None]) -> Callable[..., None]:
    """A worker stopped with SIGSTOP holds the death signal pending forever and torchrun waits 30 s
    before SIGKILL; SIGCONT after the signal lets it die at once."""

    def wrapped(self: SubprocessHandler, death_sig: signal.Signals | None = None) -> None:
        close(self, death_sig)
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass

    return wrapped


def main() -> None:
    die_with_parent()
    # torch's c10d rendezvous shares one worker store across rounds, so workers restarted after a
    # failure or a change of nodes would read the previous round's addresses; a store per round avoids
    # that (the static one-node rendezvous is handled by a per-attempt prefix, see polyshard.mesh.init).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # The two rendezvous backends a polyshard job uses (static for one node, c10d for several) build
    # their store through these module attributes.
    # (torch's stubs type the attribute as the TCPStore class; our factory takes the same arguments)
    static_tcp_rendezvous.TCPStore = tcp_store  # type: ignore[attr-defined,assignment]
    c10d_rendezvous_backend.TCPStore = tcp_store  # type: ignore[attr-defined,assignment]
    # The c10d backend's node 0 also serves the workers' store, at --local-addr (127.0.0.1 for two
    # "nodes" on one machine): loopback only there too.
    # Patching torch's methods is the point here: mypy sees assignments to methods.
    DynamicRendezvousHandler._create_tcp_store_server = lambda self, addr, port: tcp_store(  # type: ignore[method-assign,assignment]
        addr, port, is_master=True, multi_tenant=True
    )
    SubprocessContext._close = _noting_user_errors(SubprocessContext._close)  # type: ignore[method-assign]
    if hasattr(signal, "SIGCONT"):
        SubprocessHandler.close = _wake_then_close(SubprocessHandler.close)  # type: ignore[method-assign]
    from torch.distributed.run import parse_args, run

    # torchrun keeps its log folders (torchelastic_*) in the temp folder and never deletes them; the agent
    # alone gets a private temp folder, deleted when it ends (the workers keep the usual one: caches).
    scratch = tempfile.mkdtemp(prefix="polyshard-agent-")
    tempfile.tempdir = scratch
    # The failure of a worker that reported a user error (exit 2) is that worker's one line: torchrun's
    # own error record and our summary would repeat it.
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith("torch.distributed.elastic") and isinstance(logger, logging.Logger):
            logger.addFilter(_not_a_user_error)
            logger.addFilter(_not_ctrl_c)
    try:
        _run(run, parse_args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _noting_user_errors(close: Callable[..., None]) -> Callable[..., None]:
    """torchrun stops the other workers (logging each) before it logs the failure that made it: note a
    user error first, so that :func:`_not_a_user_error` drops those records too."""

    def wrapped(self: SubprocessContext, *args: object, **kwargs: object) -> None:
        failures = getattr(self, "_failures", {})
        if any(f.exitcode == USER_ERROR for f in failures.values()):
            _user_error_seen[0] = True
        close(self, *args, **kwargs)

    return wrapped


def _not_a_user_error(record: logging.LogRecord) -> bool:
    """False for torchrun's records of a worker that exited with :data:`USER_ERROR` (its own line said why)
    and of the stopping of the other workers that follows."""
    text = record.getMessage()
    if f"(exitcode: {USER_ERROR})" in text:
        _user_error_seen[0] = True
        return False
    return not (_user_error_seen[0] and "closing signal" in text)


def _not_ctrl_c(record: logging.LogRecord) -> bool:
    """False for torchrun's warnings as Ctrl-C stops the workers: the launcher's one line says it, and
    says how to continue (``polyshard.cli.launch``)."""
    text = record.getMessage()
    return not (text.endswith("closing signal SIGINT") or any(f"Received {n} death signal" in text for n in _SIGINT))


_SIGINT = ("2", "SIGINT", "Signals.SIGINT")  # how torch versions print the signal in that warning


USER_ERROR = 2  # a worker's exit code for a mistake it reported in one line (polyshard.trainer.runtime.worker)
_user_error_seen = [False]


def _run(run: Callable[..., None], parse_args: Callable[..., object]) -> None:
    try:
        run(parse_args(sys.argv[1:]))
    except SignalException as stop:  # torchrun stopped its workers before raising this
        if stop.sigval == signal.SIGINT:  # Ctrl-C: the launcher prints the one line
            raise SystemExit(128 + int(stop.sigval)) from None
        print(f"torchrun agent: {stop}; its workers are stopped", file=sys.stderr)
        raise SystemExit(128 + int(stop.sigval)) from None
    except ChildFailedError as failed:  # the workers printed their own errors; summarise, keep the code
        rank, first = failed.get_first_failure()
        if first.exitcode == USER_ERROR:  # the worker printed the one line that says what to fix
            raise SystemExit(USER_ERROR) from None
        others = sorted(set(failed.failures) - {rank})
        more = f" (then {len(others)} more: ranks {others})" if others else ""
        print(f"torchrun agent: rank {rank} failed first, exit code {first.exitcode}{more}", file=sys.stderr)
        code = first.exitcode if first.exitcode > 0 else 128 - first.exitcode  # killed by signal n: 128 + n
        raise SystemExit(code) from None


if __name__ == "__main__":
    main()
