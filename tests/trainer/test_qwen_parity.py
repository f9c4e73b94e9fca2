"""Training parity for what Qwen3 and Qwen2-MoE add to the model: q/k norms (one weight per head dim,
replicated over tp while its heads are split, so its gradient is summed over tp), a head dim of its own,
q/k/v-only biases, and a gated shared expert split by tp beside ep's routed experts. Each layout runs the
real training loop (6 AdamW steps with weight decay, warmup, clipping) and is compared with one process:
losses and pre-clip gradient norms (a gradient of the q/k norms or the shared expert summed over the wrong
ranks changes the norm at once).

Tolerance: DENSE_RTOL (test_e2e_parity), float32 sums taken in another order. The MoE model trains
without the auxiliary loss, so its layouts compute the same maths as one process (see MOE_RTOL there).
"""

from __future__ import annotations

import pytest

from polyshard.trainer.config import from_dict
from tests.trainer._short import short_training
from tests.trainer.test_e2e_parity import DENSE_RTOL, STEPS, _train

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
            "training": short_training(STEPS, weight_decay=0.1),
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
        }
    )


@pytest.fixture(scope="module")
def reference(distributed, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    return {model: distributed.run(1, _train, _config(corpus, model), out)[0] for model in MODELS}


LONG = pytest.mark.long
LAYOUTS = [
    pytest.param("qwen3", 2, {"tp": 2}, id="qwen3-tp2"),
    pytest.param("qwen3", 2, {"tp": 2, "sequence_parallel": True}, id="qwen3-tp2-sp"),
    pytest.param("qwen3", 2, {"cp": 2}, id="qwen3-cp2"),
    pytest.param("qwen3", 4, {"tp": 4}, id="qwen3-tp4-kv-replicated", marks=LONG),
    pytest.param("qwen3", 2, {"pp": 2, "microbatches": 2}, id="qwen3-pp2", marks=LONG),
    pytest.param("qwen3", 4, {"cp": 2, "tp": 2, "sequence_parallel": True}, id="qwen3-cp2xtp2-sp", marks=LONG),
    pytest.param("qwen2-moe", 2, {"ep": 2}, id="qwen2-moe-ep2"),
    pytest.param("qwen2-moe", 2, {"tp": 2}, id="qwen2-moe-tp2"),
    pytest.param("qwen2-moe", 4, {"ep": 2, "tp": 2}, id="qwen2-moe-ep2xtp2", marks=LONG),
    pytest.param("qwen2-moe", 4, {"ep": 2, "pp": 2, "microbatches": 2}, id="qwen2-moe-ep2xpp2", marks=LONG),
    pytest.param("qwen2-moe", 4, {"dp": 2, "ep": 2, "zero_stage": 1}, id="qwen2-moe-dp2xep2-zero1", marks=LONG),
]  # fmt: skip


@pytest.mark.parametrize("model, world, parallel", LAYOUTS)
def test_qwen_layers_train_as_on_one_process(distributed, corpus, reference, tmp_path, model, world, parallel):
    results = distributed.run(world, _train, _config(corpus, model, **parallel), tmp_path)
    assert all(r == results[0] for r in results)
    assert results[0] == pytest.approx(reference[model], rel=DENSE_RTOL)  # losses and pre-clip grad norms
    assert results[0][STEPS - 1] < results[0][0]  # it learns


@pytest.mark.parametrize(
    "model, message",
    [
        ({"kind": "moe-gpt", "moe": {"shared_gate": True}}, "model.moe.shared_gate gates the shared experts: set"),
        ({"head_dim": 0}, "model.head_dim=0"),
        ({"expert_hidden": 8}, "model.expert_hidden is not a setting of model.kind='gpt'"),
        ({"kind": "moe-gpt", "moe": {"shared_experts": -1}}, "model.moe.shared_experts"),
        ({"kind": "moe-gpt", "moe": {"ffn_hidden": 0}}, "model.moe.ffn_hidden=0"),
        ({"positions": "rope", "head_dim": 7}, r"the head dim \(model.head_dim, or hidden/num_heads\)=7 must be even"),
        ({"kind": "moe-gpt", "moe": {"shared_experts": 1, "shared_ffn_hidden": 33}, "tp": 2}, "does not divide the MLP"),
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
