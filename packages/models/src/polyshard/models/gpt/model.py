"""A decoder-only GPT as plain PyTorch, exposing its ordered layers for pipelining.

``model.layers`` is ``[Embedding, Block x num_layers, LMHead]``; each maps one
tensor to the next (tokens (B, S) -> (B, S, H) -> ... -> logits (B, S, V)),
so a pipeline can cut the list anywhere. ``forward`` simply runs them in
order; the loss is computed outside the model.

GPT-2 by default; Llama with ``norm="rms"``, ``activation="swiglu"``, ``positions="rope"``,
``bias=False`` and grouped-query attention (the ``llama-*`` presets); Qwen3 adds ``qk_norm`` and its own
``head_dim``. :data:`SPEC` declares the
family to the trainer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from polyshard.models.common import Block, Documents, RopeConfig, norm_layer
from polyshard.models.common.caching import caching
from polyshard.models.common.mtp import MultiTokenPrediction, PredictionDepth, PredictionInputs
from polyshard.models.config import ModelConfig
from polyshard.models.decoder import DecoderConfig, decoder_config, decoder_shape, grouped_attention
from polyshard.models.gpt.config import GPTConfig
from polyshard.models.gpt.hf_gpt2 import GPT2
from polyshard.models.gpt.hf_llama import LLAMA_FAMILY
from polyshard.models.gpt.hf_qwen2 import QWEN2
from polyshard.models.gpt.hf_qwen3 import QWEN3
from polyshard.models.gpt.plan import check, tp_plan
from polyshard.models.gpt.presets import PRESETS
from polyshard.models.spec import (
    BuildOptions,
    ModelSpec,
)


class Embedding(nn.Module):
    """Token embedding, plus a learned position table unless positions are rotary: (B, S) int -> (B, S, H)."""

    def __init__(self, vocab_size: int, context_length: int, hidden: int, dropout: float = 0.0, learned: bool = True):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, hidden)
        self.pos = nn.Embedding(context_length, hidden) if learned else None
        self.drop = nn.Dropout(dropout)

    def forward(
        self, tokens: torch.Tensor, documents: Documents | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``positions``: (S,) the tokens' positions when not 0..S-1 (context parallelism's chunks);
        ``documents``: the batch's documents, whose positions restart at each document."""
        x = self.tok(tokens)
        if self.pos is not None:
            if documents is not None:
                positions = documents.positions  # (B, S): each token's position within its document
            elif positions is None:
                positions = torch.arange(tokens.shape[1])
            x = x + self.pos(positions.to(tokens.device))
        return self.drop(x)  # type: ignore[no-any-return]  # nn.Module.__call__ returns Any in torch's stubs


class LMHead(nn.Module):
    """Final norm and projection to the vocabulary: (B, S, H) -> (B, S, V).

    ``logits=False``: the norm only, (B, S, H) -> (B, S, H); the loss multiplies by ``proj.weight`` itself,
    a chunk of tokens at a time (``training.loss_chunks``), so the (B, S, V) logits never exist whole.

    ``mtp`` (``model.mtp_depth`` > 0): the multi-token prediction depths, run on the head's input after the
    main output when the forward is given their ``prediction`` inputs (:mod:`polyshard.models.common.mtp`),
    with the batch's ``documents`` and ``positions`` as the blocks have them; they live in this layer, so
    they run on the last pipeline stage beside the head they share.
    """

    def __init__(self, hidden: int, vocab_size: int, norm: str = "layer", norm_eps: float = 1e-5, logits: bool = True):
        super().__init__()
        self.norm = norm_layer(norm, hidden, norm_eps)
        self.proj = nn.Linear(hidden, vocab_size, bias=False)
        self.logits = logits
        self.mtp: MultiTokenPrediction | None = None

    def forward(
        self,
        x: torch.Tensor,
        documents: Documents | None = None,
        positions: torch.Tensor | None = None,
        prediction: PredictionInputs | None = None,
    ) -> torch.Tensor:
        out: torch.Tensor = self.proj(self.norm(x)) if self.logits else self.norm(x)
        if self.mtp is not None and prediction is not None:
            out = self.mtp(x, out, self._head, prediction, documents, positions)
        return out

    def _head(self, normed: torch.Tensor) -> torch.Tensor:
        """What the head makes of normed hidden states: logits, or (chunked loss) the states themselves."""
        projected: torch.Tensor = self.proj(normed) if self.logits else normed
        return projected


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
        checkpoint_activations: bool | str = False,
        norm: str = "layer",
        activation: str = "gelu",
        positions: str = "learned",
        bias: bool = True,
        rope: RopeConfig | None = None,
        mlp_hidden: int | None = None,
        norm_eps: float = 1e-5,
        head_dim: int | None = None,
        qkv_bias: bool | None = None,
        qk_norm: bool = False,
        attention_core: str = "auto",
        sliding_window: int | None = None,
        layer_types: Sequence[str] | None = None,
        sinks: bool = False,
        head_logits: bool = True,
        mtp_depth: int = 0,
        mtp_loss_weight: float = 0.3,
        mtp_loss_scale: float = 1.0,
    ):
        super().__init__()
        self.context_length = context_length
        kv_heads = num_kv_heads or num_heads
        block: dict[str, Any] = {
            "dropout": dropout,
            "checkpoint_activations": checkpoint_activations,
            "norm": norm,
            "activation": activation,
            "bias": bias,
            "rope": (rope or RopeConfig()) if positions == "rope" else None,
            "mlp_hidden": mlp_hidden,
            "norm_eps": norm_eps,
            "head_dim": head_dim,
            "qkv_bias": qkv_bias,
            "qk_norm": qk_norm,
            "attention_core": attention_core,
            "sinks": sinks,
        }
        # Each block's sliding window: every block's with no layer_types, else the "sliding_attention" ones'.
        windows = [
            sliding_window if layer_types is None or layer_types[i] == "sliding_attention" else None
            for i in range(num_layers)
        ]
        blocks = [
            Block(hidden, num_heads, kv_heads, mlp_ratio, causal=True, window=window, **block) for window in windows
        ]
        embedding = Embedding(vocab_size, context_length, hidden, dropout, learned=positions == "learned")
        self.layers = nn.ModuleList([embedding, *blocks])
        head = LMHead(hidden, vocab_size, norm, norm_eps, logits=head_logits)
        if mtp_depth:
            # Each depth's block is built like the last block (its window too); the embedding is the model's.
            depths = [
                PredictionDepth(
                    Block(hidden, num_heads, kv_heads, mlp_ratio, window=windows[-1], **block), hidden, norm, norm_eps
                )
                for _ in range(mtp_depth)
            ]
            head.mtp = MultiTokenPrediction(depths, vocab_size, hidden, weight=mtp_loss_weight)
            head.mtp.loss_scale = mtp_loss_scale
            head.mtp.embed.weight = embedding.tok.weight
        self.layers.append(head)
        if tie_embeddings:
            # nn.Module's attributes are typed Tensor | Module; proj and tok are an nn.Linear and an nn.Embedding.
            self.layers[-1].proj.weight = self.layers[0].tok.weight  # type: ignore[union-attr]

    def forward(
        self,
        tokens: torch.Tensor,
        documents: Documents | None = None,
        positions: torch.Tensor | None = None,
        prediction: PredictionInputs | None = None,
    ) -> torch.Tensor:
        """(B, S) tokens -> (B, S, V) logits (or normed hidden states with chunked loss). ``documents``:
        the packed rows' documents; ``positions``: (S,) positions when not 0..S-1 (context parallelism);
        ``prediction``: multi-token prediction's inputs, targets and loss (training only)."""
        embedding, *blocks, head = self.layers
        x = embedding(tokens, documents, positions)
        for block in blocks:
            x = block(x, documents, positions)
        return head(x, documents, positions, prediction)  # type: ignore[no-any-return]

    @torch.no_grad()
    def generate(
        self,
        prompt: torch.Tensor,
        new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        generator: torch.Generator | None = None,
        cache: bool = False,
        choose: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Sample ``new_tokens`` after ``prompt`` (B, S0) on one process; returns (B, S0 + new_tokens).
        ``top_k`` > 0 samples among the k likeliest tokens only. Without ``cache`` each step recomputes the
        prefix (its last ``context_length`` tokens); with it each step runs only the new token over a KV
        cache (:mod:`polyshard.models.common.kv_cache`), and the prompt and the tokens fed back must fit the
        context (S0 + new_tokens - 1 <= context_length). ``choose(logits, step)``: the caller's draw in place
        of temperature and top-k, (B, V) logits of step ``step`` (0-based) -> (B, 1) token ids."""
        if choose is None:
            choose = functools.partial(_draw, temperature=temperature, top_k=top_k, generator=generator)
        if cache:
            return self._generate_cached(prompt, new_tokens, choose)
        tokens = prompt
        for step in range(new_tokens):
            last = self(tokens[:, -self.context_length :])[:, -1, :]
            tokens = torch.cat([tokens, choose(self._logits(last), step)], dim=1)
        return tokens

    def _generate_cached(
        self, prompt: torch.Tensor, new_tokens: int, choose: Callable[[torch.Tensor, int], torch.Tensor]
    ) -> torch.Tensor:
        if prompt.shape[1] + new_tokens - 1 > self.context_length:
            raise ValueError(
                f"a {prompt.shape[1]}-token prompt and {new_tokens} new tokens pass the context of "
                f"{self.context_length} tokens; generate fewer tokens or without the cache (which slides the window)"
            )
        tokens = prompt
        with caching(self):
            out = self(prompt)  # prefill: every prompt token's keys and values cached at once
            for step in range(new_tokens):
                tokens = torch.cat([tokens, choose(self._logits(out[:, -1, :]), step)], dim=1)
                if step + 1 < new_tokens:  # the new token's position: the learned table's (GPT-2) and rotary
                    out = self(tokens[:, -1:], positions=torch.tensor([tokens.shape[1] - 1], device=tokens.device))
        return tokens

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        """(B, V) logits from the head's output at the last position (with chunked loss: its hidden states)."""
        head = cast(LMHead, self.layers[-1])
        return last if head.logits else head.proj(last)


def _draw(
    logits: torch.Tensor, step: int, *, temperature: float, top_k: int, generator: torch.Generator | None
) -> torch.Tensor:
    """:meth:`GPT.generate`'s own draw: (B, V) logits -> (B, 1) ids, by temperature and top-k."""
    logits = logits / max(temperature, 1e-5)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


# -- the family's spec ----------------------------------------------------------------------------------


def build(config: ModelConfig, options: BuildOptions) -> GPT:
    config = grouped_attention(config)
    attention = {
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "qkv_bias": config.qkv_bias,
        "qk_norm": config.qk_norm,
        "sliding_window": config.sliding_window,
        "layer_types": config.layer_types,
        "sinks": config.attention_sinks,
    }
    return build_decoder(config, options, attention)


def build_decoder(config: DecoderConfig, options: BuildOptions, attention: dict[str, Any]) -> GPT:
    """The decoder's layers with :class:`~polyshard.models.common.Attention` built from ``attention`` (its
    grouped heads, windows, sinks); a family with another attention (DeepSeek's MLA) puts its own in each
    block after, and passes none."""
    return GPT(
        vocab_size=config.vocab_size,
        context_length=config.context_length,
        hidden=config.hidden,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        mlp_ratio=config.mlp_ratio,
        tie_embeddings=config.tie_embeddings,
        dropout=config.dropout,
        checkpoint_activations=options.checkpoint_activations,
        norm=config.norm,
        activation=config.activation,
        positions=config.positions,
        bias=config.bias,
        rope=config.rope,
        mlp_hidden=config.mlp_width,
        norm_eps=config.norm_eps,
        attention_core=config.attention_core,
        head_logits=options.head_logits,
        mtp_depth=config.mtp_depth,
        mtp_loss_weight=options.mtp_loss_weight,
        mtp_loss_scale=options.aux_loss_scale,  # 1 / microbatches: each microbatch's MTP loss counts 1/m
        **attention,
    )


def tied(model: ModelConfig) -> dict[str, str]:
    """With ``tie_embeddings`` the output head's weight is the token embedding (GPT-2, Llama-3.2); with
    ``mtp_depth`` > 0 the prediction depths' embedding is it too (a pipeline's last stage holds a copy)."""
    config, last = decoder_config(model), model.num_layers + 1
    ties = {f"layers.{last}.proj.weight": "layers.0.tok.weight"} if config.tie_embeddings else {}
    if config.mtp_depth:
        ties[f"layers.{last}.mtp.embed.weight"] = "layers.0.tok.weight"
    return ties


def sequence_length(model: ModelConfig) -> int:
    """Tokens per row: the context length."""
    return decoder_config(model).context_length


def vocab_size(model: ModelConfig) -> int:
    """Logits per position: the vocabulary."""
    return decoder_config(model).vocab_size


SPEC = ModelSpec(
    shape=decoder_shape,
    kind="gpt",
    sequence_length=sequence_length,
    output_width=vocab_size,
    config=GPTConfig,
    presets=PRESETS,
    task="language",
    build=build,
    tp_plan=tp_plan,
    tied=tied,
    check=check,
    context_parallel=True,
    # polyshard.trainer.checkpointing.hugging_face's name tables; the architecture fields pick one
    hf_adapters=(GPT2, LLAMA_FAMILY, QWEN2, QWEN3),
)
