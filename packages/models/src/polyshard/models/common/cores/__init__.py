"""Attention cores: the parameter-free inner product softmax(q k^T / sqrt(D)) v, with the visibility of
causal masks, sliding windows and documents and per-head sinks, chosen per run (:func:`choose_core`).

* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``, causal or not; no mask, window or sinks.
* ``blocksparse``: our own online-softmax walk over key/value blocks that skips hidden blocks, any device
  (:mod:`polyshard.cp.blocksparse`, which all-gather context parallelism runs too).
* ``flex``: FlexAttention with a ``BlockMask`` (CUDA only).
* ``auto``: sdpa when nothing is masked beyond causality, else flex on CUDA, else blocksparse.

:func:`~polyshard.models.common.cores.reference.dense_attention` (a dense S x S mask) is the reference
the tests compare them with.
"""

from polyshard.cp.blocksparse import (
    BLOCK,
    BlockPlan,
    BlockSparseAttention,
    Visibility,
    block_hidden,
    block_sparse_attention,
    plan_sparse_blocks,
)
from polyshard.models.common.cores.flex import flex_available, flex_core
from polyshard.models.common.cores.reference import dense_attention, visible_mask
from polyshard.models.common.cores.select import CORES, choose_core

__all__ = [
    "BLOCK",
    "CORES",
    "BlockPlan",
    "BlockSparseAttention",
    "Visibility",
    "block_hidden",
    "block_sparse_attention",
    "choose_core",
    "dense_attention",
    "flex_available",
    "flex_core",
    "plan_sparse_blocks",
    "visible_mask",
]
