"""Generation's KV caches switched on: :func:`caching` gives every self-attention inside a module a
:class:`~polyshard.models.common.kv_cache.KVCache` for the length of a ``with`` block (see that module)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from polyshard.models.common.attention import Attention
from polyshard.models.common.kv_cache import KVCache
from polyshard.models.common.mla import MLA
from polyshard.models.errors import ConfigError


@contextlib.contextmanager
def caching(module: nn.Module) -> Iterator[list[KVCache]]:
    """Attach a fresh :class:`KVCache` to every :class:`Attention` inside ``module`` (in module order,
    yielded) and remove them on exit. A module with multi-head latent attention is refused: its cache
    would hold latents, which is not built."""
    latent = [name for name, m in module.named_modules() if isinstance(m, MLA)]
    if latent:
        raise ConfigError(
            f"generation with a KV cache does not support multi-head latent attention (MLA, DeepSeek-V3) yet "
            f"({latent[0]!r}); generate with a model of the gpt, moe_gpt or gpt_oss family"
        )
    layers = [m for m in module.modules() if isinstance(m, Attention)]
    caches = [KVCache() for _ in layers]
    for layer, cache in zip(layers, caches):
        layer.kv_cache = cache
    try:
        yield caches
    finally:
        for layer in layers:
            layer.kv_cache = None
