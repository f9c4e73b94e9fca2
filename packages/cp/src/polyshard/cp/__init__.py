"""polyshard.cp: context parallelism, i.e. load-balanced sequence sharding with ring, all-gather and Ulysses
attention, and the 2-D Ulysses x ring scheme."""

from polyshard.cp.allgather import allgather_attention
from polyshard.cp.attention import STYLES, ContextParallelAttention, Style, check_inputs, context_parallel_attention
from polyshard.cp.blocks import Block, plan_blocks
from polyshard.cp.errors import ContextParallelError, check_sequence_length
from polyshard.cp.groups import split_context_group, ulysses_ring_groups
from polyshard.cp.ring import RingAttention, ring_attention
from polyshard.cp.sharding import (
    local_positions,
    position_ids,
    rank_chunks,
    shard_sequence,
    to_rank_order,
    to_sequence_order,
    unshard_sequence,
)
from polyshard.cp.ulysses import Core, heads_to_sequence, kv_copies, sdpa_core, sequence_to_heads, ulysses_attention

__all__ = [
    "STYLES",
    "Block",
    "Core",
    "ContextParallelAttention",
    "ContextParallelError",
    "RingAttention",
    "Style",
    "allgather_attention",
    "check_inputs",
    "check_sequence_length",
    "context_parallel_attention",
    "heads_to_sequence",
    "kv_copies",
    "local_positions",
    "plan_blocks",
    "position_ids",
    "rank_chunks",
    "ring_attention",
    "sdpa_core",
    "sequence_to_heads",
    "shard_sequence",
    "split_context_group",
    "to_rank_order",
    "to_sequence_order",
    "ulysses_attention",
    "ulysses_ring_groups",
    "unshard_sequence",
]
