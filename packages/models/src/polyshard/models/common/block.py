"""The transformer block as plain PyTorch: pre-norm attention + MLP, no parallelism inside.

These are the modules tensor parallelism converts (:func:`polyshard.tp.parallelize` with a plan that
names ``attn.[qkv]_proj``, ``attn.o_proj``, ``mlp.fc_in``, ``mlp.fc_out``) and the ones every family
is built from: one block, one place.

Document masking (packed rows of several documents): the block's forward takes the batch's
:class:`~polyshard.models.common.documents.Documents`, which keep attention inside each document (a
block-diagonal causal mask) and restart rotary positions at each document. Left None (the default)
nothing changes: the plain causal SDPA call runs, bit for bit as without it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from polyshard.models.common.attention import Attention
from polyshard.models.common.documents import Documents
from polyshard.models.common.mlp import MLP, SwiGLU, norm_layer
from polyshard.models.common.recompute import checkpoint_mode, selective_contexts
from polyshard.models.common.rotary import RopeConfig

ACTIVATIONS = ("gelu", "swiglu")


class Block(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)); ``mlp`` may be replaced (e.g. by an MoE layer).

    GPT-2 by default; Llama with ``norm="rms"``, ``activation="swiglu"``, ``bias=False`` and a
    ``rope`` (:class:`RopeConfig`: its theta, and a scaling for Llama 3.1+); ``norm_eps`` is every norm's
    epsilon (q/k norm's too); ``head_dim``, ``qkv_bias`` and ``qk_norm`` are :class:`Attention`'s (Qwen2,
    Qwen3), and so are ``window`` (a sliding-window layer), ``sinks`` (gpt-oss) and ``attention_core`` (its ``core``).
    With ``checkpoint_activations`` ``"full"`` (or True) only the block's input is kept for backward;
    everything inside is recomputed then (Chen et al. 1604.06174), trading a
    second forward for the memory of every intermediate activation. ``"selective"`` also keeps the
    matmul and attention outputs and recomputes only the elementwise work (:mod:`polyshard.models.common.recompute`).

    ``forward(x, documents, positions)``: ``documents`` (None: one sequence per row) are the
    :class:`Documents` of the batch being run (a pipeline passes each microbatch's); ``positions`` the
    tokens' rotary positions when they are not 0..S-1 (context parallelism's chunks). A recompute in
    backward is handed the same arguments.
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        mlp_ratio: int = 4,
        *,
        causal: bool = True,
        dropout: float = 0.0,
        checkpoint_activations: bool | str = False,
        norm: str = "layer",
        activation: str = "gelu",
        bias: bool = True,
        rope: RopeConfig | None = None,
        mlp_hidden: int | None = None,
        norm_eps: float = 1e-5,
        head_dim: int | None = None,
        qkv_bias: bool | None = None,
        qk_norm: bool = False,
        window: int | None = None,
        sinks: bool = False,
        attention_core: str = "auto",
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: choose one of {ACTIVATIONS}")
        self.checkpoint_activations = checkpoint_mode(checkpoint_activations)  # None, "full" or "selective"
        self.norm1 = norm_layer(norm, hidden, norm_eps)
        self.attn = Attention(
            hidden,
            num_heads,
            num_kv_heads,
            causal=causal,
            dropout=dropout,
            bias=bias,
            rope=rope,
            head_dim=head_dim,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            norm_eps=norm_eps,
            window=window,
            sinks=sinks,
            core=attention_core,
        )
        self.norm2 = norm_layer(norm, hidden, norm_eps)
        width = mlp_hidden or mlp_ratio * hidden
        self.mlp: nn.Module = (
            MLP(hidden, width, bias=bias) if activation == "gelu" else SwiGLU(hidden, width, bias=bias)
        )
        self.drop = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, documents: Documents | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        mode = self.checkpoint_activations
        if mode is not None and torch.is_grad_enabled():
            if mode == "selective":
                return checkpoint(  # type: ignore[no-any-return]
                    self._forward, x, documents, positions, use_reentrant=False, context_fn=selective_contexts
                )
            # No context_fn for "full" (the default no-op): torch.compile traces checkpoint only without one.
            return checkpoint(self._forward, x, documents, positions, use_reentrant=False)  # type: ignore[no-any-return]
        return self._forward(x, documents, positions)

    def _forward(
        self, x: torch.Tensor, documents: Documents | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        # Only what is set is passed, so an attention of a user's that takes neither still fits.
        side = {k: v for k, v in (("documents", documents), ("positions", positions)) if v is not None}
        attended = self.attn(self.norm1(x), **side)
        x = x + self.drop(attended)
        return x + self.drop(self.mlp(self.norm2(x)))  # type: ignore[no-any-return]
