"""polyshard.tp: tensor and sequence parallelism on torch.distributed.

Layers: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
:class:`VocabParallelEmbedding`, :func:`vocab_parallel_cross_entropy`, and the head with its loss in
chunks of tokens, :func:`chunked_linear_cross_entropy`.
Models: :func:`parallelize` with a plan of styles, :func:`gather_full_state`
to rebuild the unsharded weights, :func:`sync_sequence_parallel_grads` after
backward when sequence parallelism is on.
"""

from polyshard.tp.chunked_loss import chunked_linear_cross_entropy, head_input
from polyshard.tp.errors import PlanError, TPError, TPShapeError
from polyshard.tp.heads import ReplicatedKVLinear, heads_per_rank, replicates_kv, valid_tp_sizes
from polyshard.tp.linear import ColumnParallelLinear, RowParallelLinear
from polyshard.tp.plan import name_placements, parallelize, planned_placement
from polyshard.tp.regions import enter_region, leave_region, split_sequence, sync_sequence_parallel_grads
from polyshard.tp.shard import (
    gather_full_state,
    gather_full_tensor,
    is_sequence_parallel,
    mark_sequence_parallel,
    padded_size,
)
from polyshard.tp.styles import (
    ColumnParallel,
    HeadNorm,
    HeadParameter,
    ReplicateKVHeads,
    RowParallel,
    SequenceParallel,
    ShardHeads,
    SplitSequence,
    Style,
    TPEntry,
    VocabParallel,
)
from polyshard.tp.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = [
    "ColumnParallel",
    "ColumnParallelLinear",
    "HeadNorm",
    "HeadParameter",
    "PlanError",
    "ReplicateKVHeads",
    "ReplicatedKVLinear",
    "RowParallel",
    "RowParallelLinear",
    "SequenceParallel",
    "ShardHeads",
    "SplitSequence",
    "Style",
    "TPEntry",
    "TPError",
    "TPShapeError",
    "chunked_linear_cross_entropy",
    "VocabParallel",
    "VocabParallelEmbedding",
    "enter_region",
    "gather_full_state",
    "gather_full_tensor",
    "head_input",
    "heads_per_rank",
    "is_sequence_parallel",
    "mark_sequence_parallel",
    "leave_region",
    "name_placements",
    "planned_placement",
    "replicates_kv",
    "padded_size",
    "parallelize",
    "split_sequence",
    "sync_sequence_parallel_grads",
    "valid_tp_sizes",
    "vocab_parallel_cross_entropy",
]
