"""LoRA's adapter on one process (its initialisation, scale and update, the frozen base) and the choice of
targets by Hugging Face module names; every layout's parity is tests/trainer/test_lora_parity.py's."""

import dataclasses
import math

import pytest
import torch
from torch import nn

from polyshard.models.common.lora import attach_lora, initial_a, is_adapter, lora_scale
from polyshard.models.errors import ConfigError
from polyshard.models.lora_targets import select_targets
from polyshard.trainer.config import from_dict
from polyshard.trainer.engine.lora import lora_targets


def _adapted(rank=4, alpha=8.0, rslora=False, dropout=0.0):
    torch.manual_seed(0)
    linear = nn.Linear(16, 12)
    base = nn.Linear(16, 12)
    base.load_state_dict(linear.state_dict())
    attach_lora(linear, "layers.1.attn.q_proj", rank=rank, alpha=alpha, dropout=dropout, rslora=rslora, seed=3)
    return linear, base


def test_first_forward_is_the_base_and_only_the_adapter_learns():
    linear, base = _adapted()
    x = torch.randn(2, 5, 16)
    assert torch.equal(linear(x), base(x))  # B starts at zero (PEFT's default)
    assert not linear.weight.requires_grad and not linear.bias.requires_grad
    linear(x).square().sum().backward()
    assert linear.weight.grad is None and linear.bias.grad is None
    assert linear.lora_B.weight.grad.abs().sum() > 0
    assert sorted(n for n, p in linear.named_parameters() if p.requires_grad) == ["lora_A.weight", "lora_B.weight"]


@pytest.mark.parametrize("rslora", [False, True])
def test_update_is_the_scaled_low_rank_product(rslora):
    linear, base = _adapted(rank=4, alpha=8.0, rslora=rslora)
    with torch.no_grad():
        linear.lora_B.weight.normal_()
    x = torch.randn(3, 16)
    scale = 8.0 / (math.sqrt(4) if rslora else 4)
    assert lora_scale(4, 8.0, rslora) == scale
    expected = base(x) + scale * x @ linear.lora_A.weight.T @ linear.lora_B.weight.T
    torch.testing.assert_close(linear(x), expected)


def test_a_is_kaiming_uniform_and_the_same_for_every_layout():
    a = initial_a(8, 400, seed=5, name="layers.2.mlp.up_proj")
    bound = 1 / math.sqrt(400)  # nn.init.kaiming_uniform_(a=sqrt(5)), PEFT's rule
    assert a.abs().max() <= bound and a.abs().max() > 0.95 * bound and a.mean().abs() < 0.1 * bound
    assert torch.equal(a, initial_a(8, 400, seed=5, name="layers.2.mlp.up_proj"))
    assert not torch.equal(a, initial_a(8, 400, seed=5, name="layers.2.mlp.down_proj"))
    assert not torch.equal(a, initial_a(8, 400, seed=6, name="layers.2.mlp.up_proj"))


def test_dropout_applies_to_the_adapter_input_only():
    linear, base = _adapted(dropout=0.5)
    with torch.no_grad():
        linear.lora_B.weight.normal_()
    x = torch.randn(4, 16)
    linear.eval()
    assert torch.equal(linear(x), linear(x))
    linear.train()
    assert not torch.equal(linear(x), linear(x))  # the adapter's input is dropped, differently each call
    with torch.no_grad():
        linear.lora_B.weight.zero_()
    assert torch.equal(linear(x), base(x))  # never the base's own input


def _llama(**lora):
    model = {"preset": "llama-tiny", "hidden": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
    return from_dict({"model": model, "lora": lora})


def test_targets_are_hugging_face_module_names():
    config = _llama(targets=["q_proj", "down_proj"])
    chosen = lora_targets(config)
    assert [(t.name, t.hf_path) for t in chosen] == [
        ("layers.1.attn.q_proj", "model.layers.0.self_attn.q_proj"),
        ("layers.1.mlp.down_proj", "model.layers.0.mlp.down_proj"),
        ("layers.2.attn.q_proj", "model.layers.1.self_attn.q_proj"),
        ("layers.2.mlp.down_proj", "model.layers.1.mlp.down_proj"),
    ]
    every = {t.short for t in lora_targets(_llama(targets="all-linear"))}
    assert every == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # no head


def test_mla_projections_are_targets():
    config = from_dict({"model": {"kind": "deepseek-v3", "num_heads": 2, "hidden": 32}})
    shorts = {t.short for t in select_targets(config.model, "all-linear", 2)}
    assert {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj"} <= shorts
    chosen = select_targets(config.model, ["kv_b_proj"], 2)
    assert [t.hf_path for t in chosen] == [f"model.layers.{i}.self_attn.kv_b_proj" for i in range(len(chosen))]
    assert len(chosen) == config.model.num_layers and not is_adapter(chosen[0].name)


def test_bad_targets_and_ranks_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"'qkv' matches no linear of this model; its linears are \['down_proj'"):
        lora_targets(_llama(targets=["q_proj", "qkv"]))
    # k_proj of 2 kv heads x 8 dims is (16 x 32): a rank of 17 does not fit
    with pytest.raises(ConfigError, match=r"lora.rank=17 is larger than k_proj \(16 x 32\); choose rank <= 16"):
        lora_targets(_llama(rank=17))
    assert len(lora_targets(_llama(rank=16, targets=["k_proj"]))) == 2
    with pytest.raises(ConfigError, match="lora.rank=0 must be an integer >= 1"):
        _llama(rank=0)
    with pytest.raises(ConfigError, match="lora.rank=17 is larger than layers.1.attn.k_proj"):
        attach_lora(nn.Linear(32, 16), "layers.1.attn.k_proj", rank=17, alpha=1.0, dropout=0.0, rslora=False, seed=0)


def test_a_saved_config_without_lora_reads_back():
    config = from_dict({})
    assert config.lora is None and from_dict(dataclasses.asdict(config)).lora is None
    adapted = _llama(rank=2, targets=["v_proj"])
    assert from_dict(dataclasses.asdict(adapted)).lora == adapted.lora
