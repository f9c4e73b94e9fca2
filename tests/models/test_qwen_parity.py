"""Training parity for what Qwen3 and Qwen2-MoE add to the model: q/k norms (one weight per head dim,
replicated over tp while its heads are split, so its gradient is summed over tp), a head dim of its own,
q/k/v-only biases, and a gated shared expert split by tp beside ep's routed experts. Each layout runs the
real training loop (6 AdamW steps with weight decay, warmup, clipping) and is compared with one process by
tests/_layouts.py's runner: losses and pre-clip gradient norms, every gradient of the first step and
every parameter after the last (a gradient of the q/k norms or the shared expert summed over the wrong ranks
shows in that tensor at once).

Tolerance: test_e2e_parity's TOLERANCE, float32 sums taken in another order. The MoE model trains without
the auxiliary loss, so its layouts compute the same maths as one process (see MOE_RTOL there).
"""

from __future__ import annotations

import functools

import pytest

from polyshard.trainer.config import from_dict
from tests._layouts import LONG, layout
from tests._short import short_run
from tests.trainer.test_e2e_parity import STEPS, TOLERANCE

ARCH = {"norm": "rms", "activation": "swiglu", "positions": "rope", "bias": False, "num_kv_heads": 2}
QWEN3 = {**ARCH, "qk_norm": True, "head_dim": 16, "mlp_hidden": 88}
QWEN2_MOE = {
    **ARCH, "kind": "moe-gpt", "qkv_bias": True, "qk_norm": True, "shared_experts": 1, "shared_expert_hidden": 24,
    "shared_expert_gate": True, "expert_hidden": 16, "router_renormalize": False, "aux_loss_weight": 0.0,
}  # fmt: skip
MODELS = {"qwen3": QWEN3, "qwen2-moe": QWEN2_MOE}


def _config(corpus, model, **parallel):
    return from_dict(
        {
            "model": {"hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16, **MODELS[model]},
            "parallel": parallel,
            **short_run(STEPS, weight_decay=0.1),
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
        }
    )


LAYOUTS = [
    layout("tp2", model="qwen3"),
    layout("tp2-sp", model="qwen3"),
    layout("cp2-ring", model="qwen3"),
    layout("tp4", LONG, model="qwen3"),  # 2 kv heads on 4 ranks: replicated
    layout("pp2-1f1b", LONG, model="qwen3"),
    layout("cp2xtp2-sp", LONG, model="qwen3"),
    layout("ep2", model="qwen2-moe"),
    layout("tp2", model="qwen2-moe"),
    layout("ep2xtp2", LONG, model="qwen2-moe"),
    layout("ep2xpp2", LONG, model="qwen2-moe"),
    layout("dp2xep2-zero1", LONG, model="qwen2-moe"),
]


@pytest.mark.parametrize("model, name", LAYOUTS)
def test_qwen_layers_train_as_on_one_process(parity, corpus, tmp_path, model, name):
    compared = parity.check(name, functools.partial(_config, corpus, model), TOLERANCE, tmp_path)
    assert any(n.endswith("q_norm.weight") for n in compared.names["params"])  # the q/k norms are there


@pytest.mark.parametrize(
    "model, message",
    [
        ({"kind": "moe-gpt", "moe": {"shared_gate": True}}, "model.moe.shared_gate gates the shared experts: set"),
        ({"head_dim": 0}, "model.head_dim=0"),
        ({"expert_hidden": 8}, "model.expert_hidden is not a setting of model.kind='gpt'"),
        ({"kind": "moe-gpt", "moe": {"shared_experts": -1}}, "model.moe.shared_experts"),
        ({"kind": "moe-gpt", "moe": {"ffn_hidden": 0}}, "model.moe.ffn_hidden=0"),
        ({"positions": "rope", "head_dim": 7}, r"the head dim \(model.head_dim, or hidden/num_heads\)=7 must be even"),
        ({"kind": "moe-gpt", "moe": {"shared_experts": 1, "shared_ffn_hidden": 33}, "tp": 2}, "not divide the MLP"),
    ],
)  # fmt: skip
def test_the_new_settings_are_checked_naming_the_field(model, message):
    from polyshard.trainer.engine.constraints import validate
    from polyshard.trainer.errors import ConfigError

    parallel = {"tp": model.pop("tp")} if "tp" in model else {}
    with pytest.raises(ConfigError, match=message):
        validate(from_dict({"model": model, "parallel": parallel}), world_size=max(1, parallel.get("tp", 1)))


def test_a_head_dim_of_its_own_needs_no_divisible_width():
    """Qwen3-4B's shape in small: 3 heads of 16 dims on a 40-wide stream (40 is no multiple of 3)."""
    import torch

    from polyshard.models import build_model

    config = from_dict({"model": {**QWEN3, "hidden": 40, "num_heads": 3, "num_kv_heads": 1, "num_layers": 1}}).model
    model = build_model(config)
    assert model.layers[1].attn.q_proj.weight.shape == (48, 40)
    assert model(torch.randint(0, 256, (2, 8))).shape == (2, 8, 256)
