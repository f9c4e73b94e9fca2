"""A flight recorder: the last few communication calls this process posted, and what they mean
when one fails.

When a peer stops (a hung or dead rank), the call waiting for it times out with a backend message
such as "Timed out waiting 10000ms for recv operation to complete", which names no collective, group
or peer. Every wrapper in :mod:`polyshard.collectives` notes its call here (a deque append), so a
failure can be explained as "all_reduce on the dp group (ranks [0, 2]) failed".
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable

import torch.distributed as dist


class Posted:
    """One posted call. Its group is held weakly: the recorder outlives every group, and a process group
    kept alive past ``destroy_process_group`` keeps gloo's threads running into the interpreter's exit,
    which now and then aborts the process."""

    __slots__ = ("op", "peer", "_ref")

    def __init__(self, op: str, group: dist.ProcessGroup | None, peer: int | None = None):
        self.op, self.peer = op, peer  # peer: the other rank of a send or a receive
        self._ref = weakref.ref(group) if isinstance(group, dist.ProcessGroup) else None  # None: the world

    @property
    def group(self) -> dist.ProcessGroup | None:
        return None if self._ref is None else self._ref()

    @property
    def destroyed(self) -> bool:
        """Whether the group was freed since (``group`` is then None, which would read as the world)."""
        return self._ref is not None and self._ref() is None


RECENT: deque[Posted] = deque(maxlen=8)


def group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """Global ranks of ``group`` (the world when None)."""
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def note(op: str, group: dist.ProcessGroup | None, peer: int | None = None) -> None:
    RECENT.append(Posted(op, group, peer))


_C10D = "torch/distributed/distributed_c10d.py"
_SIGNS = ("timed out", "timeout", "connection closed by peer", "connection reset", "broken pipe")


def is_comm_failure(err: BaseException) -> bool:
    """Whether ``err`` came out of a torch.distributed call that failed on a peer (timeout, lost peer)."""
    if isinstance(err, dist.DistError):
        return True
    if not isinstance(err, RuntimeError):
        return False
    text = str(err).lower()
    # The message alone is not enough (any error may mention a timeout): it must have come out of a
    # torch.distributed call, directly or through a wait() on a handle one of ours posted.
    return any(sign in text for sign in _SIGNS) and (_failing_call(err) is not None or _waited_on_work(err))


def _waited_on_work(err: BaseException) -> bool:
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "wait" or "/polyshard/collectives/" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _failing_call(err: BaseException) -> Posted | None:
    """The torch.distributed function the exception passed through, with its group and peer."""
    tb, found = err.__traceback__, None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.replace("\\", "/").endswith(_C10D) and "group" in frame.f_locals:
            f = frame.f_locals
            peer = next((f[k] for k in ("src", "dst", "group_src", "group_dst") if f.get(k) is not None), None)
            found = Posted(frame.f_code.co_name, f.get("group"), peer if isinstance(peer, int) else None)
        tb = tb.tb_next
    return found


def describe_failure(err: BaseException, name_group: Callable[[dist.ProcessGroup | None], str] | None = None) -> str:
    """One paragraph: which call failed on which group (its name and ranks) and peer, from this rank's
    view, then the backend's own first line and this rank's last posted calls."""

    name_group = name_group or (lambda g: "world" if g is None or g is dist.group.WORLD else "group")

    def show(p: Posted) -> str:
        peer = f", peer rank {p.peer}" if p.peer is not None else ""
        if p.destroyed:
            return f"{p.op} on a group destroyed since{peer}"
        return f"{p.op} on the {name_group(p.group)} group (ranks {list(group_ranks(p.group))}{peer})"

    call = _failing_call(err)
    if call is None and RECENT:
        call = RECENT[-1]  # an asynchronous handle failed in wait(): the call posted last
    rank = dist.get_rank() if dist.is_initialized() else 0
    where = show(call) if call is not None else "a collective"
    backend = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    recent = "; ".join(show(p) for p in list(RECENT)[-4:])
    return f"rank {rank}: {where} failed: {backend}. This rank's last calls: {recent or 'none'}"
