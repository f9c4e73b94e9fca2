"""A tiny gpt-oss (sinks, a 5-token window alternating with full attention, YaRN, biased attention, a biased
top-2 router over 4 biased clamped-SwiGLU experts) trained from scratch with document masks on tp2, tp2 +
sequence parallelism, ep2, cp2 (ring) and dp2 with ZeRO-3 against one process on the same batches: every
loss and gradient norm of a few AdamW steps with weight decay, every gradient of the first step, and every
parameter after the last (the harness and its tolerances are tests/models/test_windows.py's)."""

import pytest

from polyshard.trainer.config import from_dict
from tests._layouts import LONG, layout
from tests.models.test_windows import CONTEXT, ROWS, TOLERANCE, VOCAB, _train

MODEL = {
    "kind": "gpt-oss", "vocab_size": VOCAB, "context_length": CONTEXT, "hidden": 32, "num_layers": 2,
    "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "sliding_window": 5,
    "layer_types": ["sliding_attention", "full_attention"], "rope": {"factor": 4.0, "original_context": 8},
    # Every rank's balancing loss is over its own tokens (as on each data rank of any MoE), so a layout that
    # splits the batch computes another aux loss than one process: off, as transformers trains gpt-oss.
    "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden": 16, "aux_loss_coef": 0.0},
}  # fmt: skip


def _config(**parallel):
    return from_dict(
        {
            "model": MODEL,
            "parallel": parallel,
            "training": {"global_batch_size": ROWS},
            "optimizer": {"weight_decay": 0.1},
            "data": {"document_mask": True},
        }
    )


LAYOUTS = [
    layout("tp2"),
    layout("ep2"),
    layout("dp2-zero3"),
    layout("cp2-ring"),  # the window crosses the chunks; sinks summed over cp
    layout("ep2xpp2", LONG),
    layout("cp2xep2", LONG),
    # each tp rank routes its sequence shard; router, experts and their biases summed over tp
    layout("tp2-sp"),
]


@pytest.mark.parametrize("name", LAYOUTS)
def test_gpt_oss_trains_as_on_one_process(parity, tmp_path, name):
    # test_windows' harness and tolerances; its batches are random tokens, so the losses need not fall
    compared = parity.check(name, _config, TOLERANCE, tmp_path, worker=_train, learns=False)
    expected = {"layers.1.attn.sinks", "layers.1.mlp.moe.router.logit_bias", "layers.1.mlp.moe.experts.w1_bias"}
    assert expected <= set(compared.names["params"])
