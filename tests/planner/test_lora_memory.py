"""The planner's model states for a LoRA run equal the bytes real engines hold after a step: adapter-only
gradients and AdamW state, the frozen base's bytes alone (in model.frozen_dtype, or bf16 under mixed
precision; ZeRO-3's rows of it), on each ZeRO stage, tp (with SP) and pp."""

import pytest

from polyshard.planner.model_states import rank_model_states
from polyshard.trainer.config import from_dict
from tests.planner.test_memory import _held_after_a_step


def _config(frozen_dtype=None, precision="fp32", experts=False, **parallel):
    # gpt tiny, vocabulary 250 (ZeRO pads it); adapters on every linear of the blocks (GPT-2's fused
    # c_attn, c_proj, c_fc and the MLP's c_proj), rank 3 so no factor divides 2 evenly; experts: the
    # MoE GPT tiny with adapters on every routed expert too (lora.experts)
    kind = "moe-gpt" if experts else "gpt"
    model = {"kind": kind, "preset": "tiny", "vocab_size": 250, "frozen_dtype": frozen_dtype}
    training = {"global_batch_size": 8, "precision": precision}
    lora = {"rank": 3, "targets": "all-linear", "experts": experts}
    return from_dict({"model": model, "parallel": parallel, "training": training, "lora": lora})


LAYOUTS = [
    (2, {"dp": 2, "zero_stage": 0}),
    (2, {"dp": 2, "zero_stage": 1, "frozen_dtype": "bfloat16"}),
    (2, {"dp": 2, "zero_stage": 2, "precision": "bf16"}),
    (2, {"dp": 2, "zero_stage": 3}),
    (2, {"dp": 2, "zero_stage": 3, "frozen_dtype": "bfloat16"}),
    (2, {"dp": 2, "zero_stage": 3, "precision": "bf16"}),
    (2, {"tp": 2, "sequence_parallel": True, "frozen_dtype": "float16"}),
    (2, {"pp": 2, "microbatches": 2}),
    # the routed experts' adapters split over ep with them (a bf16 base beside them), and whole under tp
    (2, {"ep": 2, "experts": True, "frozen_dtype": "bfloat16"}),
    (2, {"dp": 2, "zero_stage": 1, "experts": True}),
    (2, {"tp": 2, "sequence_parallel": True, "experts": True}),
]


@pytest.mark.parametrize("world, parallel", LAYOUTS, ids=[str(p) for _, p in LAYOUTS])
def test_estimated_lora_model_states_equal_the_bytes_engines_hold(distributed, world, parallel):
    config = _config(**parallel)
    for rank, (measured, estimated) in enumerate(distributed.run(world, _held_after_a_step, config)):
        assert measured == estimated, f"rank {rank} (params, grads, optimizer): {measured} != {estimated}"


def test_lora_model_states_are_the_adapters_and_the_base():
    full = rank_model_states(from_dict({"model": {"kind": "gpt", "preset": "tiny"}, "parallel": {"dp": 2}}), 0)
    lora = rank_model_states(_config(dp=2), 0)
    half = rank_model_states(_config("bfloat16", dp=2), 0)
    # The base's bytes stay; gradients and AdamW's state shrink to the adapters' (a few percent here)
    assert lora.params > full.params and lora.grads < 0.1 * full.grads and lora.optimizer < 0.1 * full.optimizer
    # A bf16 base: its matrices' bytes halve (the norms stay float32), the adapters' states do not change
    assert 0.5 * lora.params < half.params < 0.55 * lora.params
    assert (half.grads, half.optimizer) == (lora.grads, lora.optimizer)


def test_the_dry_run_names_what_a_lora_run_trains():
    from polyshard.models import build_model
    from polyshard.models.common.lora import adapter_parameters
    from polyshard.planner.dry_run import describe
    from polyshard.trainer.engine.lora import apply_lora

    config = _config("bfloat16", dp=2, zero_stage=3)
    model = build_model(config.model, seed=0)
    adapted = apply_lora(model, config)
    trained = sum(p.numel() for p in adapter_parameters(model).values())
    text = describe(config)
    assert f"LoRA rank 3 on {adapted} linears: {trained:,} trainable parameters" in text
    assert "the frozen base's matrices in bfloat16" in text
    states = rank_model_states(config, 0)  # the memory lines are the planner's LoRA figures
    assert f"grads {states.grads / 2**20:,.1f} MiB, optimizer {states.optimizer / 2**20:,.1f} MiB" in text
    # lora.experts: the routed experts' adapters counted too, as the engine builds them
    config = _config(experts=True, ep=2)
    model = build_model(config.model, seed=0)
    apply_lora(model, config)
    trained = sum(p.numel() for p in adapter_parameters(model).values())
    assert f"linears and every routed expert: {trained:,} trainable parameters" in describe(config)


def test_plan_ranks_layouts_for_a_lora_job():
    from polyshard.planner.search import Request, search
    from tests.planner._machine import flat_profile

    # GPT-2 small (163M parameters) on 2 devices: a budget as small as LoRA's leanest ranked layout
    # (the base in bf16, ZeRO-3's rows of it) is far below what AdamW's full states need (8 bytes a
    # parameter at least, ZeRO-3 over 2: 1.3 GB), so the full fine-tune has no layout and LoRA has some
    model = {"preset": "gpt2-124m", "frozen_dtype": "bfloat16"}
    lora = from_dict({"model": model, "training": {"global_batch_size": 8}, "lora": {"rank": 8}})
    roomy = search(lora, Request(devices=2, devices_per_node=2, memory_gb=80.0), flat_profile(), simulated=4)
    assert roomy.ranked and all(c.config.lora == lora.lora for c in roomy.ranked)
    for c in roomy.ranked:  # each layout weighed with LoRA's model states
        heaviest = max((rank_model_states(c.config, r) for r in range(c.config.parallel.pp)), key=lambda s: s.total)
        assert c.memory.states == heaviest
    budget = min(c.memory.total for c in roomy.ranked) * 1.01 / 1e9
    tight = Request(devices=2, devices_per_node=2, memory_gb=budget)
    assert search(lora, tight, flat_profile(), simulated=4).ranked
    full = from_dict({"model": {"preset": "gpt2-124m"}, "training": {"global_batch_size": 8}})
    assert budget < 1.3 and not search(full, tight, flat_profile(), simulated=4).ranked
