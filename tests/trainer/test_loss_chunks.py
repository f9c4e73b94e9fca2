"""training.loss_chunks: the head's projection and the cross-entropy in chunks of tokens train the same
numbers as the whole logits, on one process and on tp (vocabulary-parallel) and pp (the last stage)."""

import pytest
import torch

from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from polyshard.trainer.engine.constraints import validate
from polyshard.trainer.errors import ConfigError
from polyshard.trainer.loop import train
from tests.trainer._short import short_training

STEPS = 4
# Chunked sums and the vocabulary-parallel softmax take float32 sums in another order: ~1e-7 relative per
# step, compounded over a few AdamW steps (the end-to-end parity tests' tolerance).
RTOL = 2e-5


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
            "training": short_training(STEPS, loss_chunks=chunks),
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
        }
    )


def _train(config, out):
    result = train(config, Mesh(config.parallel.mesh_axes), out, log=False)
    return result.losses + result.grad_norms  # the norm sees a gradient the losses would not


@pytest.fixture(scope="module")
def whole(distributed, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    return {tie: distributed.run(1, _train, _config(corpus, 0, tie), out)[0] for tie in (False, True)}


LAYOUTS = [
    pytest.param(1, {}, False, id="one-process"),
    pytest.param(1, {}, True, id="one-process-tied"),
    pytest.param(2, {"tp": 2}, False, id="tp2"),
    pytest.param(2, {"tp": 2, "sequence_parallel": True}, True, id="tp2-sp-tied"),
    pytest.param(2, {"pp": 2, "microbatches": 2}, False, id="pp2"),
    # three uneven stages, the tied head's copy on the last: make test-long (the suite's time)
    pytest.param(
        3,
        {"pp": 3, "microbatches": 2, "stage_layers": [2, 1, 1], "zero_stage": 1},
        True,
        id="pp3-tied",
        marks=pytest.mark.long,
    ),
]


@pytest.mark.parametrize("world, parallel, tie", LAYOUTS)
def test_chunked_loss_trains_the_numbers_of_the_whole_logits(distributed, corpus, whole, tmp_path, world, parallel,
                                                             tie):  # fmt: skip
    got = distributed.run(world, _train, _config(corpus, 3, tie, **parallel), tmp_path)[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(whole[tie]), rtol=RTOL, atol=0)


def test_chunks_need_a_language_model_and_a_head_zero3_leaves_whole(corpus):
    with pytest.raises(ConfigError, match="after ZeRO-3 has freed it"):
        validate(_config(corpus, 4, dp=2, zero_stage=3))
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
