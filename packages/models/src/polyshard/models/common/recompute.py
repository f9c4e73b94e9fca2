"""Activation checkpointing of a transformer block: full, or selective.

Full (Chen et al. 1604.06174): the block keeps its input alone and reruns its whole forward in backward.
Selective, per operator, as torchtitan's SAC and in the spirit of Megatron-LM's selective recompute
(Korthikanti et al. 2205.05198): the block also keeps the outputs of its matmuls and of its attention
kernel, the expensive part of the forward, and reruns only the cheap elementwise work between them
(norms, GELU/SiLU, rope, residual adds, dtype casts). Per token of a dense block that keeps
q, k, v, the attention output and its log-sum-exp, o_proj's output, the MLP's one or two up projections
and its down projection: with h = 512, f = 4h, 8 heads, fp32 about 22.6 KB, against 2 KB under full
and 32.8 KB with no checkpointing (``polyshard.planner.activations`` counts it, ``polyshard bench recompute``
measures it).

What is recomputed still runs in backward exactly as in forward, collectives included: under tensor
parallelism the all-reduces (or SP's all-gather / reduce-scatter) between the cached matmuls run again,
and context parallelism's ring attention (a ``torch.autograd.Function`` whose inner matmuls are batched
``bmm``, not saved) is recomputed whole, K/V passes included — as under full checkpointing. ``bmm`` is
left out of the saved ops on purpose: in this code base it is only the s x s attention scores (the
math-path SDPA, the cp block kernel), the one activation selective recompute exists to avoid keeping.

The saving uses ``torch.utils.checkpoint``'s selective contexts (``create_selective_checkpoint_contexts``),
which ``torch.compile`` understands. One change: the cached outputs can be replayed more than once,
because a pipeline's zero-bubble split backward (``polyshard.pp.split``) runs two autograd passes over
a stage — B for the input gradient, W for the weights — and each pass recomputes the block; torch's
own cache allows one.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    _CachedTorchDispatchMode,
    create_selective_checkpoint_contexts,
)

MODES = ("full", "selective")
"""The two kinds of activation checkpointing; False (or None) is none."""

_aten = torch.ops.aten
SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
}
"""Operators whose outputs selective checkpointing keeps: the linears' matmuls (``nn.Linear`` on a 3-D
input is a view and ``mm``/``addmm``) and the fused attention kernels (output and log-sum-exp)."""
if hasattr(_aten, "_grouped_mm"):  # the experts' grouped matmul, where torch has it
    SAVED_OPS.add(_aten._grouped_mm.default)


def checkpoint_mode(value: bool | str | None) -> str | None:
    """``value`` as one of :data:`MODES`, or None for no checkpointing (True means 'full')."""
    if value is None or value is False:
        return None
    if value is True:
        return "full"
    if value not in MODES:
        raise ValueError(f"activation checkpointing {value!r}: choose one of {list(MODES)}, or False")
    return str(value)


def _policy(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _ReplayableCache(_CachedTorchDispatchMode):  # type: ignore[no-untyped-call]
    """torch's recompute-side SAC mode, refilled from the forward's cache each time a recompute starts,
    so a second autograd pass over the same block (the split backward's W) finds the outputs again."""

    def __init__(self, cached: _CachedTorchDispatchMode):
        super().__init__(None, cached.storage, cached.allow_cache_entry_mutation)
        self._kept: dict[Any, Any] | None = None

    def __enter__(self) -> Any:
        if self._kept is None:  # the first recompute: the forward has filled the cache by now
            self._kept = {key: copy.copy(entries) for key, entries in self.storage.items()}
        else:
            for key, entries in self._kept.items():
                self.storage[key] = copy.copy(entries)
        return super().__enter__()  # type: ignore[no-untyped-call]


def selective_contexts() -> tuple[Any, Any]:
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for selective checkpointing."""
    caching, cached = create_selective_checkpoint_contexts(_policy)  # type: ignore[no-untyped-call]
    return caching, _ReplayableCache(cached)
