"""GPT-2 (``GPT2LMHeadModel``): learned positions, pre-norm blocks with biases, tanh GELU, an unbiased
head, tied or untied embeddings. Its ``Conv1D`` weights are our ``Linear`` weights transposed, and q,
k, v sit side by side in one ``c_attn``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polyshard.checkpoint import CheckpointError, TensorLocation
from polyshard.models.gpt.config import GPTConfig
from polyshard.models.hf_adapter import (
    FULL_ATTENTION,
    HFAdapter,
    read_bool,
    read_int,
    read_number,
    require,
    shape_differences,
)

# The settings that make polyshard's GPT GPT-2's architecture.
SHAPE: dict[str, object] = {
    "kind": "gpt", "norm": "layer", "activation": "gelu", "positions": "learned", "bias": True, "qkv_bias": True,
    "qk_norm": False, **FULL_ATTENTION,
}  # fmt: skip


def settings(hf: Mapping[str, Any], where: str) -> dict[str, object]:
    """``config.json`` -> polyshard's ``[model]`` settings; whatever polyshard's GPT cannot compute is refused."""
    hidden, heads = read_int(hf, "n_embd", where), read_int(hf, "n_head", where)
    if hidden % heads:
        raise CheckpointError(f"{where}: n_embd={hidden} is not a multiple of n_head={heads}")
    require(hf, "activation_function", where, ("gelu_new", "gelu_pytorch_tanh"), "polyshard's GPT uses tanh GELU")
    require(hf, "scale_attn_weights", where, (True,), "attention scores are scaled by 1/sqrt(head dim)")
    require(hf, "scale_attn_by_inverse_layer_idx", where, (False,), "no per-layer scaling")
    require(hf, "reorder_and_upcast_attn", where, (False,), "no reordered attention")
    return {
        **SHAPE,
        "vocab_size": read_int(hf, "vocab_size", where),
        "context_length": read_int(hf, "n_positions", where),
        "hidden": hidden,
        "num_layers": read_int(hf, "n_layer", where),
        "num_heads": heads,
        "num_kv_heads": heads,
        "mlp_hidden": read_int(hf, "n_inner", where, default=4 * hidden),
        "tie_embeddings": read_bool(hf, "tie_word_embeddings", where, default=True),
        "norm_eps": read_number(hf, "layer_norm_epsilon", where, default=1e-5, above=0.0, below=1.0),
    }


def differences(model: GPTConfig) -> dict[str, object]:
    out = shape_differences(model, SHAPE)
    if model.kv_heads != model.num_heads:
        out["num_kv_heads"] = model.num_heads  # GPT-2 has no grouped-query attention
    if model.attention_head_dim * model.num_heads != model.hidden:
        out["head_dim"] = model.hidden // model.num_heads  # nor a head dim of its own
    return out


def locations(model: GPTConfig) -> dict[str, TensorLocation]:
    """Our parameter name -> where it lives in a GPT-2 file."""
    h, last = model.hidden, model.num_layers + 1
    out = {
        "layers.0.tok.weight": TensorLocation("transformer.wte.weight"),
        # A model trained on shorter sequences takes the table's first context_length rows (as nanoGPT crops it).
        "layers.0.pos.weight": TensorLocation("transformer.wpe.weight", rows=model.context_length),
    }
    for i in range(1, last):
        hf = f"transformer.h.{i - 1}"
        ours = f"layers.{i}"
        for a, b in (("norm1", "ln_1"), ("norm2", "ln_2")):
            out[f"{ours}.{a}.weight"], out[f"{ours}.{a}.bias"] = (
                TensorLocation(f"{hf}.{b}.weight"),
                TensorLocation(f"{hf}.{b}.bias"),
            )
        for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            out[f"{ours}.attn.{proj}.weight"] = TensorLocation(f"{hf}.attn.c_attn.weight", True, j * h, parts=3)
            out[f"{ours}.attn.{proj}.bias"] = TensorLocation(f"{hf}.attn.c_attn.bias", False, j * h, parts=3)
        for a, b in (("attn.o_proj", "attn.c_proj"), ("mlp.fc_in", "mlp.c_fc"), ("mlp.fc_out", "mlp.c_proj")):
            out[f"{ours}.{a}.weight"] = TensorLocation(f"{hf}.{b}.weight", True)
            out[f"{ours}.{a}.bias"] = TensorLocation(f"{hf}.{b}.bias")
    out[f"layers.{last}.norm.weight"] = TensorLocation("transformer.ln_f.weight")
    out[f"layers.{last}.norm.bias"] = TensorLocation("transformer.ln_f.bias")
    if not model.tie_embeddings:
        out[f"layers.{last}.proj.weight"] = TensorLocation("lm_head.weight")
    return out


def config(model: GPTConfig) -> dict[str, object]:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model.vocab_size,
        "n_positions": model.context_length,
        "n_embd": model.hidden,
        "n_layer": model.num_layers,
        "n_head": model.num_heads,
        "n_inner": model.mlp_width,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": model.norm_eps,
        "resid_pdrop": model.dropout,
        "embd_pdrop": model.dropout,
        "attn_pdrop": model.dropout,
        "tie_word_embeddings": model.tie_embeddings,
        "torch_dtype": "float32",
    }


GPT2 = HFAdapter(
    model_type="gpt2",
    title="GPT-2",
    settings=settings,
    differences=differences,
    locations=locations,
    config=config,
    # GPT2Model's files (the Hub's "gpt2") name the tensors without GPT2LMHeadModel's "transformer.".
    base_prefix="transformer.",
    base_names=("h.", "wte.", "wpe.", "ln_f."),
    buffers=(".attn.bias", ".attn.masked_bias"),  # causal masks some saved files keep
    at_most=frozenset({"context_length"}),  # a shorter context reads the first rows of the position table
    note=lambda model: (
        f"GPT-2's position table is written at the {model.context_length} positions the model trained on "
        f"(n_positions={model.context_length}); rows a source folder had past them are not kept"
    ),
)
