"""LoRA on every linear of a small Llama trains alike on every layout: one process against dp2, ZeRO-1/2/3,
tp2 with and without sequence parallelism, pp2, cp2, and (long) tp2 x pp2 and dp2 x tp2 SP ZeRO-3
(tests/_layouts.py's runner): losses and pre-clip gradient norms, every gradient of the first
step, every parameter after the AdamW steps with weight decay; the frozen base stays exactly as built; a
stopped run resumes bit for bit from a checkpoint holding the adapters and their optimizer state (the base
is named, not saved: tests/trainer/test_lora_checkpoints.py)."""

import dataclasses
import functools

import pytest
import torch

from polyshard.checkpoint import Checkpoint, latest_checkpoint
from polyshard.mesh import Mesh
from polyshard.models import build_model
from polyshard.models.common.lora import is_adapter
from polyshard.trainer.config import from_dict
from tests._layouts import LONG, Tolerance, assemble, layout
from tests._short import SMALL_LLAMA, short_run
from tests.trainer.test_e2e_parity import GRAD_TOL, PARAM_TOL

STEPS = 4
# Only the order of float32 sums differs from one process (all-reduces, sharded matmuls, the
# vocab-parallel softmax, the adapters' r-wide partial sums): test_e2e_parity's bounds, for the same reasons.
TOLERANCE = Tolerance(numbers=2e-5, grads=GRAD_TOL, params=PARAM_TOL)


def _config(corpus, experts=False, **parallel):
    # experts: a Llama-like MoE with a shared expert and no aux loss (whose per-rank statistics differ by
    # layout); the adapters sit on attention and the shared expert, the routed experts stay frozen
    moe = {"kind": "moe-gpt", "moe": {"aux_loss_coef": 0.0, "shared_experts": 1}} if experts else {}
    return from_dict(
        {
            "model": {"hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16, **SMALL_LLAMA, **moe},
            "parallel": parallel,
            # lr 1e-2: adapters start at B = 0 and must move visibly in a few steps; weight decay 2.0: a
            # rank that missed the decay of its adapter shard shows (see test_e2e_parity's PARAM_TOL)
            **short_run(STEPS, lr=1e-2, weight_decay=2.0),
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
            "lora": {"rank": 4, "alpha": 8.0, "targets": "all-linear"},
        }
    )


LAYOUTS = [
    layout("dp2"),
    layout("dp2-zero1"),
    layout("dp2-zero3"),
    layout("tp2"),
    layout("tp2-sp"),
    layout("pp2-1f1b"),
    layout("dp2-zero2"),
    layout("cp2-ring"),
    layout("tp2xpp2", LONG),
    layout("dp2xtp2-sp-zero3", LONG),
]


@pytest.mark.parametrize("name", LAYOUTS)
def test_lora_trains_as_on_one_process(parity, corpus, tmp_path, name):
    config_of = functools.partial(_config, corpus)
    compared = parity.check(name, config_of, TOLERANCE, tmp_path)
    adapters = [n for n in compared.names["params"] if is_adapter(n)]
    # Both factors of the 7 linears of each of the 2 blocks are trained and compared.
    assert len(adapters) == 2 * 7 * 2, adapters
    assert {n for n in compared.names["grads"]} == set(adapters), "a frozen weight has a gradient"
    # The frozen base, embeddings, norms and head: exactly as built, here and on one process.
    config = config_of()
    built = dict(build_model(config.model, seed=config.training.seed).named_parameters())
    for results in (compared.results, parity.reference(config)):
        after = assemble(results, "params")
        frozen = [n for n in after if not is_adapter(n)]
        assert frozen and all(torch.equal(after[n], built[n]) for n in frozen)


@pytest.mark.parametrize("name", [layout("ep2"), layout("ep2xtp2-sp", LONG)])
def test_lora_on_a_mixture_of_experts_trains_as_on_one_process(parity, corpus, tmp_path, name):
    compared = parity.check(name, functools.partial(_config, corpus, experts=True), TOLERANCE, tmp_path)
    adapted = {n.rsplit(".", 2)[0] for n in compared.names["grads"]}
    assert all(is_adapter(n) for n in compared.names["grads"]), [
        n for n in compared.names["grads"] if not is_adapter(n)
    ]
    # q, k, v, o and the shared expert's gate, up and down, in both blocks
    assert len(adapted) == 2 * 7 and any(".shared_expert." in n for n in adapted), sorted(adapted)


def _stop_and_resume(config, out):
    """Losses of the whole run, and of its second half resumed from the checkpoint of the first half."""
    from polyshard.trainer.loop import train

    mesh = Mesh(config.parallel.mesh_axes)
    whole = train(config, mesh, out / "whole", log=False).losses
    half = dataclasses.replace(config, training=dataclasses.replace(config.training, steps=STEPS // 2))
    train(half, mesh, out / "split", log=False)
    return whole, train(config, mesh, out / "split", log=False, resume=True).losses


@pytest.mark.parametrize("world, parallel", [(2, {"dp": 2, "zero_stage": 3}), (2, {"tp": 2})], ids=["zero3", "tp2"])
def test_a_lora_run_resumes_exactly(parity, corpus, tmp_path, world, parallel):
    # The checkpoint holds the adapters and their AdamW state; the frozen base is rebuilt from the config.
    config = _config(corpus, **parallel)
    whole, resumed = parity.run(world, config, tmp_path, _stop_and_resume)[0]
    assert resumed == whole  # the resumed run reports the first half from its checkpoint, then its own
    saved = Checkpoint(latest_checkpoint(tmp_path / "split" / "checkpoints"))
    assert saved.params() and all(is_adapter(n) for n in saved.params())
    assert saved.extra()["lora_base"]["source"] == f"init:{config.training.seed}"
    stepped = set(saved.optim_state())
    assert stepped and all(is_adapter(n) for n in stepped)  # optimizer state for the adapters alone


def _collectives(config, adapted):
    """Every collective of one forward and backward of the tp model (``adapted``: with LoRA), by op and
    group: (calls, bytes)."""
    from polyshard.collectives import CommLedger
    from polyshard.tp import parallelize
    from polyshard.trainer.engine.layout import tp_plan
    from polyshard.trainer.engine.lora import apply_lora

    mesh = Mesh(config.parallel.mesh_axes)
    model = build_model(config.model, seed=0)
    parallelize(model, tp_group=mesh.group("tp"), plan=tp_plan(config))
    if adapted:
        apply_lora(model, config)
        # A frozen embedding would spare the first block's input gradient (and its all-reduce) on its own
        model.layers[0].requires_grad_(True)
    tokens = torch.randint(0, config.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with CommLedger() as ledger:
        model(tokens).square().mean().backward()
    return {key: (entry.calls, entry.bytes) for key, entry in ledger.entries.items()}


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_adapters_add_no_collective_under_tp(distributed, corpus, sp):
    # A colwise base's adapter reads its entered input and a rowwise one's joins the partial sums: the
    # forward and backward run the same collectives, of the same sizes, with and without adapters.
    config = _config(corpus, tp=2, sequence_parallel=sp)
    plain, adapted = (
        distributed.run(2, _collectives, config, False)[0],
        distributed.run(2, _collectives, config, True)[0],
    )
    assert plain and adapted == plain
