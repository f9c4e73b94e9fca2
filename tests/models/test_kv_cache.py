"""Generation with a KV cache (polyshard.models.common.kv_cache) draws what recomputing the whole prefix at
every step draws (``GPT.generate`` without the cache), for GPT-2's parts (learned positions, biases, a tied
head), Llama's (rotary with Llama 3.1's scaling, grouped-query attention, qk-norm), Qwen2's q/k/v biases,
gpt-oss's sliding windows and sinks, and a chunked-loss head; MLA is refused by name."""

from __future__ import annotations

import pytest
import torch

from polyshard.models import GPT, ConfigError
from polyshard.models.common import MLA, Attention, RopeConfig, caching

# Every step's logits: the cached step attends its one query over T cached keys (SDPA without a mask, or
# the sinks' float32 softmax), the recomputation runs causal SDPA over the whole prefix: the same float32
# sums in another order, ~5e-7 on logits of size ~1 (measured 4.8e-7); 1e-5 leaves room for other CPUs'
# kernels while a wrong position, a missing key or a misplaced head moves logits by ~1e-1.
LOGITS_TOL = 1e-5

ARCHITECTURES = {
    "gpt2": {"tie_embeddings": True},
    "llama": {
        "norm": "rms",
        "activation": "swiglu",
        "positions": "rope",
        "bias": False,
        "num_kv_heads": 2,
        "qk_norm": True,
        "rope": RopeConfig(scaling="llama3", factor=8.0, original_context=16),
    },
    "qwen2": {"norm": "rms", "activation": "swiglu", "positions": "rope", "bias": False, "qkv_bias": True},
    "gpt-oss": {
        "norm": "rms",
        "activation": "swiglu",
        "positions": "rope",
        "bias": False,
        "num_kv_heads": 2,
        "sinks": True,
        "sliding_window": 4,  # shorter than the prompts: the window cuts cached keys
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "chunked-head": {"head_logits": False},  # the head gives hidden states, generate projects them
}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices gain nothing from a second thread, and on a busy machine its hand-offs cost ~10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(name: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(vocab_size=61, context_length=32, hidden=32, num_layers=2, num_heads=4, **ARCHITECTURES[name])
    for p in model.parameters():  # sinks start at 0 and norms at 1: move them so a dropped one shows
        p.data.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _greedy_with_logits(model: GPT, prompt: torch.Tensor, new_tokens: int, cache: bool):
    seen: list[torch.Tensor] = []

    def choose(logits: torch.Tensor, step: int) -> torch.Tensor:
        seen.append(logits)
        return logits.argmax(dim=-1, keepdim=True)

    return model.generate(prompt, new_tokens, cache=cache, choose=choose), torch.stack(seen)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_cached_greedy_generation_gives_the_recomputed_tokens_and_logits(name):
    model, prompt = _model(name), torch.randint(0, 61, (3, 7), generator=torch.Generator().manual_seed(1))
    cached, cached_logits = _greedy_with_logits(model, prompt, 12, cache=True)
    recomputed, recomputed_logits = _greedy_with_logits(model, prompt, 12, cache=False)
    assert torch.equal(cached, recomputed)
    assert cached_logits.shape == (12, 3, 61)
    torch.testing.assert_close(cached_logits, recomputed_logits, rtol=LOGITS_TOL, atol=LOGITS_TOL)
    assert all(m.kv_cache is None for m in model.modules() if isinstance(m, Attention)), "a cache was left on"


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_cached_sampling_draws_the_recomputed_tokens(name):
    model, prompt = _model(name), torch.randint(0, 61, (4, 5), generator=torch.Generator().manual_seed(2))
    drawn = [
        model.generate(prompt, 24, temperature=1.5, top_k=20, cache=cache, generator=torch.Generator().manual_seed(3))
        for cache in (True, False)
    ]
    assert torch.equal(drawn[0], drawn[1])
    assert len({tuple(row) for row in drawn[0][:, 5:].tolist()}) == 4  # really sampled: the rows differ


def test_a_decode_step_appends_one_token_to_every_layer_and_sees_the_prefix():
    model, tokens = _model("llama"), torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), caching(model) as caches:
        model(tokens[:, :8])
        last = model(tokens[:, 8:], positions=torch.tensor([8]))[:, -1]
        assert [c.length for c in caches] == [9, 9]
        caches[0].repeat_rows(3)  # one prompt's cache serving three samples: rows 0, 0, 0, 1, 1, 1
        assert caches[0].keys is not None and caches[0].keys.shape[0] == 6
    whole = model(tokens)[:, -1]
    torch.testing.assert_close(last, whole, rtol=LOGITS_TOL, atol=LOGITS_TOL)


def test_the_cache_refuses_what_it_cannot_hold():
    latent = torch.nn.Sequential(
        MLA(
            32,
            4,
            q_lora_rank=None,
            kv_lora_rank=8,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            rope=RopeConfig(),
        )
    )
    with pytest.raises(ConfigError, match="multi-head latent attention"), caching(latent):
        pass
    model = _model("gpt2")
    with pytest.raises(ValueError, match="pass the context of 32 tokens"):
        model.generate(torch.zeros(1, 20, dtype=torch.long), 14, cache=True)
