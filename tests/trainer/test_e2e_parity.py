"""End-to-end parity: the same small GPT trained on every layout trains as on one process.

Each layout runs the real training loop (data loader, pipeline executor, dp/ZeRO wrappers, tp plan,
clip, AdamW with warmup and weight decay) on live processes and is compared with one process on the same
config by tests/_layouts.py's runner: losses and pre-clip gradient norms, every gradient of the
first step (as the optimizer reads it: reduced, clipped), every parameter after the last step. The global
batch of each step is the same whatever the layout (see polyshard.trainer.data.loader).
"""

import dataclasses
import functools

import pytest
import torch

from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from polyshard.trainer.loop import train
from tests._layouts import LAYOUTS, LONG, Tolerance, layout, trained_numbers, without
from tests._short import SMALL_LLAMA, short_run

STEPS = 6
# Dense layouts differ from one process only in the order float32 sums are taken
# (all-reduces, sharded matmuls, vocab-parallel softmax): ~1e-7 relative per step,
# compounded over a few AdamW steps.
DENSE_RTOL = 2e-5
# MoE load-balancing losses are computed on each data rank's own tokens (as in GShard),
# so their small gradient (coefficient 0.01) differs slightly between layouts: the
# losses agree to ~1e-5 and the gradient norms (which include the aux gradient) to ~1e-3.
# Without the aux loss the layouts compute the same maths and DENSE_RTOL applies.
MOE_RTOL = 2e-4
# Gradients of the first step (reduced and clipped, as the optimizer reads them): float32 sums taken in
# another order (all-reduces, sharded matmuls, the vocab-parallel softmax, the ring's online softmax) move
# each by ~1e-7 relative; measured here at most 9e-8 absolute (pp3-uneven, the ring), a fifth of atol.
GRAD_TOL = {"rtol": 2e-5, "atol": 5e-7}
# Parameters after 6 AdamW steps: AdamW divides each gradient by its own running magnitude, so an element
# whose gradient is float32 noise takes a step of up to lr (1e-3) set by that noise; measured here at most
# 4.2e-6 absolute (dp2 x tp2, tp2 x pp2, cp2 x pp2: half of atol). Weight decay 2.0 (see _config) moves
# every decayed matrix by lr x 2.0 x |p| ~ 4e-5 to 1e-4 a step, five to ten times atol: a rank that missed
# the decay on one step (a ZeRO shard, a stage, an ep rank's experts) shows.
PARAM_TOL = {"rtol": 2e-5, "atol": 8e-6}
TOLERANCE = Tolerance(numbers=DENSE_RTOL, grads=GRAD_TOL, params=PARAM_TOL)


LLAMA = SMALL_LLAMA


def _config(corpus, kind="gpt", aux_loss_weight=0.01, tie_embeddings=False, llama=False, **parallel):
    return from_dict(
        {
            "model": {
                "kind": kind,
                "hidden": 32,
                "num_layers": 2,
                "num_heads": 4,
                "context_length": 16,
                "tie_embeddings": tie_embeddings,
                **({"moe": {"aux_loss_coef": aux_loss_weight}} if kind == "moe-gpt" else {}),
                **(LLAMA if llama else {}),
            },
            "parallel": parallel,
            # weight decay 2.0: a step that missed it on one rank shows in the parameters (see PARAM_TOL)
            **short_run(STEPS, weight_decay=2.0),
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
        }
    )


# The models the parity rows train: keyword arguments of _config.
MODELS = {
    "gpt": {},
    "tied": {"tie_embeddings": True},
    "llama": {"llama": True},
    "moe-gpt": {"kind": "moe-gpt"},
    "moe-gpt-no-aux": {"kind": "moe-gpt", "aux_loss_weight": 0.0},
    "llama-moe": {"kind": "moe-gpt", "llama": True},
}


def _model(corpus, model):
    """``config_of(**parallel)`` for the parity runner: ``model``'s config on those settings."""
    return functools.partial(_config, corpus, **MODELS[model])


def _numbers(parity, corpus, model, **settings):
    """One process's losses and pre-clip gradient norms of ``model`` (the runner's cached reference)."""
    return parity.reference(_config(corpus, **{**MODELS[model], **settings}))[0]["numbers"]


DENSE_LAYOUTS = [
    layout("dp2"),
    layout("tp2"),
    layout("tp2-sp"),
    layout("pp2-1f1b"),
    layout("pp2-zbh1"),
    layout("pp2-interleaved"),
    layout("pp2-zbv"),
    layout("pp2-dualpipev"),
    layout("dp2-zero1"),
    layout("dp2-zero2"),
    layout("dp2-zero3"),
    layout("dp2xtp2"),
    layout("tp2xpp2"),
    layout("tp2xpp2-zbh1", LONG),  # 36 s on the loaded machine
    layout("dp2xtp2xpp2", LONG),
]


@pytest.mark.parametrize("name", DENSE_LAYOUTS)
def test_dense_gpt_trains_as_on_one_process(parity, corpus, tmp_path, name):
    parity.check(name, _model(corpus, "gpt"), TOLERANCE, tmp_path)


TIED_LAYOUTS = [
    layout("tp2"),
    layout("tp2-sp"),
    layout("pp2-1f1b"),
    layout("pp2-interleaved"),
    # the V puts the embedding and the tied head on the same rank, in two stages: two equal copies
    layout("pp2-zbv-m2"),
    layout("tp2xpp2"),
    layout("dp2-zero3"),
    # three stages and fewer microbatches than stages; the tied copies' gradients as ZeRO-1 rows
    layout("pp3-m2-zero1"),
    layout("dp2xpp2-zero2"),
    layout("dp2xtp2xpp2", LONG),  # eight processes on two cores (22 s)
]


@pytest.mark.parametrize("name", TIED_LAYOUTS)
def test_tied_gpt_trains_as_on_one_process(parity, corpus, tmp_path, name):
    # Before: tp untied the pair silently (loss 2.5e-3 and grad norm 0.5% off), pp refused it and
    # ZeRO-3 freed the shared weight after the embedding's forward (a crash in the head).
    parity.check(name, _model(corpus, "tied"), TOLERANCE, tmp_path)


LLAMA_LAYOUTS = [
    layout("dp2"),
    layout("tp2"),  # GQA: one kv head per tp rank
    layout("tp4-sp"),  # 2 kv heads on 4 ranks: replicated
    layout("tp4", LONG),  # tp4-sp (the same 2 kv heads replicated) stays in make test
    layout("tp2-sp"),
    layout("pp2-1f1b"),
    layout("dp2-zero3"),
    # the dense and tied GPTs keep an 8-rank row in make test-long; so does Llama's
    layout("dp2xtp2xpp2", LONG),
    layout("pp3-uneven"),
]


@pytest.mark.parametrize("name", LLAMA_LAYOUTS)
def test_llama_trains_as_on_one_process(parity, corpus, tmp_path, name):
    parity.check(name, _model(corpus, "llama"), TOLERANCE, tmp_path)


def test_llama_moe_matches_one_process(parity, corpus, tmp_path):
    # Llama's attention with SwiGLU experts split over ep, the variant Mixtral made common. The aux loss
    # differs by layout (see MOE_RTOL): losses and gradient norms only.
    results = parity.run(4, _config(corpus, "moe-gpt", llama=True, ep=2, tp=2), tmp_path, trained_numbers)
    assert all(r == results[0] for r in results)
    assert results[0] == pytest.approx(_numbers(parity, corpus, "llama-moe"), rel=MOE_RTOL)


# Context parallelism: each sequence split into 2 x cp load-balanced chunks, attention over the cp
# ranks by the ring (K/V passed round) or one all-gather. The online softmax sums blocks in another
# order than one process's SDPA: TOLERANCE, as for any change of float32 summation order.
# Ulysses: all-to-alls around one process's SDPA on 2 of the 4 heads (the 2-D scheme: ring across pairs).
CP_LAYOUTS = [
    "cp2-ring", "cp2-allgather", "cp4-ring", "cp4-allgather", "cp2xtp2", "cp2xtp2-sp", "cp2xdp2", "cp2xpp2",
    "cp2xdp2-zero3", "cp2-ulysses", "cp2xpp2-ulysses", "cp2xdp2-zero3-ulysses", "cp2x2-ulysses-ring",
]  # fmt: skip
# The default suite runs each layout once, alternating the model; `make test-long` (CI) runs both
# models on every layout and the 8-rank rows.
CP_ROWS = [
    layout(name, *(() if (i + (model == "llama")) % 2 else (LONG,)), model=model)
    for model in ("gpt", "llama")
    for i, name in enumerate(CP_LAYOUTS)
]
CP_ROWS += [layout("dp2xcp2xtp2", LONG, model="llama"), layout("dp4-shard2-zero2-cp2-ulysses", LONG, model="llama")]


@pytest.mark.parametrize("model, name", CP_ROWS)
def test_context_parallel_trains_as_on_one_process(parity, corpus, tmp_path, model, name):
    parity.check(name, _model(corpus, model), TOLERANCE, tmp_path)


def test_bf16_gradient_norms_are_measured(parity, corpus, tmp_path):
    # Under bf16 at ZeRO stage 0 the reduced gradients live in fp32 buckets and p.grad stays None;
    # the norm used to read p.grad, so it was 0 and clipping never ran.
    config = _config(corpus, dp=2)
    config = dataclasses.replace(config, training=dataclasses.replace(config.training, precision="bf16"))
    norms = parity.run(2, config, tmp_path, trained_numbers)[0][STEPS:]
    # bf16 weights and activations: the norms agree with float32's to a few percent, not to round-off.
    assert norms == pytest.approx(_numbers(parity, corpus, "gpt")[STEPS:], rel=5e-2)


def _sequence_parallel_norms(config):
    from polyshard.tp import is_sequence_parallel
    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.loop import make_loaders, split_batch, train_step

    mesh = Mesh(config.parallel.mesh_axes)
    engine = build_engine(config, mesh)
    train_data, _ = make_loaders(config, mesh)
    for _ in range(3):
        train_step(engine, *split_batch(config, train_data.next_batch()), lr=1e-2)
    return {n: p.detach().float().clone() for n, p in engine.stages[0].named_parameters() if is_sequence_parallel(p)}


def test_sequence_parallel_norms_stay_replicated_under_bf16(distributed, corpus):
    # Each tp rank's norms see only its sequence shard; their gradients must be summed over tp. Under
    # bf16 they live in the fp32 buckets (p.grad is None), and the sum used to read p.grad: skipped.
    config = _config(corpus, tp=2, sequence_parallel=True)
    config = dataclasses.replace(config, training=dataclasses.replace(config.training, precision="bf16"))
    first, second = distributed.run(2, _sequence_parallel_norms, config)
    assert len(first) == 14  # per block two norms (weight, bias) and two row-parallel biases; the head norm
    for name, value in first.items():
        assert torch.equal(value, second[name]), name


def _checkpointed(corpus, **parallel):
    config = _config(corpus, **parallel)
    return dataclasses.replace(config, training=dataclasses.replace(config.training, activation_checkpointing=True))


def test_activation_checkpointing_changes_no_number(parity, corpus, tmp_path):
    # Recomputing each block in backward runs the same float32 operations again: as one process without it.
    parity.check("tp2", functools.partial(_checkpointed, corpus), TOLERANCE, tmp_path, reference=_config(corpus))


MOE_LAYOUTS = [
    layout("ep2"),
    layout("dp2xep2", LONG),
    layout("ep2xpp2"),
    layout("dp2xep2-zero1", LONG),
    layout("tp2"),
]  # dp x ep: tests/ep/test_dp_ep.py


@pytest.mark.parametrize("name", MOE_LAYOUTS)
def test_moe_gpt_trains_as_on_one_process(parity, corpus, tmp_path, name):
    # Without the aux loss every layout computes one process's maths: every tensor compared.
    parity.check(name, _model(corpus, "moe-gpt-no-aux"), TOLERANCE, tmp_path / "exact")
    # With it, each data rank's own balance loss: losses only (see MOE_RTOL).
    world, settings = LAYOUTS[name]
    results = parity.run(world, _config(corpus, "moe-gpt", **settings), tmp_path, trained_numbers)
    assert results[0][:STEPS] == pytest.approx(_numbers(parity, corpus, "moe-gpt")[:STEPS], rel=MOE_RTOL)


# Context parallelism with experts: each cp rank routes its chunks' tokens through the ep all-to-all and
# computes the aux loss over its cp group's tokens (polyshard.models.common.moe.token_group), i.e. the loss the same
# data rank computes without cp. So cp alone matches one process exactly with the aux loss on, and cp x ep
# matches the same dp x ep layout without cp exactly; the aux-free runs match one process exactly.
# TOLERANCE: float32 sums in another order (ring/all-gather softmax, all-reduces), as for dense cp.
MOE_CP_LAYOUTS = [
    layout("cp2-ring"),
    layout("cp2xep2"),  # ~4 s once the module's 4-rank pool runs
    layout("cp2xep2-allgather", LONG),
    layout("cp2xep2-ulysses", LONG),  # cp2xep2 (ring) stays in make test
    layout("cp2xep2-zero1", LONG),
    layout("dp2xcp2xep2", LONG),
    # microbatches: each one's aux loss is its own (as without cp), over its tokens on both cp ranks
    layout("cp2xpp2", LONG),
]


@pytest.mark.parametrize("name", MOE_CP_LAYOUTS)
def test_moe_gpt_with_context_parallel_matches_the_layout_without_it(parity, corpus, tmp_path, name):
    # the aux loss on: against the same layout without cp (one process when that is one data rank)
    without_cp = without(name, "cp")
    reference = _config(corpus, "moe-gpt", **without_cp)
    parity.check(name, _model(corpus, "moe-gpt"), TOLERANCE, tmp_path / "cp", reference=reference)
    if LAYOUTS[name][0] > 2:  # without the aux loss every layout computes one process's maths
        parity.check(name, _model(corpus, "moe-gpt-no-aux"), TOLERANCE, tmp_path)


def _with_capacity(corpus, **parallel):
    # capacity_factor 1.0 drops assignments; each cp rank applies the rule to its data rank's whole batch.
    base = _config(corpus, "moe-gpt", **parallel)
    moe = dataclasses.replace(base.model.moe, capacity_factor=1.0)
    return dataclasses.replace(base, model=dataclasses.replace(base.model, moe=moe))


@pytest.mark.long
@pytest.mark.parametrize("name", [layout("cp2-ring"), layout("cp2xep2")])
def test_moe_capacity_with_context_parallel_matches_the_layout_without_it(parity, corpus, tmp_path, name):
    config_of = functools.partial(_with_capacity, corpus)
    parity.check(name, config_of, TOLERANCE, tmp_path, reference=config_of(**without(name, "cp")))


def _three_cp_ranks(corpus, **parallel):
    # An odd cp group: 12 positions in 6 chunks of 2, rank r holding chunks r and 5 - r; aux loss on.
    base = _config(corpus, "moe-gpt", **parallel)
    return dataclasses.replace(base, model=dataclasses.replace(base.model, context_length=12))


@pytest.mark.long
def test_moe_gpt_on_three_cp_ranks_matches_one_process(parity, corpus, tmp_path):
    parity.check("cp3-ring", functools.partial(_three_cp_ranks, corpus), TOLERANCE, tmp_path)


def _stop_and_resume(config, out):
    mesh = Mesh(config.parallel.mesh_axes)
    whole = train(config, mesh, out / "whole", log=False).losses
    half = dataclasses.replace(config, training=dataclasses.replace(config.training, steps=STEPS // 2))
    train(half, mesh, out / "split", log=False)
    resumed = train(config, mesh, out / "split", log=False, resume=True).losses
    return whole, resumed


@pytest.mark.parametrize(
    "world, parallel",
    [
        pytest.param(1, {}, id="single"),
        pytest.param(
            4, {"dp": 2, "pp": 2, "microbatches": 2, "zero_stage": 1}, id="dp2xpp2-zero1", marks=pytest.mark.long
        ),
        pytest.param(2, {"dp": 2, "zero_stage": 3}, id="dp2-zero3"),
        pytest.param(2, {"pp": 2, "microbatches": 2, "dropout": 0.2}, id="pp2-dropout"),
    ],
)
def test_resume_is_bitwise_identical(distributed, corpus, tmp_path, world, parallel):
    # The warmup+cosine schedule runs to STEPS in both runs; the split run stops halfway and resumes.
    config = _config(corpus, **{k: v for k, v in parallel.items() if k != "dropout"})
    # With dropout the RNG state must resume exactly too (the pipeline's shape inference must not draw).
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, dropout=parallel.get("dropout", 0.0)))
    for whole, resumed in distributed.run(world, _stop_and_resume, config, tmp_path):
        assert resumed == whole  # exact: same data, same state, same order of operations on CPU


def _eval_twice(config, out):

    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.loop import evaluate, make_loaders, split_batch

    mesh = Mesh(config.parallel.mesh_axes)
    engine = build_engine(config, mesh)
    _, val = make_loaders(config, mesh)
    batch = split_batch(config, val.next_batch())
    first, second = evaluate(engine, *batch), evaluate(engine, *batch)
    return first, second, all(c.training for c in engine.stages.values())


def test_evaluation_runs_without_dropout(distributed, corpus):
    # With dropout on, two evaluations of the same batch agree only if eval mode switched it off,
    # and training mode is restored afterwards.
    config = _config(corpus, pp=2, microbatches=2)
    config = config.__class__(
        **{**config.__dict__, "model": config.model.__class__(**{**config.model.__dict__, "dropout": 0.5})}
    )
    for first, second, training_again in distributed.run(2, _eval_twice, config, None):
        assert first == second and training_again


def _train_only(config, out):
    train(config, Mesh(config.parallel.mesh_axes), out, log=False)
    return True


@pytest.mark.parametrize(
    "kind, world, parallel",
    [
        pytest.param("gpt", 4, {"dp": 2, "tp": 2}, id="dp2xtp2"),
        pytest.param("gpt", 4, {"tp": 2, "pp": 2, "microbatches": 2}, id="tp2xpp2"),
        pytest.param("gpt", 2, {"dp": 2, "zero_stage": 3}, id="dp2-zero3"),
        pytest.param("moe-gpt", 4, {"dp": 2, "ep": 2}, id="moe-dp2xep2"),
    ],
)
def test_exported_checkpoint_loads_into_the_plain_model(distributed, corpus, tmp_path, kind, world, parallel):
    import torch
    from safetensors.torch import load_file

    from polyshard.models import build_model
    from polyshard.trainer.checkpointing.run_export import export

    config = _config(corpus, kind, aux_loss_weight=0.0, **parallel)
    single = _config(corpus, kind, aux_loss_weight=0.0)
    distributed.run(world, _train_only, config, tmp_path / "parallel")
    distributed.run(1, _train_only, single, tmp_path / "single")
    states = {}
    for run in ("parallel", "single"):
        folder = sorted((tmp_path / run / "checkpoints").iterdir())[-1]
        states[run] = load_file(str(export(folder, tmp_path / f"{run}.safetensors")))
    model = build_model(config.model)
    model.load_state_dict(states["parallel"], strict=True)  # every name and shape of the plain model
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    model.load_state_dict(states["single"], strict=True)
    # After 6 AdamW steps the weights of the two runs differ by float32 round-off that Adam can
    # magnify on near-zero gradients (~1e-5 of lr-sized updates); logits agree to well under 1e-3.
    torch.testing.assert_close(logits, model(tokens), rtol=1e-3, atol=1e-3)
    # ... and that tolerance is far below what training moved: a misplaced shard would show.
    torch.manual_seed(config.training.seed)
    assert (logits - build_model(config.model)(tokens)).abs().max() > 0.1


def _evaluate_in_order(config, tokens):
    from polyshard.data.examples import Arrays
    from polyshard.data.loader import ShardedLoader
    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.loop import evaluate_batches, split_batch

    mesh = Mesh(config.parallel.mesh_axes)
    engine = build_engine(config, mesh)
    data_ranks = config.parallel.dp * config.parallel.ep
    loader = ShardedLoader(
        Arrays({"tokens": tokens.numpy()}),
        batch_size=8 // data_ranks,
        rank=mesh.group_rank(("dp", "ep")),
        world_size=data_ranks,
        seed=0,
        shuffle=False,
    )
    sizes = [len(part["tokens"]) for part in loader.in_order()]
    loss, _ = evaluate_batches(engine, (split_batch(config, part) for part in loader.in_order()))
    return loss, mesh.group_rank(("dp", "ep")), sizes


@pytest.mark.parametrize(
    "kind, world, parallel",
    [
        pytest.param(
            "gpt", 8, {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2}, id="dp2xtp2xpp2", marks=pytest.mark.long
        ),  # eight processes on two cores (30 s); the MoE row keeps an uneven split in make test
        pytest.param("moe-gpt", 4, {"dp": 2, "ep": 2}, id="moe-dp2xep2"),
    ],
)
def test_evaluation_covers_the_whole_split_with_a_partial_last_batch(distributed, corpus, kind, world, parallel):
    import torch

    tokens = torch.randint(0, 256, (11, 17), generator=torch.Generator().manual_seed(4))  # batches of 8, then 3
    reference = distributed.run(1, _evaluate_in_order, _config(corpus, kind), tokens)[0][0]
    results = distributed.run(world, _evaluate_in_order, _config(corpus, kind, **parallel), tokens)
    data_ranks = parallel["dp"] * parallel.get("ep", 1)
    sizes = {data_rank: tuple(parts) for _, data_rank, parts in results}
    # every data rank saw its part of both batches; with 4 data ranks one part of the last batch is empty
    assert len(sizes) == data_ranks and sum(sum(parts) for parts in sizes.values()) == 11
    assert any(0 in parts for parts in sizes.values()) == (data_ranks == 4)
    for loss, _, _ in results:
        # the mean over all 11 sequences, weighted by part size; only the order of float sums differs
        assert loss == pytest.approx(reference, rel=2e-6)


def _diverging(config, out):
    from polyshard.trainer.errors import NonFiniteError

    try:
        train(config, Mesh(config.parallel.mesh_axes), out, log=True)
    except NonFiniteError as err:
        return str(err)
    return None


def test_a_diverging_run_stops_and_writes_no_non_finite_checkpoint(distributed, corpus, tmp_path):
    # Before: lr=1e30 trained to the end with NaN losses, exit code 0, and NaN weights replaced the
    # good checkpoints.
    import json

    import torch

    from polyshard.trainer.checkpointing.run_export import consolidate

    config = _config(corpus, dp=2)
    config = dataclasses.replace(
        config,
        training=dataclasses.replace(config.training, steps=8),
        optimizer=dataclasses.replace(config.optimizer, lr=1e30),
        lr_schedule=dataclasses.replace(config.lr_schedule, min_lr=0.0, warmup_steps=0),
        checkpoint=dataclasses.replace(config.checkpoint, every=1, keep=8),
    )
    errors = distributed.run(2, _diverging, config, tmp_path)
    assert errors[0] is not None and errors[0] == errors[1]  # every rank stopped at the same step
    assert "non-finite" in errors[0] or "weights hold NaN" in errors[0]
    for folder in sorted((tmp_path / "checkpoints").glob("step_*")):
        assert all(bool(torch.isfinite(t).all()) for t in consolidate(folder).values()), folder
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) < 8  # it stopped early


def _nan_on_one_rank(config):
    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.loop import make_loaders, split_batch, train_step

    mesh = Mesh(config.parallel.mesh_axes)
    engine = build_engine(config, mesh)
    train_data, _ = make_loaders(config, mesh)
    before = {n: p.detach().clone() for n, p in engine.stages[0].named_parameters()}
    head = engine.stages[0][-1].proj.weight
    if mesh.rank == 1:  # a faulty device: one rank's gradient turns NaN
        head.register_hook(lambda grad: grad * float("nan"))
    measured = train_step(engine, *split_batch(config, train_data.next_batch()), lr=1e-2)
    loss, norm = measured.loss, measured.grad_norm
    unchanged = all(torch.equal(p, before[n]) for n, p in engine.stages[0].named_parameters())
    return loss, norm, unchanged


def test_nan_on_one_rank_stops_every_rank_from_updating(distributed, corpus):
    import math

    results = distributed.run(2, _nan_on_one_rank, _config(corpus, dp=2))
    for loss, norm, unchanged in results:
        assert math.isfinite(loss) and math.isnan(norm)  # the reduced norm carries the NaN everywhere
        assert unchanged  # no rank stepped


def _resume_past_a_corrupt_checkpoint(config, out):
    mesh = Mesh(config.parallel.mesh_axes)
    whole = train(config, mesh, out / "whole", log=False).losses
    every = dataclasses.replace(config.checkpoint, every=1, keep=5)
    half = dataclasses.replace(
        config, training=dataclasses.replace(config.training, steps=STEPS // 2), checkpoint=every
    )
    train(half, mesh, out / "split", log=False)
    newest = sorted((out / "split" / "checkpoints").glob("step_*"))[-1]
    (newest / "rank_00000.safetensors").write_bytes(b"damaged")  # the last save was lost
    resumed = train(dataclasses.replace(config, checkpoint=every), mesh, out / "split", log=False, resume=True)
    return whole, resumed.losses


def test_resume_falls_back_past_a_corrupt_newest_checkpoint(distributed, corpus, tmp_path):
    # Before: --resume failed on the corrupt newest checkpoint although an older one was intact.
    whole, resumed = distributed.run(1, _resume_past_a_corrupt_checkpoint, _config(corpus), tmp_path)[0]
    assert resumed == whole  # bitwise: from the step before, with its data position and RNG
