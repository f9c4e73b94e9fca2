"""Context parallelism on rows shorter than the model's context: cp's positions reach the layers with
each call, worked out from the rows' length, so an evaluation of short rows under cp scores what one
process scores (it failed in rotate when the positions were fixed at build for the whole context)."""

import pytest
import torch

from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from tests._short import SMALL_LLAMA

CONTEXT, SHORT = 32, 8  # rows of 8 tokens: 2 per chunk on cp2 (4 chunks)


def _config(**parallel):
    model = {**SMALL_LLAMA, "preset": "tiny", "context_length": CONTEXT, "vocab_size": 64}
    return from_dict({"model": model, "parallel": parallel, "training": {"seed": 3}})


def _rows():
    return torch.randint(0, 64, (4, SHORT + 1), generator=torch.Generator().manual_seed(5))


def _evaluate(config):
    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.loop import evaluate_batches

    engine = build_engine(config, Mesh(config.parallel.mesh_axes))
    rows = _rows()
    return evaluate_batches(engine, [(rows[:, :-1], rows[:, 1:])])[0]


@pytest.mark.parametrize("style", ["ring", "allgather", "ulysses"])
def test_short_rows_evaluate_on_cp2_as_on_one_process(distributed, style):
    (one,) = distributed.run(1, _evaluate, _config())
    for loss in distributed.run(2, _evaluate, _config(cp=2, cp_style=style)):
        assert loss == pytest.approx(one, rel=1e-5)  # fp32: the cp attention sums its blocks in another order
