"""Training parity for DeepSeek-V3's model: multi-head latent attention (the down projections and their
norms whole on every tp rank with their gradients summed over tp, heads split; cp carrying keys and values
whose head dims differ), a dense first block beside MoE blocks (sigmoid scores, a selection bias moved by the
global load after each step, two groups, a shared expert). Each layout runs the real training loop (6 AdamW
steps with weight decay, warmup, clipping) and is compared with one process: losses and pre-clip gradient
norms, every gradient of the first step (as the optimizer reads it: reduced, clipped), every parameter and
every router's selection bias after the last step. Whole tensors come from each rank's pieces by their
placement records (tests/trainer/_pieces.py).

Tolerances: DENSE_RTOL (test_e2e_parity) for the numbers, the ones below for the tensors: float32 sums
taken in another order. The MoE model trains without balance losses (the selection bias balances it, from
counts that are exact on every layout), so its layouts compute the same maths as one process. tp2 + SP here
runs the same attention with every block dense; with experts it is tests/trainer/test_sequence_parallel_experts.py's.
"""

from __future__ import annotations

import pytest
import torch

from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from polyshard.trainer.loop import Hook, Trainer
from tests.trainer._pieces import assemble, buffer_pieces, gradient_pieces, parameter_pieces, where
from tests.trainer._short import short_training
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
            "training": short_training(STEPS, weight_decay=2.0),
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
        }
    )


class _FirstGradients(Hook):
    """Keeps this rank's pieces of the first step's gradients, as the optimizer read them."""

    def __init__(self) -> None:
        self.engine = None
        self.pieces: list = []

    def before_zero_grad(self, step: int) -> None:
        if step == 1:
            self.pieces = gradient_pieces(self.engine)


def _train(config, out):
    mesh = Mesh(config.parallel.mesh_axes)
    first = _FirstGradients()
    trainer = Trainer(config, mesh, out, log=False, hooks=[first])
    first.engine = trainer.engine
    result = trainer.run()
    return {
        **where(mesh),
        # losses alone would not see a gradient scaled by a constant (AdamW and clipping normalise it away)
        "numbers": result.losses + result.grad_norms,
        "grads": first.pieces,
        "params": parameter_pieces(trainer.engine),
        "buffers": buffer_pieces(trainer.engine),
    }


@pytest.fixture(scope="module")
def reference(distributed, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    return {model: distributed.run(1, _train, _config(corpus, model), out) for model in MODELS}


LONG = pytest.mark.long
LAYOUTS = [
    pytest.param("deepseek", 2, {"dp": 2, "zero_stage": 3}, id="dp2-zero3"),
    pytest.param("deepseek", 4, {"ep": 2, "pp": 2, "microbatches": 2}, id="ep2xpp2"),
    pytest.param("deepseek", 4, {"cp": 2, "ep": 2}, id="cp2xep2"),
    # Before: the blocks' norms under SP were not flagged, so each tp rank stepped them with its own sequence
    # shard's part of their gradient (4e-3 off after 6 steps); losses and gradient norms agreed to 4e-6
    pytest.param("deepseek-dense", 2, {"tp": 2, "sequence_parallel": True}, id="dense-tp2-sp"),
    pytest.param("deepseek", 2, {"tp": 2}, id="tp2", marks=LONG),
    pytest.param("deepseek", 4, {"ep": 2, "tp": 2}, id="ep2xtp2", marks=LONG),
]  # fmt: skip


@pytest.mark.parametrize("model, world, parallel", LAYOUTS)
def test_deepseek_trains_as_on_one_process(distributed, corpus, reference, tmp_path, model, world, parallel):
    results = distributed.run(world, _train, _config(corpus, model, **parallel), tmp_path)
    numbers = results[0]["numbers"]
    assert all(r["numbers"] == numbers for r in results)
    assert numbers == pytest.approx(reference[model][0]["numbers"], rel=DENSE_RTOL)  # losses, pre-clip norms
    assert numbers[STEPS - 1] < numbers[0]  # it learns
    for key, tolerance in (("grads", GRAD_TOL), ("params", PARAM_TOL), ("buffers", BIAS_TOL)):
        got, expected = assemble(results, key), assemble(reference[model], key)
        assert set(got) == set(expected)  # every tensor, under the model's names
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, **tolerance, msg=lambda m, k=key, n=name: f"{k} {n}: {m}")
