"""Posting one exchange: a batch of isend/irecv whose sends finish in the background.

``polyshard.collectives.p2p.exchange`` waits for its sends as well as its
receives. A pipeline rank must not wait for a send: in interleaved 1F1B two
neighbours can each send first and receive only later, and if both waited
for their sends they would wait for each other forever. So this helper waits
only for the receives and hands back the send handles, which the executor
waits for at the end of the step (the tensors stay referenced until then).
Every send and receive is still reported to the CommLedger.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from polyshard.collectives.ledger import record


def post_exchange(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    group: dist.ProcessGroup | None,
) -> list[tuple[dist.Work, torch.Tensor]]:
    """Post ``(tensor, dst)`` sends and ``(buffer, src)`` receives together; wait for the receives only.

    Returns the pending sends as (handle, tensor) pairs for the caller to wait on.
    """
    ops = []
    for tensor, dst in sends:
        record("send", group, tensor.numel() * tensor.element_size())
        ops.append(dist.P2POp(dist.isend, tensor, dst, group))
    for buffer, src in recvs:
        record("recv", group, buffer.numel() * buffer.element_size(), wire_bytes=0.0)
        ops.append(dist.P2POp(dist.irecv, buffer, src, group))
    if not ops:
        return []
    works = dist.batch_isend_irecv(ops)
    if len(works) != len(ops):  # a backend that coalesces the batch into one handle: wait for all of it
        for work in works:
            work.wait()
        return []
    for work in works[len(sends) :]:
        work.wait()
    return [(work, tensor) for work, (tensor, _) in zip(works[: len(sends)], sends)]
