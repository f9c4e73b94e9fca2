"""Text from the unsharded weights, on one process."""

from __future__ import annotations

import dataclasses
from typing import cast

import torch

from polyshard.data.tokenizer import Tokenizer, load_tokenizer
from polyshard.models import GPT, build_model
from polyshard.trainer.config import Config
from polyshard.trainer.engine.lora import apply_lora


def sample_text(
    config: Config,
    state: dict[str, torch.Tensor],
    new_tokens: int,
    prompt: str = "ROMEO:",
    *,
    temperature: float = 0.8,
    top_k: int = 0,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
) -> str:
    """Generate from the unsharded weights on one process, with ``tokenizer`` (default: the config's). A
    LoRA run's state holds its adapters: the model gets their places first (``state`` fills them, so the
    run's lora.init folder is not read again)."""
    model = build_model(config.model)
    if config.lora is not None:
        apply_lora(model, dataclasses.replace(config, lora=dataclasses.replace(config.lora, init=None)))
    model.load_state_dict(state, strict=True)
    model.eval()
    tokenizer = tokenizer or load_tokenizer(config.data.tokenizer)
    tokens = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    # Only language models generate, and every one of them is a GPT (models.gpt, models.moe).
    out = cast(GPT, model).generate(tokens, new_tokens, temperature=temperature, top_k=top_k, generator=generator)
    return tokenizer.decode(out[0].tolist())
