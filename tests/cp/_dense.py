"""What the cp attention tests share: packed rows' document ids, and one run of a cp attention against the
dense single-process reference (:func:`polyshard.models.common.cores.dense_attention`)."""

import torch
import torch.distributed as dist

from polyshard.cp import shard_sequence, unshard_sequence
from polyshard.models.common.cores import dense_attention


def segments_of(lengths):
    """Rows of document lengths -> (B, S) document ids."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])


def against_dense(attend, lengths, window, use_sinks, heads=4, kv_heads=2, dim=8):
    """``attend(q, k, v, segments, window, sinks)`` on this rank's chunks (the default cp group) and the
    dense reference on whole rows, forward and backward: (ours, reference) as whole tensors, the output
    then dq, dk, dv (and dsinks with sinks)."""
    seq = sum(lengths[0])
    g = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (
        torch.randn(len(lengths), h, seq, dim, generator=g) for h in (heads, kv_heads, kv_heads, heads)
    )
    sinks = torch.randn(heads, generator=g) if use_sinks else None
    segments = segments_of(lengths)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_sinks = None if sinks is None else sinks.clone().requires_grad_()
    ref = dense_attention(*full, window=window, segments=segments, sinks=ref_sinks)
    ref.backward(grad_out)

    local = [shard_sequence(t, 2, None).detach().requires_grad_() for t in (q, k, v)]
    my_sinks = None if sinks is None else sinks.clone().requires_grad_()
    out = attend(*local, shard_sequence(segments, 1, None), window, my_sinks)
    out.backward(shard_sequence(grad_out, 2, None))
    ours = [unshard_sequence(t, 2, None) for t in [out.detach()] + [t.grad for t in local]]
    refs = [ref.detach()] + [t.grad for t in full]
    if sinks is not None:  # each rank has the gradient of its own query rows: summed, the whole one
        dist.all_reduce(my_sinks.grad)
        ours, refs = ours + [my_sinks.grad], refs + [ref_sinks.grad]
    return ours, refs
