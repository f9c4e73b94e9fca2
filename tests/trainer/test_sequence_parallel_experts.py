"""Sequence parallelism with experts (issue 36): each tp rank routes the sequence shard it holds at the MLP,
exchanges it over its ep group and keeps the output sequence-sharded; the router and experts, replicated
over tp, get their gradients summed over tp; the balance losses, the capacity rule and the selection
bias's load are the whole sequences'. Trained on tp2 + SP (and ep2 x tp2 + SP) against one process on the
same batches with the harness of tests/models/test_windows.py: every loss and gradient norm of a few
AdamW steps with weight decay, every gradient of the first step, every parameter after the last.

Models: a Qwen2-MoE-like tiny (a gated shared expert, Switch balance loss and z-loss), the same with a
capacity factor that drops assignments, and DeepSeek-V3's (MLA, a dense first block, sigmoid scores in
groups, a shared expert, the sequence-wise balance loss and the selection bias moved by the load).
gpt-oss's tp2 + SP row is in tests/models/test_gpt_oss_training.py. The selection bias and the load
metrics are compared exactly (the bias is a buffer, and a load counted on one tp rank only moves it in
the same directions here, so the parity rows alone would not see it).

Tolerances: test_windows' (float32 sums in another order; see TOL there). The balance losses are the
whole batch's here as on one process, so they do not loosen them. The ep2 x tp2 row uses DeepSeek's
model, whose balance losses are per sequence (the sequence-wise loss) or none (the Switch loss over a
rank's batch differs from one process's whenever ep splits the batch, SP or not).
"""

import functools

import pytest
import torch

from polyshard.trainer.config import from_dict
from tests._layouts import LONG, layout
from tests.models.test_windows import CONTEXT, ROWS, TOLERANCE, VOCAB, _train

QWEN = {
    "kind": "moe-gpt", "vocab_size": VOCAB, "context_length": CONTEXT, "hidden": 32, "num_layers": 2,
    "num_heads": 4, "num_kv_heads": 2, "norm": "rms", "activation": "swiglu", "positions": "rope", "bias": False,
    "qk_norm": True,
    "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden": 16, "shared_experts": 1, "shared_gate": True,
            "aux_loss_coef": 0.05, "z_loss_coef": 0.01},
}  # fmt: skip
DEEPSEEK = {
    "kind": "deepseek-v3", "vocab_size": VOCAB, "context_length": CONTEXT, "hidden": 32, "num_layers": 2,
    "num_heads": 4, "mlp_hidden": 48, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8, "v_head_dim": 12,
    "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden": 16, "score": "sigmoid", "groups": 2, "group_topk": 1,
            "scale": 2.5, "shared_experts": 1, "bias_update_rate": 0.01, "aux_loss_coef": 0.0,
            "seq_aux_loss_coef": 0.05, "dense_layers": [0]},
}  # fmt: skip
MODELS = {
    "qwen-moe": QWEN,
    # A factor of 1.0 drops some of the 4 x 24 tokens' assignments: which ones depends on the whole batch's order.
    "qwen-moe-capacity": {**QWEN, "moe": {**QWEN["moe"], "capacity_factor": 1.0}},
    "deepseek": DEEPSEEK,
}


def _config(model, **parallel):
    return from_dict(
        {
            "model": MODELS[model],
            "parallel": parallel,
            "training": {"global_batch_size": ROWS},
            "optimizer": {"weight_decay": 0.1},
            "data": {"document_mask": model.startswith("qwen")},  # MLA's attention takes no document mask
        }
    )


SP = {"tp": 2, "sequence_parallel": True}
LAYOUTS = [
    layout("tp2-sp", model="qwen-moe"),
    layout("tp2-sp", model="qwen-moe-capacity"),
    layout("tp2-sp", model="deepseek"),
    layout("ep2xtp2-sp", LONG, model="deepseek"),
    # the token group spans cp x tp; each rank's positions are its SP piece of its cp chunks
    layout("cp2xtp2-sp", LONG, model="qwen-moe-capacity"),
]


@pytest.mark.parametrize("model, name", LAYOUTS)
def test_experts_train_on_sequence_shards_as_on_one_process(parity, tmp_path, model, name):
    # test_windows' harness and tolerances; its batches are random tokens, so the losses need not fall
    config_of = functools.partial(_config, model)
    compared = parity.check(name, config_of, TOLERANCE, tmp_path, worker=_train, learns=False)
    assert any(n.endswith("mlp.moe.router.weight") for n in compared.names["params"])


def _loads(config):
    """Every step's load of each MoE layer (engine.balance: counts summed over the ranks that routed
    different tokens) and each sigmoid router's selection bias after the step, on this rank."""
    from polyshard.mesh import Mesh
    from polyshard.models.common.moe import MoELayer
    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.loop import split_batch, train_step
    from tests.models.test_windows import LR, STEPS, _batch

    par = config.parallel
    mesh = Mesh(par.mesh_axes)
    engine = build_engine(config, mesh)
    data_rank, rows = mesh.group_rank(par.batch_axes), ROWS // par.data_ranks
    out = []
    for step in range(STEPS):
        batch = {k: v[data_rank * rows : (data_rank + 1) * rows] for k, v in _batch(step).items()}
        measured = train_step(engine, *split_batch(config, batch), LR)
        biases = {
            name: module.router.bias.clone()
            for stage in engine.stages.values()
            for name, module in stage.named_modules()
            if isinstance(module, MoELayer)
        }
        out.append((measured.expert_load, biases))
    return out


def test_the_selection_bias_moves_by_the_load_of_every_token_once(distributed):
    # Each tp rank routes its own sequence shard: the load adds every tp rank's counts (once over tp without
    # SP). Integer counts and sign updates: exactly one process's numbers.
    one = distributed.run(1, _loads, _config("deepseek"))[0]
    for steps in distributed.run(2, _loads, _config("deepseek", **SP)):
        for (load, biases), (ref_load, ref_biases) in zip(steps, one):
            assert load == ref_load and all(layer.tokens == ROWS * CONTEXT for layer in load.values())
            assert biases.keys() == ref_biases.keys()
            for name, bias in biases.items():
                assert torch.equal(bias, ref_biases[name]), name
