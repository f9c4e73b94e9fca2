"""Training parity for DeepSeek-V3's model: multi-head latent attention (the down projections and their
norms whole on every tp rank with their gradients summed over tp, heads split; cp carrying keys and values
whose head dims differ), a dense first block beside MoE blocks (sigmoid scores, a selection bias moved by the
global load after each step, two groups, a shared expert). Each layout runs the real training loop (6 AdamW
steps with weight decay, warmup, clipping) and is compared with one process: losses and pre-clip gradient
norms (a gradient summed over the wrong ranks changes the norm at once).

Tolerance: DENSE_RTOL (test_e2e_parity), float32 sums taken in another order. The MoE model trains without
balance losses (the selection bias balances it, from counts that are exact on every layout), so its layouts
compute the same maths as one process. tp2 + SP here runs the same attention with every block dense; with
experts it is tests/trainer/test_sequence_parallel_experts.py's (every gradient and parameter compared).
"""

from __future__ import annotations

import pytest

from polyshard.trainer.config import from_dict
from tests.trainer._short import short_training
from tests.trainer.test_e2e_parity import DENSE_RTOL, STEPS, _train

MLA = {
    "kind": "deepseek-v3", "hidden": 32, "num_layers": 3, "num_heads": 4, "context_length": 16, "mlp_hidden": 48,
    "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
    "rope_scale_factor": 4.0, "rope_original_context": 8, "rope_mscale": 1.0, "rope_mscale_all_dim": 1.0,
}  # fmt: skip
MOE = {
    "num_experts": 4, "top_k": 2, "ffn_hidden": 16, "score": "sigmoid", "groups": 2, "group_topk": 1, "scale": 2.5,
    "shared_experts": 1, "bias_update_rate": 0.01, "aux_loss_coef": 0.0,
}  # fmt: skip
MODELS = {
    "deepseek": {**MLA, "moe": {**MOE, "dense_layers": [0]}},
    "deepseek-dense": {**MLA, "moe": {"dense_layers": [0, 1, 2]}, "q_lora_rank": None},
}


def _config(corpus, model, **parallel):
    return from_dict(
        {
            "model": MODELS[model],
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
    pytest.param("deepseek", 2, {"dp": 2, "zero_stage": 3}, id="dp2-zero3"),
    pytest.param("deepseek", 4, {"ep": 2, "pp": 2, "microbatches": 2}, id="ep2xpp2"),
    pytest.param("deepseek", 4, {"cp": 2, "ep": 2}, id="cp2xep2"),
    pytest.param("deepseek-dense", 2, {"tp": 2, "sequence_parallel": True}, id="dense-tp2-sp"),
    pytest.param("deepseek", 2, {"tp": 2}, id="tp2", marks=LONG),
    pytest.param("deepseek", 4, {"ep": 2, "tp": 2}, id="ep2xtp2", marks=LONG),
]  # fmt: skip


@pytest.mark.parametrize("model, world, parallel", LAYOUTS)
def test_deepseek_trains_as_on_one_process(distributed, corpus, reference, tmp_path, model, world, parallel):
    results = distributed.run(world, _train, _config(corpus, model, **parallel), tmp_path)
    assert all(r == results[0] for r in results)
    assert results[0] == pytest.approx(reference[model], rel=DENSE_RTOL)  # losses and pre-clip grad norms
    assert results[0][STEPS - 1] < results[0][0]  # it learns
