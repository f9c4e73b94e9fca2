"""The layouts the largest published dense runs used are ones the planner can express, and its memory
estimate for each fits their 80 GB GPUs: the TorchTitan paper's Llama 3.1 70B (FSDP x tp 8 with sequence
parallelism) and 405B (FSDP x tp 8 x pp 8) layouts, and Megatron-LM's 530B (tp 8 x pp 35) and 1T (tp 8 x
pp 64) rows, with Megatron's distributed optimizer (ZeRO-1) and sequence parallelism. Each layout is the
one `polyshard plan` ranks first with those axes fixed (the command in each config's header)."""

import dataclasses
from pathlib import Path

import pytest

from polyshard.cli.plan import load_model
from polyshard.planner.search import memory_of
from polyshard.trainer.engine.constraints import validate

CONFIGS = Path(__file__).resolve().parents[2] / "apps" / "configs"
SP = {"tp": 8, "sequence_parallel": True}

PUBLISHED = [
    # (config, devices, parallel, activation checkpointing)
    ("llama-3.1-70b-plan.toml", 256, {**SP, "dp": 32, "zero_stage": 3, "microbatches": 1}, "full"),
    (
        "llama-3-405b-plan.toml",
        512,
        {**SP, "dp": 8, "pp": 8, "zero_stage": 3, "microbatches": 128, "schedule": "zb-h1"},
        "full",
    ),
    (
        "megatron-530b-plan.toml",
        2240,
        {**SP, "dp": 8, "pp": 35, "zero_stage": 1, "microbatches": 320, "schedule": "zb-h1"},
        False,
    ),
    (
        "megatron-1t-plan.toml",
        3072,
        {**SP, "dp": 6, "pp": 64, "zero_stage": 1, "microbatches": 512, "schedule": "1f1b"},
        False,
    ),
]


def _laid_out(name, parallel, recompute):
    config = load_model(str(CONFIGS / name), global_batch=None, seq_len=None, precision=None)
    return dataclasses.replace(
        config,
        parallel=dataclasses.replace(config.parallel, **parallel),
        training=dataclasses.replace(config.training, activation_checkpointing=recompute),
    )


@pytest.mark.parametrize("name, devices, parallel, recompute", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_a_published_layout_is_valid_and_fits_80_gb(name, devices, parallel, recompute):
    config = _laid_out(name, parallel, recompute)
    validate(config, world_size=devices)  # sequence parallelism with ZeRO, pipelines past 32 stages: allowed
    assert config.parallel.world_size == devices
    memory = memory_of(config)
    assert 0 < memory.total < 80e9, f"{name}: {memory.total / 1e9:.1f} GB per rank"


def test_without_sequence_parallelism_the_70b_layout_does_not_fit():
    # the activations tp leaves whole (norms, dropout, the residual) are what SP splits 8 ways
    name, _, parallel, recompute = PUBLISHED[0]
    whole = memory_of(_laid_out(name, {**parallel, "sequence_parallel": False}, recompute)).total
    split = memory_of(_laid_out(name, parallel, recompute)).total
    assert whole > 80e9 > split
