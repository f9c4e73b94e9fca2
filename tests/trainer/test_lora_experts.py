"""``lora.experts``: adapters on the routed experts themselves (one per expert and matrix, stacked like the
experts and split over ep with them) train alike on one process and on ep2, dp2 x ep2 with ZeRO-1, tp2 and
(long) ep2 x tp2 + SP (tests/_layouts.py's runner): losses, every adapter gradient of the first step,
every adapter after AdamW steps with weight decay; the frozen base, experts included, exactly as built."""

import functools

import pytest
import torch

from polyshard.models import build_model
from polyshard.models.common.lora import is_adapter, is_expert_adapter
from polyshard.trainer.config import from_dict
from tests._layouts import LONG, assemble, layout
from tests._short import SMALL_LLAMA, short_run
from tests.trainer.test_lora_parity import STEPS, TOLERANCE

EXPERTS, BLOCKS = 4, 2


def _config(corpus, **parallel):
    # A Qwen3-MoE-shaped model (q/k norms, 4 swiglu experts, top-2, no shared expert; no aux loss, whose
    # per-rank statistics differ by layout): adapters on attention and every routed expert's gate, up, down.
    moe = {"num_experts": EXPERTS, "top_k": 2, "aux_loss_coef": 0.0, "shared_experts": 0}
    return from_dict(
        {
            "model": {"hidden": 32, "num_layers": BLOCKS, "num_heads": 4, "context_length": 16, **SMALL_LLAMA}
            | {"kind": "moe-gpt", "qk_norm": True, "moe": moe},
            "parallel": parallel,
            **short_run(STEPS, lr=1e-2, weight_decay=2.0),  # as test_lora_parity, for its reasons
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
            "lora": {"rank": 4, "alpha": 8.0, "targets": "all-linear", "experts": True},
        }
    )


# The tolerance is test_lora_parity's (test_e2e_parity's bounds): only the order of float32 sums differs from
# one process (the all-to-all hands each expert its rows in another order, dp and tp sum gradients).
@pytest.mark.parametrize(
    "name",
    [layout("ep2"), layout("tp2"), layout("dp2xep2-zero1", LONG), layout("ep2xtp2-sp", LONG), layout("pp2-1f1b", LONG)],
)
def test_expert_adapters_train_as_on_one_process(parity, corpus, tmp_path, name):
    config_of = functools.partial(_config, corpus)
    compared = parity.check(name, config_of, TOLERANCE, tmp_path)
    grads = compared.names["grads"]
    assert all(is_adapter(n) for n in grads), [n for n in grads if not is_adapter(n)]
    # w1, w3, w2 of each block's experts: A and B, each compared whole (both ep ranks' experts assembled)
    expected = {f"experts.{w}_lora_{f}" for w in ("w1", "w2", "w3") for f in "AB"}
    experts = [n for n in grads if is_expert_adapter(n)]
    assert len(experts) == BLOCKS * len(expected) and {n.split(".mlp.moe.")[1] for n in experts} == expected, grads
    config = config_of()
    built = dict(build_model(config.model, seed=config.training.seed).named_parameters())
    for results in (compared.results, parity.reference(config)):
        after = assemble(results, "params")
        experts = [n for n in after if is_expert_adapter(n) and n.endswith("_lora_B")]
        assert experts and all(after[n].abs().sum() > 0 for n in experts), "an expert adapter did not train"
        assert after[experts[0]].shape[0] == EXPERTS  # every expert's adapter, gathered from its ep rank
        frozen = [n for n in after if not is_adapter(n)]
        assert any(".experts.w" in n for n in frozen)
        assert frozen and all(torch.equal(after[n], built[n]) for n in frozen)
