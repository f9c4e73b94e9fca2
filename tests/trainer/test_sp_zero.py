"""Sequence parallelism with every ZeRO stage (torchtitan's FSDP + TP + SP, Megatron's distributed
optimizer with SP) trains as on one process.

Under SP a norm's weight (and its bias) sees only this rank's sequence shard, so its gradient must be
summed over tp; ZeRO reduce-scatters gradients over dp during backward and keeps only this rank's rows.
The two sums commute: tp peers hold the same dp coordinate, so the same rows of the same replicated
parameter, and summing those rows over tp after the reduce-scatter equals reduce-scattering the tp sum.
The engine therefore all-reduces, over tp, each sequence-parallel parameter's *shard* as the optimizer
reads it (polyshard.trainer.engine.engine.Engine.finish_gradients): one coalesced all-reduce of the few
norm rows per step, no extra pass over the other gradients. Compared as in tests/trainer/test_e2e_parity.py
(losses, every first-step gradient as the optimizer reads it, every parameter after AdamW with weight
decay), on dense, tied and Llama models, and on hybrid sharding and a pipeline in the long tests.
"""

import dataclasses
import functools

import pytest

from tests._layouts import LONG, layout
from tests.trainer.test_e2e_parity import TOLERANCE, _config, _model

SP_ZERO_LAYOUTS = [
    layout("dp2xtp2-sp-zero1"),
    layout("dp2xtp2-sp-zero2"),
    layout("dp2xtp2-sp-zero3"),
    layout("dp4-shard2xtp2-sp-zero3", LONG),  # hybrid sharding, eight processes
    layout("dp2xtp2-spxpp2-zero3", LONG),  # tp + SP x pp x ZeRO-3, eight processes
]


@pytest.mark.parametrize("name", SP_ZERO_LAYOUTS)
def test_dense_gpt_with_sp_and_zero_trains_as_on_one_process(parity, corpus, tmp_path, name):
    parity.check(name, _model(corpus, "gpt"), TOLERANCE, tmp_path)


def _thirds(corpus, **parallel):
    """The small Llama with every dim ZeRO-3 records a shard of on tp2 x dp3 divisible by 3 (hidden 48, MLP
    96 and vocabulary 384 per two tp ranks), and 12 rows a step for 3 data ranks."""
    config = _config(corpus, llama=True, **parallel)
    model = dataclasses.replace(config.model, hidden=48, mlp_hidden=96, vocab_size=384)
    return dataclasses.replace(config, model=model, training=dataclasses.replace(config.training, global_batch_size=12))


@pytest.mark.long
def test_three_data_ranks_with_sp_and_zero3_train_as_on_one_process(parity, corpus, tmp_path):
    # 6 processes: each norm's 48 rows in three ZeRO shards, summed over the two tp ranks that hold each
    parity.check("dp3xtp2-sp-zero3", functools.partial(_thirds, corpus), TOLERANCE, tmp_path)


# The tied head under pp x ZeRO-3 with SP is the dense row above's pipeline with the tie's pp all-reduce,
# which tests/trainer/test_e2e_parity.py's tied rows cover; here the tie within one stage.
@pytest.mark.parametrize("name", [layout("dp2xtp2-sp-zero3")])
def test_tied_gpt_with_sp_and_zero_trains_as_on_one_process(parity, corpus, tmp_path, name):
    parity.check(name, _model(corpus, "tied"), TOLERANCE, tmp_path)


@pytest.mark.parametrize("name", [layout("dp2xtp2-sp-zero1")])  # ZeRO-3 with SP: the dense and three-rank rows
def test_llama_with_sp_and_zero_trains_as_on_one_process(parity, corpus, tmp_path, name):
    parity.check(name, _model(corpus, "llama"), TOLERANCE, tmp_path)
