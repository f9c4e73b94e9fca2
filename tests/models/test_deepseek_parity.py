"""Training parity for DeepSeek-V3's model: multi-head latent attention (the down projections and their
norms whole on every tp rank with their gradients summed over tp, heads split; cp carrying keys and values
whose head dims differ), a dense first block beside MoE blocks (sigmoid scores, a selection bias moved by the
global load after each step, two groups, a shared expert). Each layout runs the real training loop (6 AdamW
steps with weight decay, warmup, clipping) and is compared with one process: losses and pre-clip gradient
norms, every gradient of the first step (as the optimizer reads it: reduced, clipped), every parameter and
every router's selection bias after the last step (tests/_layouts.py's runner: whole tensors from
each rank's pieces by their placement records, tests/_pieces.py).

Tolerances: DENSE_RTOL (test_e2e_parity) for the numbers, the ones below for the tensors: float32 sums
taken in another order. The MoE model trains without balance losses (the selection bias balances it, from
counts that are exact on every layout), so its layouts compute the same maths as one process. tp2 + SP here
runs the same attention with every block dense; with experts it is tests/trainer/test_sequence_parallel_experts.py's.
"""

from __future__ import annotations

import functools

import pytest

from polyshard.trainer.config import from_dict
from tests._layouts import LONG, Tolerance, layout
from tests._short import short_run
from tests.trainer.test_e2e_parity import DENSE_RTOL, STEPS

# Gradients of the first step (reduced and clipped, as the optimizer reads them): float32 sums taken in
# another order (all-reduces, sharded matmuls, the ring's online softmax) move each by ~1e-7 relative;
# measured here at most 5e-8 absolute (the head's weight), a tenth of atol.
GRAD_TOL = {"rtol": 2e-5, "atol": 5e-7}
# Parameters after 6 AdamW steps: AdamW divides each gradient by its own running magnitude, so an element
# whose gradient is float32 noise takes a step of up to lr (1e-3) set by that noise; measured here at
# most 2e-6 absolute (an MLA up projection on ep2 x pp2). Weight decay 2.0 moves every decayed matrix by
# lr x 2.0 x |p| ~ 4e-5 to 1e-4 a step, five to ten times atol: a rank that missed the decay on one step
# (a ZeRO shard, an ep rank's experts, an expert no token reached) shows.
PARAM_TOL = {"rtol": 2e-5, "atol": 8e-6}
# The routers' selection bias moves by bias_update_rate x sign(load error) from token counts, which are
# exact integers on every layout: equal bit for bit (a token routed elsewhere would move it by 0.02).
BIAS_TOL = {"rtol": 0.0, "atol": 0.0}

MLA = {
    "kind": "deepseek-v3", "hidden": 32, "num_layers": 3, "num_heads": 4, "context_length": 16, "mlp_hidden": 48,
    "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
    "rope": {"factor": 4.0, "original_context": 8, "mscale": 1.0, "mscale_all_dim": 1.0},
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
            **short_run(STEPS, weight_decay=2.0),
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
        }
    )


TOLERANCE = Tolerance(numbers=DENSE_RTOL, grads=GRAD_TOL, params=PARAM_TOL, buffers=BIAS_TOL)
LAYOUTS = [
    layout("dp2-zero3", model="deepseek"),
    layout("ep2xpp2", model="deepseek"),
    layout("cp2xep2", model="deepseek"),
    # Before: the blocks' norms under SP were not flagged, so each tp rank stepped them with its own sequence
    # shard's part of their gradient (4e-3 off after 6 steps); losses and gradient norms agreed to 4e-6
    layout("tp2-sp", model="deepseek-dense"),
    layout("tp2", LONG, model="deepseek"),
    layout("ep2xtp2", LONG, model="deepseek"),
]


@pytest.mark.parametrize("model, name", LAYOUTS)
def test_deepseek_trains_as_on_one_process(parity, corpus, tmp_path, model, name):
    compared = parity.check(name, functools.partial(_config, corpus, model), TOLERANCE, tmp_path)
    if model == "deepseek":  # both MoE blocks' selection bias, compared bit for bit
        assert sum(n.endswith("router.bias") for n in compared.names["buffers"]) == 2
