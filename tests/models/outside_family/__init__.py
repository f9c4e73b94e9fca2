"""A model family defined outside polyshard.models, as a user would: its own config, modules, plan and
spec, built from the common blocks, registered with :func:`polyshard.models.register`. Nothing in the
trainer knows it. A small Llama-like decoder whose head has no bias and whose blocks share one width."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from polyshard.models import BuildOptions, ModelConfig, ModelSpec, ParallelSizes, register
from polyshard.models.common import Block, RopeConfig, norm_layer
from polyshard.models.errors import check_positive
from polyshard.models.spec import attention_plan, check_mlp_split, mlp_plan, sequence_plan, split_sequence
from polyshard.tp import VocabParallel

KIND = "outside-lm"


@dataclass(kw_only=True, frozen=True)
class OutsideConfig(ModelConfig):
    kind: str = KIND
    vocab_size: int = 256
    """Tokens in the vocabulary."""
    context_length: int = 16
    """Tokens per row."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("model.vocab_size", self.vocab_size)
        check_positive("model.context_length", self.context_length)


class Tokens(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens)


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int, eps: float):
        super().__init__()
        self.norm = norm_layer("rms", hidden, eps)
        self.proj = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class OutsideLM(nn.Module):
    def __init__(self, config: OutsideConfig, options: BuildOptions):
        super().__init__()
        arch = {"norm": "rms", "activation": "swiglu", "bias": False, "rope": RopeConfig()}
        blocks = [
            Block(config.hidden, config.num_heads, mlp_ratio=config.mlp_ratio, norm_eps=config.norm_eps,
                  checkpoint_activations=options.checkpoint_activations, **arch)
            for _ in range(config.num_layers)
        ]  # fmt: skip
        head = Head(config.hidden, config.vocab_size, config.norm_eps)
        self.layers = nn.ModuleList([Tokens(config.vocab_size, config.hidden), *blocks, head])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        for layer in self.layers:
            x = layer(x)
        return x


def _own(model: ModelConfig) -> OutsideConfig:
    if not isinstance(model, OutsideConfig):
        raise TypeError(f"not an {KIND} config: {model!r}")
    return model


def tp_plan(model: ModelConfig, parallel: ParallelSizes) -> dict[str, object]:
    sp, last = parallel.sequence_parallel, model.num_layers + 1
    plan: dict[str, object] = {"layers.0.tok": VocabParallel(), f"layers.{last}.proj": VocabParallel()}
    for i in range(1, last):
        plan |= attention_plan(f"layers.{i}", model, parallel) | mlp_plan(f"layers.{i}", sp, "swiglu")
        plan |= sequence_plan(f"layers.{i}", sp)
    return plan | split_sequence(1, sp)


SPEC = ModelSpec(
    kind=KIND,
    config=OutsideConfig,
    task="language",
    build=lambda model, options: OutsideLM(_own(model), options),
    tp_plan=tp_plan,
    check=lambda model, parallel: check_mlp_split(model.mlp_width, parallel.tp),
    sequence_length=lambda model: _own(model).context_length,
    output_width=lambda model: _own(model).vocab_size,
)


def register_outside_family() -> None:
    """Register the family in this process (each worker calls it before reading a config naming it)."""
    register(SPEC)
