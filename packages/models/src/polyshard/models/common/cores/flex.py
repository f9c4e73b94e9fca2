"""The FlexAttention core (CUDA only): torch's ``flex_attention`` with a ``BlockMask`` built from the same
visibility rule as the block-sparse core (causal, sliding window, documents), so the fused kernel skips
the masked blocks itself. Sinks join the softmax through the log-sum-exp it returns:
``out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink)``.

Shapes: B batch, N query heads, K key/value heads, S sequence, D/E head dims.

Untested on this project's machines (CPU only; in torch 2.13 FlexAttention has no backward on CPU): it
is chosen only on CUDA, where ``tests/models/test_cores.py`` compares it with the dense reference when a
GPU is present. Its block masks are built per call (one per layer and step): cheap beside the attention
at the lengths where it matters.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch


def flex_available(device: torch.device) -> bool:
    """FlexAttention runs here: a CUDA device and a torch that ships it."""
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _compiled() -> Any:
    """flex_attention compiled once per process: uncompiled it is a slow reference implementation."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    segments: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """As :func:`~polyshard.cp.blocksparse.block_sparse_attention`, with FlexAttention."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    b, n, s, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale

    def visible(batch: Any, head: Any, query: Any, key: Any) -> Any:
        seen = query >= key if causal else query >= 0
        if window is not None:
            seen = seen & (query - key < window)
        if segments is not None:
            seen = seen & (segments[batch, query] == segments[batch, key])
        return seen

    rows = b if segments is not None else None  # without documents one mask serves every row
    block_mask = create_block_mask(visible, rows, None, s, s, device=q.device)
    out: torch.Tensor
    out, aux = _compiled()(
        q, k, v, block_mask=block_mask, scale=scale, enable_gqa=n != k.shape[1], return_aux=AuxRequest(lse=True)
    )
    if sinks is None:
        return out
    weight = torch.sigmoid(aux.lse.float() - sinks.float().reshape(1, n, 1))  # (B, N, S): share left to keys
    return (out.float() * weight.unsqueeze(-1)).to(q.dtype)
