"""training.loss_chunks: the head's projection and the cross-entropy in chunks of tokens train the same
numbers as the whole logits, on one process and on tp (vocabulary-parallel) and pp (the last stage):
losses and pre-clip gradient norms, every gradient of the first step and every parameter after the last
(tests/_layouts.py's runner, against the whole logits on one process)."""

import functools

import pytest
import torch

from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from polyshard.trainer.engine.constraints import validate
from polyshard.trainer.errors import ConfigError
from tests._layouts import LONG, Tolerance, layout
from tests._short import short_run
from tests.trainer.test_e2e_parity import GRAD_TOL, PARAM_TOL

STEPS = 4
# Chunked sums and the vocabulary-parallel softmax take float32 sums in another order: ~1e-7 relative per
# step, compounded over a few AdamW steps (the end-to-end parity tests' tolerance); the tensors' are theirs
# too (test_e2e_parity's GRAD_TOL and PARAM_TOL, for the same reason).
RTOL = 2e-5
TOLERANCE = Tolerance(numbers=RTOL, grads=GRAD_TOL, params=PARAM_TOL)


def _config(corpus, chunks, tie=False, **parallel):
    return from_dict(
        {
            # vocab 259: not a multiple of tp, so the head's padding rows are in every chunk's matmul
            "model": {
                "hidden": 32,
                "num_layers": 2,
                "num_heads": 4,
                "context_length": 16,
                "vocab_size": 259,
                "norm": "rms",
                "activation": "swiglu",
                "positions": "rope",
                "bias": False,
                "mlp_hidden": 88,
                "tie_embeddings": tie,
            },  # fmt: skip
            "parallel": parallel,
            **short_run(STEPS, training={"loss_chunks": chunks}),
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
        }
    )


LAYOUTS = [
    layout("one-process", model="untied"),
    layout("one-process", model="tied"),
    layout("tp2", model="untied"),
    layout("tp2-sp", model="tied"),
    layout("pp2-1f1b", model="untied"),
    # ZeRO-3 keeps the head gathered from its forward through its backward (the loss multiplies by it)
    layout("dp2-zero3", model="untied"),
    layout("dp2-zero3", LONG, model="tied"),  # the tied weight is the root unit's, the head's unit its norm
    layout("dp2xpp2-gpipe-zero3", LONG, model="untied"),
    # three uneven stages, the tied head's copy on the last: make test-long (the suite's time)
    layout("pp3-uneven-zero1", LONG, model="tied"),
]


@pytest.mark.parametrize("head, name", LAYOUTS)
def test_chunked_loss_trains_the_numbers_of_the_whole_logits(parity, corpus, tmp_path, head, name):
    tie = head == "tied"
    chunked = functools.partial(_config, corpus, 3, tie)
    parity.check(name, chunked, TOLERANCE, tmp_path, reference=_config(corpus, 0, tie))


def test_chunks_need_a_language_model(corpus):
    validate(_config(corpus, 4, dp=2, zero_stage=3))  # ZeRO-3 keeps the head gathered through the loss
    vit = from_dict({"model": {"kind": "vit"}, "data": {"source": "digits"}, "training": {"loss_chunks": 2}})
    with pytest.raises(ConfigError, match="model.kind='vit' classifies"):
        validate(vit)
    with pytest.raises(ConfigError, match="training.loss_chunks=-1 must be an integer >= 0"):
        from_dict({"training": {"loss_chunks": -1}})


def _head_and_loss(config):
    from polyshard.trainer.engine.builder import build_engine

    engine = build_engine(config, Mesh(config.parallel.mesh_axes))
    head = engine.stages[0][-1]
    hidden = torch.randn(2, 16, 32)
    targets = torch.randint(0, 259, (2, 16))
    return head.logits, tuple(head(hidden).shape), float(engine.executor.loss_fn(head(hidden), targets))


def test_the_head_hands_its_hidden_states_to_the_chunked_loss(distributed, corpus):
    """What the parity above rests on: with loss_chunks the head stops at its norm and the loss projects."""
    logits, shape, loss = distributed.run(1, _head_and_loss, _config(corpus, 3))[0]
    assert (logits, shape) == (False, (2, 16, 32))  # (B, S, H), not (B, S, V)
    assert 4.0 < loss < 8.0  # about ln(259) = 5.56 for a fresh model: a cross-entropy over the vocabulary
    logits, shape, _ = distributed.run(1, _head_and_loss, _config(corpus, 0))[0]
    assert (logits, shape) == (True, (2, 16, 259))
