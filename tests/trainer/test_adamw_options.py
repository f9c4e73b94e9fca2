"""optimizer.adamw_impl (torch's AdamW kernels) and optimizer.weight_decay_params ("matrices" or "all").

A layout with either setting matches one process training with a plain ``torch.optim.AdamW`` built with
the same choice (one process, no ZeRO: the trainer steps torch's AdamW itself).
"""

import pytest
import torch

from polyshard.mesh import Mesh
from polyshard.models.spec import decays
from polyshard.trainer.config import from_dict
from polyshard.trainer.engine.optimizer import ADAMW_KERNELS, decay_rule, param_groups
from tests._layouts import LAYOUTS, LONG, trained_numbers
from tests._short import short_run

STEPS = 5
# As the end-to-end parity tests: layouts differ from one process only in the order float32 sums are
# taken (all-reduces, sharded matmuls, the vocabulary-parallel softmax), ~1e-7 per step, compounded.
RTOL = 2e-5


def _config(corpus, impl, params, **parallel):
    return from_dict(
        {
            "model": {
                "hidden": 32,
                "num_layers": 2,
                "num_heads": 4,
                "context_length": 16,
                "norm": "rms",
                "activation": "swiglu",
                "positions": "rope",
                "bias": False,
                "mlp_hidden": 88,
            },  # fmt: skip
            "parallel": parallel,
            # A strong decay, so decaying the norms and embeddings too moves the losses well past RTOL.
            # 6 examples a step: 3 data ranks take 2 each.
            **short_run(
                STEPS, training={"global_batch_size": 6}, adamw_impl=impl, weight_decay_params=params, weight_decay=0.5
            ),
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
        }
    )


def _built_optimizer(config):
    from polyshard.trainer.engine.builder import build_engine

    engine = build_engine(config, Mesh(config.parallel.mesh_axes))
    optimizer = engine.optimizers[0]
    inner = getattr(optimizer, "optimizer", optimizer)  # ZeroOptimizer wraps torch's AdamW
    return (
        type(inner).__name__,
        inner.defaults["foreach"],
        inner.defaults["fused"],
        [len(g["params"]) for g in inner.param_groups if g["weight_decay"] == 0.0],
    )


def test_the_kernel_and_the_decayed_parameters_reach_torchs_adamw(distributed, corpus):
    kind, foreach, fused, undecayed = distributed.run(1, _built_optimizer, _config(corpus, "fused", "all"))[0]
    assert (kind, foreach, fused, undecayed) == ("AdamW", None, True, [0])  # every parameter decays
    kind, foreach, fused, undecayed = distributed.run(1, _built_optimizer, _config(corpus, "for-loop", "matrices"))[0]
    assert (kind, foreach, fused) == ("AdamW", False, None) and undecayed[0] > 0  # norms and embeddings do not


def test_all_decays_every_parameter_and_matrices_only_the_blocks_and_head():
    named = [("layers.0.tok.weight", torch.nn.Parameter(torch.ones(4, 2))),
             ("layers.1.norm1.weight", torch.nn.Parameter(torch.ones(2))),
             ("layers.1.attn.q_proj.weight", torch.nn.Parameter(torch.ones(2, 2)))]  # fmt: skip
    train_all = from_dict({"optimizer": {"weight_decay_params": "all"}}).optimizer
    train_matrices = from_dict({}).optimizer
    assert [len(g["params"]) for g in param_groups(named, 0.1, decay_rule(train_all, decays))] == [3, 0]
    assert [len(g["params"]) for g in param_groups(named, 0.1, decay_rule(train_matrices, decays))] == [1, 2]
    assert set(ADAMW_KERNELS) == {"auto", "foreach", "fused", "for-loop"}


@pytest.fixture(scope="module")
def references(distributed, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    settings = [("fused", "all"), ("for-loop", "all"), ("foreach", "matrices")]
    return {s: distributed.run(1, trained_numbers, _config(corpus, *s), out)[0] for s in settings}


def test_the_settings_change_the_numbers_they_should_and_no_other(references):
    fused, loop, matrices = (
        references[("fused", "all")],
        references[("for-loop", "all")],
        references[("foreach", "matrices")],
    )
    # Kernels compute the same AdamW: one order of float32 operations apart.
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(loop), rtol=RTOL, atol=0)
    # Decaying everything (norms, embeddings) at 0.5 moves the losses of steps 2-5 well past the tolerance.
    assert max(abs(a - b) / abs(b) for a, b in zip(fused[1:STEPS], matrices[1:STEPS])) > 10 * RTOL


ROWS = [
    pytest.param("dp2-zero1", ("fused", "all"), id="dp2-zero1-fused-all"),
    pytest.param("tp2", ("for-loop", "all"), id="tp2-forloop-all"),
    pytest.param("dp3-zero2", ("foreach", "matrices"), id="dp3-zero2-foreach", marks=LONG),
]


@pytest.mark.parametrize("name, setting", ROWS)
def test_a_layout_matches_one_process_with_the_same_adamw(distributed, corpus, references, tmp_path, name, setting):
    world, parallel = LAYOUTS[name]
    got = distributed.run(world, trained_numbers, _config(corpus, *setting, **parallel), tmp_path)[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(references[setting]), rtol=RTOL, atol=0)
