"""The Llama architecture (RMSNorm, SwiGLU, rotary positions, no biases, GQA) on polyshard's GPT is
Llama: with `transformers`' LlamaForCausalLM's weights copied in, the logits are transformers'.

Tolerance: float32 computed in another order (SDPA vs eager attention, fused ops): 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from polyshard.models import build_model
from polyshard.models.common import RopeConfig, rope_frequencies, rotate
from polyshard.trainer.config import from_dict

transformers = pytest.importorskip("transformers")
# As tests/models/test_hf.py: float32 sums of a tiny model in another order than transformers'.
ROUND_OFF = 1e-5


def test_rotary_positions_are_llamas():
    from transformers.models.llama import modeling_llama

    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, rope_theta=500000.0)
    q, k = torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8)
    cos, sin = modeling_llama.LlamaRotaryEmbedding(config=config)(q, torch.arange(10)[None].expand(2, -1))
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(rotate(q, RopeConfig(theta=500000.0)), want_q, rtol=ROUND_OFF, atol=ROUND_OFF)
    torch.testing.assert_close(rotate(k, RopeConfig(theta=500000.0)), want_k, rtol=ROUND_OFF, atol=ROUND_OFF)


def test_llama3_rope_scaling_is_transformers():
    """Llama 3.1's frequency scaling against transformers' own rotary embedding, at positions up to 4x
    past the original context. Head dim 32 with theta 10000 and an original context of 64 puts
    frequencies in all three bands (kept, blended, divided), so each branch of the rule is checked."""
    from transformers.models.llama import modeling_llama

    scaling = RopeConfig(scaling="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=64)
    config = transformers.LlamaConfig(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=512,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    )  # fmt: skip
    theirs = modeling_llama.LlamaRotaryEmbedding(config=config)
    inv = rope_frequencies(32, scaling)
    wavelength = 2 * torch.pi / rope_frequencies(32, RopeConfig())
    assert (wavelength < 16).any() and ((wavelength > 16) & (wavelength < 64)).any() and (wavelength > 64).any()
    # The frequencies themselves: the same float32 operations in the same order, so bit for bit.
    assert torch.equal(inv, theirs.inv_freq)
    positions = 256  # 4x the original context
    q, k = torch.randn(2, 4, positions, 32), torch.randn(2, 2, positions, 32)
    cos, sin = theirs(q, torch.arange(positions)[None].expand(2, -1))
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    # Both sides run the same float32 operations (equal today, bit for bit); 1e-5 leaves room for
    # another order of the final multiply-add, on values of size ~1.
    torch.testing.assert_close(rotate(q, scaling), want_q, rtol=ROUND_OFF, atol=ROUND_OFF)
    torch.testing.assert_close(rotate(k, scaling), want_k, rtol=ROUND_OFF, atol=ROUND_OFF)
    assert not torch.allclose(rotate(q, RopeConfig()), want_q, atol=1e-3)  # scaling changed something


def test_the_llama_3_2_preset_scales_its_rotary_frequencies():
    config = from_dict({"model": {"preset": "llama-3.2-1b"}}).model
    rope = config.rope
    assert (rope.scaling, rope.factor, rope.low_freq_factor, rope.high_freq_factor) == ("llama3", 32.0, 1.0, 4.0)
    assert rope.original_context == 8192 and config.norm_eps == 1e-5
    assert not from_dict({"model": {"preset": "llama-3-8b"}}).model.rope.stretched  # Llama 3, not 3.1


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_the_llama_preset_computes_what_transformers_llama_does(tie):
    config = from_dict(
        {
            "model": {
                "preset": "llama-tiny",
                "hidden": 32,
                "num_layers": 2,
                "num_heads": 4,
                "num_kv_heads": 2,
                "mlp_hidden": 88,
                "vocab_size": 300,
                "context_length": 16,
                "rope": {"theta": 500000.0},
                "tie_embeddings": tie,
            }
        }
    ).model
    hf_config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=tie, attention_bias=False, mlp_bias=False,
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():
        for p in theirs.parameters():  # norms start at 1: make every tensor count
            p.add_(torch.randn_like(p) * 0.02)
    ours = build_model(config)
    hf = theirs.state_dict()
    state = {"layers.0.tok.weight": hf["model.embed_tokens.weight"]}
    for i in range(2):
        src, dst = f"model.layers.{i}", f"layers.{i + 1}"
        state[f"{dst}.norm1.weight"] = hf[f"{src}.input_layernorm.weight"]
        state[f"{dst}.norm2.weight"] = hf[f"{src}.post_attention_layernorm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[f"{dst}.attn.{proj}.weight"] = hf[f"{src}.self_attn.{proj}.weight"]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            state[f"{dst}.mlp.{proj}.weight"] = hf[f"{src}.mlp.{proj}.weight"]
    state["layers.3.norm.weight"] = hf["model.norm.weight"]
    state["layers.3.proj.weight"] = hf["lm_head.weight"]
    ours.load_state_dict(state, strict=True)
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), theirs(tokens).logits, rtol=ROUND_OFF, atol=ROUND_OFF)
