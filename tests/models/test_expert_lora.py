"""LoRA on the routed experts (``lora.experts``) on one process: PEFT's initialisation per expert, the first
forward the base's, the update each expert's own scaled low-rank product through the grouped matmul, only
the adapters learning, merging; and the ``[lora]`` settings that refuse it. Layouts: test_lora_experts.py."""

import math

import pytest
import torch

from polyshard.models.common.lora import initial_a, is_adapter, lora_scale
from polyshard.models.common.moe import MoEConfig, MoELayer
from polyshard.models.common.moe.lora import attach_expert_lora, merge_expert_adapters
from polyshard.models.errors import ConfigError
from polyshard.trainer.config import from_dict
from polyshard.trainer.engine.lora import check_lora

NAME = "layers.1.mlp.moe"


def _layers(rank=4, alpha=8.0, rslora=False):
    torch.manual_seed(0)
    config = MoEConfig(num_experts=4, top_k=2, ffn_hidden=12, aux_loss_coef=0.0)
    adapted, base = MoELayer(config, hidden=16), MoELayer(config, hidden=16)
    base.load_state_dict(adapted.state_dict())
    attach_expert_lora(adapted, NAME, rank=rank, alpha=alpha, dropout=0.0, rslora=rslora, seed=3)
    return adapted, base


def test_first_forward_is_the_base_and_only_the_adapters_learn():
    adapted, base = _layers()
    x = torch.randn(2, 5, 16)
    assert torch.equal(adapted(x)[0], base(x)[0])  # every B starts at zero
    adapted(x)[0].square().sum().backward()
    trained = sorted(n for n, p in adapted.experts.named_parameters() if p.requires_grad)
    assert trained == [f"{w}_lora_{f}" for w in ("w1", "w2", "w3") for f in "AB"]
    assert all(is_adapter(f"{NAME}.experts.{n}") for n in trained)
    assert adapted.experts.w1.grad is None and adapted.experts.w1_lora_B.grad.abs().sum() > 0


def test_each_expert_starts_from_its_own_kaiming_a():
    adapted, _ = _layers()
    a = adapted.experts.w1_lora_A  # (E, H, r)
    assert a.shape == (4, 16, 4) and adapted.experts.w1_lora_B.shape == (4, 4, 12)
    for e in range(4):  # PEFT's (r, in) per expert, seeded by its global index: every ep layout draws these
        assert torch.equal(a[e], initial_a(4, 16, 3, f"{NAME}.experts.w1.{e}").T)
    assert a.abs().max() <= 1 / math.sqrt(16) and not torch.equal(a[0], a[1])


@pytest.mark.parametrize("rslora", [False, True])
def test_the_update_is_each_experts_scaled_product_and_merges(rslora):
    adapted, base = _layers(rank=4, alpha=8.0, rslora=rslora)
    assert adapted.experts.lora_scale == lora_scale(4, 8.0, rslora) == (4.0 if rslora else 2.0)
    with torch.no_grad():
        for name, p in adapted.experts.named_parameters():
            if name.endswith("_lora_B"):
                p.normal_(0, 0.3)
    merged = {k: v.clone() for k, v in adapted.state_dict().items()}
    merge_expert_adapters(merged, adapted.experts.lora_scale)
    assert not any(is_adapter(k) for k in merged)
    experts = adapted.experts
    manual = experts.w1 + experts.lora_scale * experts.w1_lora_A @ experts.w1_lora_B  # (E, H, F)
    torch.testing.assert_close(merged["experts.w1"], manual)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert not torch.allclose(adapted(x)[0], base(x)[0], atol=1e-3)  # the adapters count
        base.load_state_dict(merged)
        # float32: the product folded into the weight sums in another order (~1e-7 relative)
        torch.testing.assert_close(adapted(x)[0], base(x)[0], rtol=1e-5, atol=1e-5)


def test_a_rank_larger_than_an_expert_is_refused():
    with pytest.raises(ConfigError, match=r"lora.rank=13 is larger than layers.1.mlp.moe.experts.w1 \(16 x 12"):
        _layers(rank=13)


def _config(model, **lora):
    model = {"hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16, **model}
    return from_dict({"model": model, "lora": {"rank": 4, **lora}})


@pytest.mark.parametrize(
    "model, lora, says",
    [
        ({}, {"experts": True}, r"lora.experts = true adapts routed experts, but model.kind='gpt' has none"),
        ({"kind": "moe-gpt"}, {"experts": True, "init": "peft:x"}, r"lora.init='peft:x' with lora.experts = true"),
        ({"kind": "moe-gpt"}, {"experts": "yes"}, r"lora.experts='yes' must be true or false"),
    ],
)
def test_lora_experts_settings_are_checked_in_one_line(model, lora, says):
    with pytest.raises(ConfigError, match=says) as err:
        check_lora(_config(model, **lora))
    assert "\n" not in str(err.value)
