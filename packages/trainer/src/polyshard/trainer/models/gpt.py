"""A decoder-only GPT as plain PyTorch, exposing its ordered layers for pipelining.

``model.layers`` is ``[Embedding, Block x num_layers, LMHead]``; each maps one
tensor to the next (tokens (B, S) -> (B, S, H) -> ... -> logits (B, S, V)),
so a pipeline can cut the list anywhere. ``forward`` simply runs them in
order; the loss is computed outside the model.
"""

from __future__ import annotations

import torch
from torch import nn

from polyshard.tp.transformer import Block, RopeScaling, norm_layer


class Embedding(nn.Module):
    """Token embedding, plus a learned position table unless positions are rotary: (B, S) int -> (B, S, H)."""

    def __init__(self, vocab_size: int, context_length: int, hidden: int, dropout: float = 0.0, learned=True):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, hidden)
        self.pos = nn.Embedding(context_length, hidden) if learned else None
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        if self.pos is not None:
            x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        return self.drop(x)


class LMHead(nn.Module):
    """Final norm and projection to the vocabulary: (B, S, H) -> (B, S, V)."""

    def __init__(self, hidden: int, vocab_size: int, norm: str = "layer", norm_eps: float = 1e-5):
        super().__init__()
        self.norm = norm_layer(norm, hidden, norm_eps)
        self.proj = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class GPT(nn.Module):
    def __init__(
        self,
        *,
        vocab_size: int,
        context_length: int,
        hidden: int,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        mlp_ratio: int = 4,
        tie_embeddings: bool = False,
        dropout: float = 0.0,
        checkpoint_activations: bool = False,
        norm: str = "layer",
        activation: str = "gelu",
        positions: str = "learned",
        bias: bool = True,
        rope_theta: float = 10000.0,
        rope_scaling: RopeScaling | None = None,
        mlp_hidden: int | None = None,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        self.context_length = context_length
        kv_heads = num_kv_heads or num_heads
        block = {
            "dropout": dropout,
            "checkpoint_activations": checkpoint_activations,
            "norm": norm,
            "activation": activation,
            "bias": bias,
            "rope_theta": rope_theta if positions == "rope" else None,
            "rope_scaling": rope_scaling if positions == "rope" else None,
            "mlp_hidden": mlp_hidden,
            "norm_eps": norm_eps,
        }
        blocks = [Block(hidden, num_heads, kv_heads, mlp_ratio, causal=True, **block) for _ in range(num_layers)]
        embedding = Embedding(vocab_size, context_length, hidden, dropout, learned=positions == "learned")
        self.layers = nn.ModuleList([embedding, *blocks])
        self.layers.append(LMHead(hidden, vocab_size, norm, norm_eps))
        if tie_embeddings:
            self.layers[-1].proj.weight = self.layers[0].tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        for layer in self.layers:
            x = layer(x)
        return x

    @torch.no_grad()
    def generate(
        self, prompt: torch.Tensor, new_tokens: int, *, temperature: float = 1.0, top_k: int = 0, generator=None
    ):
        """Sample ``new_tokens`` after ``prompt`` (B, S0) on one process; returns (B, S0 + new_tokens).
        ``top_k`` > 0 samples among the k likeliest tokens only."""
        tokens = prompt
        for _ in range(new_tokens):
            logits = self(tokens[:, -self.context_length :])[:, -1, :] / max(temperature, 1e-5)
            if 0 < top_k < logits.shape[-1]:
                kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits.float(), dim=-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return tokens
