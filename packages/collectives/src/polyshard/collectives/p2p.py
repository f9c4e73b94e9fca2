"""Point-to-point helpers for pipelines.

Peers are *global* ranks (as ``torch.distributed`` expects); ``group`` only
selects the communicator.

* :func:`send` / :func:`recv`: a tensor whose shape and dtype both sides know.
* :func:`send_with_meta` / :func:`recv_with_meta`: the sender first sends a
  small header (dtype and shape) so the receiver can allocate the buffer.
* :func:`exchange`: any mix of sends and receives posted together with
  ``batch_isend_irecv``. Two neighbours that each send to and receive from
  the other at once cannot deadlock, because no operation waits before all
  are posted; a pipeline may leave the sends in flight (``wait_sends=False``).
* :func:`post_exchange`: the same, but nothing is waited for: the caller
  computes while the transfers run and calls ``wait()`` on the returned
  :class:`PendingExchange` when it needs the received buffers (ring attention
  posts the next key/value block before computing on the current one).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from polyshard.collectives.errors import CollectiveError
from polyshard.collectives.ledger import record

MAX_DIMS = 8
DTYPES = [  # what a shape header can announce (pipelines reuse the table)
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> None:
    record("send", group, _nbytes(tensor), peer=dst)
    dist.send(tensor.contiguous(), dst=dst, group=group)


def recv(buffer: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Receive into ``buffer`` (whose shape and dtype the sender agreed to) and return it."""
    record("recv", group, _nbytes(buffer), wire_bytes=0.0, peer=src)
    dist.recv(buffer, src=src, group=group)
    return buffer


HEADER_NUMEL = 2 + MAX_DIMS
"""Elements of the int64 header that carries a tensor's dtype and shape ahead of it."""


def header_of(tensor: torch.Tensor) -> torch.Tensor:
    """The header announcing ``tensor``'s dtype and shape (on its device), for :func:`buffer_for`."""
    if tensor.dim() > MAX_DIMS:
        raise CollectiveError(f"send_with_meta supports up to {MAX_DIMS} dims, got {tensor.dim()}")
    if tensor.dtype not in DTYPES:
        raise CollectiveError(f"send_with_meta cannot send dtype {tensor.dtype}; supported: {DTYPES}")
    header = torch.zeros(HEADER_NUMEL, dtype=torch.int64)
    header[0] = DTYPES.index(tensor.dtype)
    header[1] = tensor.dim()
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header.to(tensor.device)


def buffer_for(header: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """An empty tensor of the dtype and shape a received :func:`header_of` announces."""
    values = header.tolist()
    dtype, ndim = DTYPES[values[0]], values[1]
    return torch.empty(values[2 : 2 + ndim], dtype=dtype, device=device)


def send_with_meta(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Send dtype and shape, then the tensor; pair with :func:`recv_with_meta`."""
    send(header_of(tensor), dst, group)
    send(tensor, dst, group)


def recv_with_meta(
    src: int, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Receive a tensor sent with :func:`send_with_meta`, allocating it from the header."""
    header = recv(torch.zeros(HEADER_NUMEL, dtype=torch.int64, device=device), src, group)
    return recv(buffer_for(header, device), src, group)


def exchange(
    sends: Sequence[tuple[torch.Tensor, int]] = (),
    recvs: Sequence[tuple[torch.Tensor, int]] = (),
    group: dist.ProcessGroup | None = None,
    *,
    wait_sends: bool = True,
) -> list[tuple[dist.Work, torch.Tensor]]:
    """Post every ``(tensor, dst)`` send and ``(buffer, src)`` receive together, then wait.

    Receives fill their buffers in place. With ``wait_sends=False`` only the
    receives are waited for, and the pending sends come back as (handle, tensor)
    pairs for the caller to wait on later (the tensors stay referenced until
    then). A pipeline needs that: in interleaved 1F1B two neighbours can each
    send first and receive only later, and if both waited for their sends they
    would wait for each other forever.
    """
    sends = [(tensor.contiguous(), dst) for tensor, dst in sends]
    works, num_ops = _post(sends, recvs, group)
    if not num_ops:
        return []
    if wait_sends or len(works) != num_ops:  # a backend that coalesces the batch into one handle: wait for all
        for work in works:
            work.wait()
        return []
    for work in works[len(sends) :]:
        work.wait()
    return [(work, tensor) for work, (tensor, _) in zip(works[: len(sends)], sends)]


def _post(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    group: dist.ProcessGroup | None,
) -> tuple[list[dist.Work], int]:
    """Record and post contiguous ``sends`` and ``recvs`` with one ``batch_isend_irecv``; returns the
    handles and the number of operations posted (a backend may coalesce them into fewer handles)."""
    ops = []
    for tensor, dst in sends:
        record("send", group, _nbytes(tensor), peer=dst)
        ops.append(dist.P2POp(dist.isend, tensor, dst, group))
    for buffer, src in recvs:
        record("recv", group, _nbytes(buffer), wire_bytes=0.0, peer=src)
        ops.append(dist.P2POp(dist.irecv, buffer, src, group))
    return (dist.batch_isend_irecv(ops) if ops else []), len(ops)


class PendingExchange:
    """Sends and receives posted by :func:`post_exchange`. ``wait()`` returns when all of them are done;
    until then the send tensors stay referenced here and the receive buffers must not be read."""

    def __init__(self, works: list[dist.Work], tensors: list[torch.Tensor]):
        self._works, self._tensors = works, tensors

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works, self._tensors = [], []


def post_exchange(
    sends: Sequence[tuple[torch.Tensor, int]] = (),
    recvs: Sequence[tuple[torch.Tensor, int]] = (),
    group: dist.ProcessGroup | None = None,
) -> PendingExchange:
    """Post every ``(tensor, dst)`` send and ``(buffer, src)`` receive together and return at once.

    The caller overlaps its own work with the transfers and calls ``wait()`` before reading a
    receive buffer (or writing a sent tensor). Every rank must post its exchanges with a given
    peer in the same order, as with :func:`exchange`; no rank waits before all are posted, so
    neighbours that send to each other cannot deadlock.
    """
    sends = [(tensor.contiguous(), dst) for tensor, dst in sends]
    works, _ = _post(sends, recvs, group)
    return PendingExchange(works, [t for t, _ in sends] + [b for b, _ in recvs])
