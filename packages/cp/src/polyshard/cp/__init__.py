"""polyshard.cp: context parallelism, i.e. load-balanced sequence sharding with ring and all-gather attention."""

from polyshard.cp.allgather import allgather_attention
from polyshard.cp.attention import STYLES, ContextParallelAttention, Style, check_inputs, context_parallel_attention
from polyshard.cp.blocks import Block, plan_blocks
from polyshard.cp.errors import ContextParallelError, check_sequence_length
from polyshard.cp.ring import RingAttention, ring_attention
from polyshard.cp.sharding import (
    local_positions,
    position_ids,
    rank_chunks,
    shard_sequence,
    to_sequence_order,
    unshard_sequence,
)

__all__ = [
    "STYLES",
    "Block",
    "ContextParallelAttention",
    "ContextParallelError",
    "RingAttention",
    "Style",
    "allgather_attention",
    "check_inputs",
    "check_sequence_length",
    "context_parallel_attention",
    "local_positions",
    "plan_blocks",
    "position_ids",
    "rank_chunks",
    "ring_attention",
    "shard_sequence",
    "to_sequence_order",
    "unshard_sequence",
]
