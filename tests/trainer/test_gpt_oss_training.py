"""A tiny gpt-oss (sinks, a 5-token window alternating with full attention, YaRN, biased attention, a biased
top-2 router over 4 biased clamped-SwiGLU experts) trained from scratch with document masks on tp2, tp2 +
sequence parallelism, ep2, cp2 (ring) and dp2 with ZeRO-3 against one process on the same batches: every
loss and gradient norm of a few AdamW steps with weight decay, every gradient of the first step, and every
parameter after the last (the harness and its tolerances are tests/trainer/test_windows.py's)."""

import pytest
import torch

from polyshard.trainer.config import from_dict
from tests.trainer.test_windows import CONTEXT, LOSS_RTOL, PARAM_ATOL, ROWS, TOL, VOCAB, _assemble, _train

MODEL = {
    "kind": "gpt-oss", "vocab_size": VOCAB, "context_length": CONTEXT, "hidden": 32, "num_layers": 2,
    "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "sliding_window": 5,
    "layer_types": ["sliding_attention", "full_attention"], "rope_scale_factor": 4.0, "rope_original_context": 8,
    # Every rank's balancing loss is over its own tokens (as on each data rank of any MoE), so a layout that
    # splits the batch computes another aux loss than one process: off, as transformers trains gpt-oss.
    "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden": 16, "aux_loss_coef": 0.0},
}  # fmt: skip


def _config(**parallel):
    return from_dict(
        {
            "model": MODEL,
            "parallel": parallel,
            "training": {"global_batch_size": ROWS, "weight_decay": 0.1},
            "data": {"document_mask": True},
        }
    )


@pytest.fixture(scope="module")
def reference(distributed):
    numbers, grads, params, coords = distributed.run(1, _train, _config())[0]
    config = _config()
    return numbers, _assemble([(grads, coords)], config), _assemble([(params, coords)], config)


LAYOUTS = [
    pytest.param(2, {"tp": 2}, id="tp2"),
    pytest.param(2, {"ep": 2}, id="ep2"),
    pytest.param(2, {"dp": 2, "zero_stage": 3}, id="dp2-zero3"),
    pytest.param(2, {"cp": 2}, id="cp2-ring"),  # the window crosses the chunks; sinks summed over cp
    pytest.param(4, {"ep": 2, "pp": 2, "microbatches": 2}, id="ep2xpp2", marks=pytest.mark.long),
    pytest.param(4, {"cp": 2, "ep": 2}, id="cp2xep2", marks=pytest.mark.long),
    # each tp rank routes its sequence shard; router, experts and their biases summed over tp
    pytest.param(2, {"tp": 2, "sequence_parallel": True}, id="tp2-sp"),
]


@pytest.mark.parametrize("world, parallel", LAYOUTS)
def test_gpt_oss_trains_as_on_one_process(distributed, reference, world, parallel):
    config = _config(**parallel)
    results = distributed.run(world, _train, config)
    ref_numbers, ref_grads, ref_params = reference
    assert all(numbers == results[0][0] for numbers, *_ in results)  # every rank reports the same
    assert results[0][0] == pytest.approx(ref_numbers, rel=LOSS_RTOL)  # losses and pre-clip gradient norms
    for which, index, refs, atol in (("gradient", 1, ref_grads, TOL), ("parameter", 2, ref_params, PARAM_ATOL)):
        mine = _assemble([(r[index], r[3]) for r in results], config)
        assert set(mine) == set(refs)
        assert {"layers.1.attn.sinks", "layers.1.mlp.moe.router.logit_bias", "layers.1.mlp.moe.experts.w1_bias"} <= set(
            mine
        )
        for name, tensor in mine.items():
            assert not tensor.isnan().any(), f"{which} {name}: a piece no rank holds"
            torch.testing.assert_close(
                tensor, refs[name], rtol=TOL, atol=atol, msg=lambda m, w=f"{which} {name}": f"{w}: {m}"
            )
