"""The building blocks every family shares: rotary positions, documents, attention, the MLPs and norms,
the block, activation recompute, the initialisation rule and generation's KV cache."""

from polyshard.models.common.attention import Attention, CoreAttention
from polyshard.models.common.block import ACTIVATIONS, Block
from polyshard.models.common.caching import caching
from polyshard.models.common.documents import Documents, document_mask, document_positions
from polyshard.models.common.initialise import init_weights
from polyshard.models.common.kv_cache import KVCache
from polyshard.models.common.mla import MLA, kv_cache_width
from polyshard.models.common.mlp import MLP, NORMS, SwiGLU, norm_layer
from polyshard.models.common.recompute import checkpoint_mode, selective_contexts
from polyshard.models.common.rotary import RopeConfig, deinterleave, rope_frequencies, rotate, yarn_mscale

__all__ = [
    "ACTIVATIONS",
    "MLA",
    "MLP",
    "NORMS",
    "Attention",
    "Block",
    "CoreAttention",
    "KVCache",
    "Documents",
    "RopeConfig",
    "SwiGLU",
    "caching",
    "checkpoint_mode",
    "deinterleave",
    "document_mask",
    "document_positions",
    "init_weights",
    "kv_cache_width",
    "norm_layer",
    "rope_frequencies",
    "rotate",
    "selective_contexts",
    "yarn_mscale",
]
