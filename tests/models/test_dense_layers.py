"""Layers that differ: an MoE model whose ``model.moe.dense_layers`` keep a dense MLP of their own width
(DeepSeek's dense first blocks, Qwen-MoE's mlp_only_layers). Each layout runs the real training loop
(6 AdamW steps with weight decay, warmup, clipping) and is compared with one process: losses and pre-clip
gradient norms. On pp2 the dense block and the sparse one sit on different stages (the split weighs a
sparse block by the experts a token runs, see test_the_split_weighs_what_a_token_computes); ep places
experts only in the sparse block.

Tolerance: DENSE_RTOL (test_e2e_parity), float32 sums taken in another order. No auxiliary loss, so
every layout computes the same maths as one process (see MOE_RTOL there).
"""

from __future__ import annotations

import pytest

from polyshard.models import build_model, parameter_count
from polyshard.models.moe_gpt.model import MoEMLP
from polyshard.trainer.config import from_dict
from tests._layouts import trained_numbers
from tests._short import SMALL_LLAMA, short_run
from tests.trainer.test_e2e_parity import DENSE_RTOL, STEPS

MODEL = {
    **SMALL_LLAMA, "kind": "moe-gpt", "hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16,
    "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden": 16, "aux_loss_coef": 0.0, "dense_layers": [0],
            "dense_ffn_hidden": 40, "shared_experts": 1},
}  # fmt: skip


def _config(corpus, **parallel):
    return from_dict(
        {
            "model": MODEL,
            "parallel": parallel,
            **short_run(STEPS, weight_decay=0.1),
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
        }
    )


@pytest.fixture(scope="module")
def reference(distributed, corpus, tmp_path_factory):
    return distributed.run(1, trained_numbers, _config(corpus), tmp_path_factory.mktemp("ref"))[0]


LAYOUTS = [
    pytest.param(4, {"ep": 2, "pp": 2, "microbatches": 2}, id="ep2xpp2"),
    pytest.param(2, {"pp": 2, "microbatches": 2}, id="pp2", marks=pytest.mark.long),
    pytest.param(2, {"ep": 2}, id="ep2", marks=pytest.mark.long),
    pytest.param(2, {"tp": 2}, id="tp2", marks=pytest.mark.long),
]


@pytest.mark.parametrize("world, parallel", LAYOUTS)
def test_layers_that_differ_train_as_on_one_process(distributed, corpus, reference, tmp_path, world, parallel):
    results = distributed.run(world, trained_numbers, _config(corpus, **parallel), tmp_path)
    assert all(r == results[0] for r in results)
    assert results[0] == pytest.approx(reference, rel=DENSE_RTOL)  # losses and pre-clip grad norms
    assert results[0][STEPS - 1] < results[0][0]  # it learns


def test_the_blocks_are_built_as_the_list_says(corpus):
    model = _config(corpus).model
    assert [model.sparse_layer(i) for i in range(2)] == [False, True] and model.sparse_layers == [1]
    built = build_model(model)
    assert built.layers[1].mlp.gate_proj.weight.shape == (40, 32)  # dense, dense_ffn_hidden wide
    assert isinstance(built.layers[2].mlp, MoEMLP)
    from polyshard.models.moe_gpt.model import routing_summary

    assert "blocks [0] dense (MLP 40 wide)" in routing_summary(model)  # what --dry-run prints
    # Every block sparse costs 3 x 32 x 16 x 4 expert weights and the router, not a 40-wide SwiGLU.
    all_sparse = from_dict({"model": {**MODEL, "moe": {**MODEL["moe"], "dense_layers": []}}}).model
    difference = parameter_count(all_sparse) - parameter_count(model)
    shared = 3 * 32 * 16  # the shared expert (1 x the experts' width)
    assert difference == 3 * 32 * 16 * 4 + 4 * 32 + shared - 3 * 32 * 40


def test_the_split_weighs_what_a_token_computes(corpus):
    """4 blocks, the first two dense: by total parameters the sparse blocks (4 experts) would weigh
    most, by what a token computes (2 of 4 experts) far less; the split follows the second."""
    from polyshard.models import active_parameter_count
    from polyshard.planner.model_states import global_shapes
    from polyshard.trainer.engine.layout import layer_costs, pipeline_bounds

    moe = {**MODEL["moe"], "num_experts": 16, "dense_layers": [0, 1], "shared_experts": 0}
    config = from_dict({"model": {**MODEL, "num_layers": 4, "moe": moe}, "parallel": {"pp": 2}})
    shapes = dict(global_shapes(config.model))
    total = layer_costs(shapes)
    assert total[3] > 2 * total[1]  # by memory a sparse block is the heaviest
    assert pipeline_bounds(config, shapes) == [range(0, 3), range(3, 6)]  # embedding + 2 dense | 2 sparse + head
    assert active_parameter_count(config.model) < parameter_count(config.model)
    dense = from_dict({"model": {**SMALL_LLAMA, "hidden": 32, "num_layers": 2, "num_heads": 4}}).model
    assert active_parameter_count(dense) == parameter_count(dense)


@pytest.mark.parametrize(
    "moe, message",
    [
        ({"dense_layers": [2]}, r"model.moe.dense_layers=\[2\] names blocks \[2\] past the last block"),
        ({"dense_layers": [0, 1]}, "leaves no block with experts; use model.kind='gpt'"),
        ({"dense_layers": [0, 0]}, "must be a list of distinct block indices"),
        ({"dense_layers": [-1]}, "must be a list of distinct block indices >= 0"),
        ({"dense_layers": "0"}, "model.moe.dense_layers='0' must be a list of integers"),
        ({"dense_ffn_hidden": 0}, "model.moe.dense_ffn_hidden=0 must be an integer >= 1"),
    ],
)
def test_a_bad_list_is_refused_naming_the_field(moe, message):
    from polyshard.trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        from_dict({"model": {**MODEL, "moe": {**MODEL["moe"], **moe}}})


def test_tp_splits_the_dense_blocks_width():
    from polyshard.trainer.engine.constraints import validate
    from polyshard.trainer.errors import ConfigError

    odd = {**MODEL, "moe": {**MODEL["moe"], "dense_ffn_hidden": 41}}
    with pytest.raises(ConfigError, match="41"):
        validate(from_dict({"model": odd, "parallel": {"tp": 2}}), world_size=2)


def test_the_planner_counts_experts_only_in_sparse_blocks():
    """ep's all-to-alls run in the sparse blocks alone, and a dense block keeps a dense MLP's activations."""
    from polyshard.planner.activations import stage_bytes
    from polyshard.planner.comm import microbatch_traffic

    def config(dense_layers):
        model = {**MODEL, "num_layers": 4, "moe": {**MODEL["moe"], "dense_layers": dense_layers}}
        return from_dict({"model": model, "parallel": {"ep": 2}})

    blocks = range(1, 5)
    for dense, sparse in (([], 4), ([0, 1], 2), ([0, 1, 2], 1)):
        a2a = [t for t in microbatch_traffic(config(dense), blocks, 2) if t.op == "all_to_all"]
        assert [t.calls for t in a2a] == [2 * sparse, 2 * sparse]  # dispatch and combine, forward and backward
    assert stage_bytes(config([0, 1]), blocks, 2) != stage_bytes(config([]), blocks, 2)


def test_export_names_the_family_that_has_dense_blocks():
    """Qwen-MoE writes dense blocks (mlp_only_layers); Mixtral has experts in every block, so a model
    with dense blocks that is Mixtral's in every other way is refused, naming moe.dense_layers."""
    from polyshard.checkpoint import CheckpointError
    from polyshard.trainer.checkpointing.hugging_face import hf_config

    qwen = from_dict({"model": {"preset": "qwen3-moe-tiny", "moe": {"dense_layers": [0]}}}).model
    hf = hf_config(qwen)
    assert (hf["model_type"], hf["mlp_only_layers"], hf["decoder_sparse_step"]) == ("qwen3_moe", [0], 1)
    assert hf["intermediate_size"] == qwen.dense_width
    mixtral = from_dict({"model": {"preset": "mixtral-tiny", "moe": {"dense_layers": [0]}}}).model
    with pytest.raises(CheckpointError, match=r"Mixtral would need moe.dense_layers=\[\]"):
        hf_config(mixtral)
