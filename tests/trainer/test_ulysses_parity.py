"""Ulysses and the 2-D Ulysses x ring scheme in the real training loop, against one process: losses,
pre-clip gradient norms and every parameter after AdamW steps with weight decay (warmup, clipping).
A GPT with 6 heads (so cp = 3 splits them: uneven against the 4-rank rows) and a Llama-like model
(rotary, 4 query heads sharing 2 kv heads, which cp = 4 and tp2 x cp2 replicate). Every gradient under
document masks is tests/trainer/test_documents.py's; the layouts with ep, ZeRO and hybrid sharding are
tests/trainer/test_e2e_parity.py's rows. A checkpoint written under the ring resumes under Ulysses.
"""

import dataclasses

import pytest
import torch

from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from polyshard.trainer.errors import ConfigError
from polyshard.trainer.loop import train
from tests._layouts import LAYOUTS, LONG, layout
from tests._short import short_run

STEPS = 4
# Layouts differ from one process in the order float32 sums are taken (all-reduces of gradients over
# cp, tp's split matmuls, SDPA on fewer heads): ~1e-7 relative per operation, compounded over a few
# AdamW steps, as tests/trainer/test_e2e_parity.py's DENSE_RTOL.
DENSE_RTOL = 2e-5
# Parameters after the steps: AdamW divides by the root of the second moment, which magnifies round-off
# where a gradient is near zero (a bias's); test_muon.py measured ~3e-6 after six steps. 2e-5 is far
# below what the steps move each parameter (lr 1e-3-sized updates, checked below).
PARAM_ATOL = 2e-5

LLAMA = {"norm": "rms", "activation": "swiglu", "positions": "rope", "bias": False, "num_kv_heads": 2}
MODELS = {
    "gpt": {"hidden": 48, "num_heads": 6},
    "llama": {"hidden": 32, "num_heads": 4, "mlp_hidden": 88, **LLAMA},
}


def _config(corpus, model, **parallel):
    return from_dict(
        {
            "model": {"num_layers": 2, "context_length": 24, **MODELS[model]},
            "parallel": parallel,
            **short_run(STEPS, weight_decay=0.1),
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
        }
    )


def _train(config, out):
    from polyshard.trainer.checkpointing.run_export import consolidate

    result = train(config, Mesh(config.parallel.mesh_axes), out, log=False)
    params = consolidate(sorted((out / "checkpoints").iterdir())[-1]) if torch.distributed.get_rank() == 0 else None
    return result.losses + result.grad_norms, params


@pytest.fixture(scope="module")
def reference(distributed, corpus, tmp_path_factory):
    return {
        model: distributed.run(1, _train, _config(corpus, model), tmp_path_factory.mktemp(model))[0] for model in MODELS
    }


ROWS = [
    layout("cp2-ulysses", model="gpt"),
    layout("cp3-ulysses", model="gpt"),
    layout("cp2-ulysses", model="llama"),
    layout("cp4-ulysses", model="llama"),  # 2 kv heads on 4 ranks: replicated
    layout("cp2xtp2-ulysses", model="llama"),
    layout("cp2x2-ulysses-ring", model="llama"),
    layout("cp2x2-ulysses-ring", LONG, model="gpt"),
]


@pytest.mark.parametrize("model, layout_name", ROWS)
def test_ulysses_training_matches_one_process(distributed, corpus, reference, tmp_path, model, layout_name):
    world, parallel = LAYOUTS[layout_name]
    results = distributed.run(world, _train, _config(corpus, model, **parallel), tmp_path)
    assert all(r[0] == results[0][0] for r in results)  # every rank logs the same losses and norms
    (curves, params), (ref_curves, ref_params) = results[0], reference[model]
    assert curves == pytest.approx(ref_curves, rel=DENSE_RTOL)  # losses and pre-clip gradient norms
    assert set(params) == set(ref_params)
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=0, atol=PARAM_ATOL, msg=lambda m, n=name: f"{n}: {m}")
    torch.manual_seed(0)
    initial = dict(_initial(model).named_parameters())
    moved = max(float((ref_params[n] - initial[n].detach()).abs().max()) for n in ref_params if n in initial)
    assert moved > 50 * PARAM_ATOL  # the tolerance is far below what training moved


def _initial(model):
    from polyshard.models import build_model

    config = from_dict({"model": {"num_layers": 2, "context_length": 24, **MODELS[model]}})
    return build_model(config.model, seed=from_dict({}).training.seed)


def _ring_then_ulysses(config, out):
    mesh = Mesh(config.parallel.mesh_axes)
    whole = train(config, mesh, out / "whole", log=False).losses
    half = dataclasses.replace(config, training=dataclasses.replace(config.training, steps=STEPS // 2))
    train(half, mesh, out / "split", log=False)
    ulysses = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, cp_style="ulysses"))
    resumed = train(ulysses, mesh, out / "split", log=False, resume=True).losses
    return whole, resumed


def test_a_ring_checkpoint_resumes_under_ulysses(distributed, corpus, tmp_path):
    # Checkpoints hold parameters and optimizer state, no activation: the style is free to change.
    config = _config(corpus, "llama", cp=2)
    for whole, resumed in distributed.run(2, _ring_then_ulysses, config, tmp_path):
        assert resumed[: STEPS // 2] == whole[: STEPS // 2]  # the first half is the ring run's own log
        assert resumed == pytest.approx(whole, rel=DENSE_RTOL)  # the second half: another summation order


def test_heads_that_do_not_split_are_refused_with_the_sizes_that_do():
    from polyshard.trainer.engine.constraints import validate

    with pytest.raises(
        ConfigError, match=r"parallel.cp=4 with cp_style 'ulysses'.*6 query and 6 key/value.*\[1, 2, 3, 6\]"
    ):
        validate(_config("x", "gpt", cp=4, cp_style="ulysses"))
    with pytest.raises(ConfigError, match=r"cp_style 'ulysses\+ring' with cp_ulysses in \[2\]"):
        validate(_config("x", "gpt", cp=4, cp_style="ulysses"))
    with pytest.raises(ConfigError, match=r"needs parallel.cp_ulysses.*choose cp_ulysses in \[2\]"):
        _config("x", "llama", cp=4, cp_style="ulysses+ring")
    with pytest.raises(ConfigError, match=r"cp_ulysses=2 applies to cp_style 'ulysses\+ring' only"):
        _config("x", "llama", cp=4, cp_ulysses=2)
