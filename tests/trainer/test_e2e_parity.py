"""End-to-end parity: the same small GPT trained on every layout gives the same losses.

Each layout runs the real training loop (data loader, pipeline executor,
dp/ZeRO wrappers, tp plan, clip, AdamW with warmup) on live processes and is
compared with one process on the same config. The global batch of each step
is the same whatever the layout (see polyshard.trainer.data.loader).
"""

import dataclasses

import pytest
import torch

from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from polyshard.trainer.loop import train
from tests.trainer._short import SMALL_LLAMA, short_training

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
            "training": short_training(STEPS),
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
        }
    )


def _train(config, out):
    result = train(config, Mesh(config.parallel.mesh_axes), out, log=False)
    # Losses alone would not see a gradient scaled by a constant (AdamW and clipping normalise it
    # away); the global gradient norm before clipping does.
    return result.losses + result.grad_norms


@pytest.fixture(scope="module")
def reference(distributed, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    refs = {kind: distributed.run(1, _train, _config(corpus, kind), out)[0] for kind in ("gpt", "moe-gpt")}
    refs["moe-gpt-no-aux"] = distributed.run(1, _train, _config(corpus, "moe-gpt", aux_loss_weight=0.0), out)[0]
    refs["tied"] = distributed.run(1, _train, _config(corpus, tie_embeddings=True), out)[0]
    refs["llama"] = distributed.run(1, _train, _config(corpus, llama=True), out)[0]
    refs["llama-moe"] = distributed.run(1, _train, _config(corpus, "moe-gpt", llama=True), out)[0]
    return refs


LAYOUTS = [
    pytest.param(2, {"dp": 2}, id="dp2"),
    pytest.param(2, {"tp": 2}, id="tp2"),
    pytest.param(2, {"tp": 2, "sequence_parallel": True}, id="tp2-sp"),
    pytest.param(2, {"pp": 2, "microbatches": 2, "schedule": "1f1b"}, id="pp2-1f1b"),
    pytest.param(2, {"pp": 2, "microbatches": 4, "schedule": "zb-h1"}, id="pp2-zbh1"),
    pytest.param(2, {"pp": 2, "microbatches": 2, "schedule": "interleaved", "virtual_stages": 2}, id="pp2-interleaved"),
    # V placements: rank 0 holds the embedding and the head (stages 0 and 3), rank 1 the two blocks
    pytest.param(2, {"pp": 2, "microbatches": 4, "schedule": "zb-v", "virtual_stages": 2}, id="pp2-zbv"),
    pytest.param(2, {"pp": 2, "microbatches": 4, "schedule": "dualpipev", "virtual_stages": 2}, id="pp2-dualpipev"),
    pytest.param(2, {"dp": 2, "zero_stage": 1}, id="dp2-zero1"),
    pytest.param(2, {"dp": 2, "zero_stage": 2}, id="dp2-zero2"),
    pytest.param(2, {"dp": 2, "zero_stage": 3}, id="dp2-zero3"),
    pytest.param(4, {"dp": 2, "tp": 2}, id="dp2xtp2"),
    pytest.param(4, {"tp": 2, "pp": 2, "microbatches": 2}, id="tp2xpp2"),
    # split backward over tp's matmul Functions, which compute their weight gradients in B: W reuses them
    # (36 s on the loaded machine: long)
    pytest.param(
        4, {"tp": 2, "pp": 2, "microbatches": 2, "schedule": "zb-h1"}, id="tp2xpp2-zbh1", marks=pytest.mark.long
    ),
    # eight processes on two cores (~20 s each): the 3-D rows are make test-long's
    pytest.param(8, {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2}, id="dp2xtp2xpp2", marks=pytest.mark.long),
]


TIED_LAYOUTS = [
    pytest.param(2, {"tp": 2}, id="tp2"),
    pytest.param(2, {"tp": 2, "sequence_parallel": True}, id="tp2-sp"),
    pytest.param(2, {"pp": 2, "microbatches": 2}, id="pp2"),
    pytest.param(2, {"pp": 2, "microbatches": 2, "schedule": "interleaved", "virtual_stages": 2}, id="pp2-interleaved"),
    # the V puts the embedding and the tied head on the same rank, in two stages: two equal copies
    pytest.param(2, {"pp": 2, "microbatches": 2, "schedule": "zb-v", "virtual_stages": 2}, id="pp2-zbv"),
    pytest.param(4, {"tp": 2, "pp": 2, "microbatches": 2}, id="tp2xpp2"),
    pytest.param(2, {"dp": 2, "zero_stage": 3}, id="dp2-zero3"),
    # three stages and fewer microbatches than stages; the tied copies' gradients as ZeRO-1 rows
    pytest.param(3, {"pp": 3, "microbatches": 2, "zero_stage": 1}, id="pp3-m2-zero1"),
    pytest.param(4, {"pp": 2, "dp": 2, "zero_stage": 2, "microbatches": 2}, id="dp2xpp2-zero2"),
    # eight processes on two cores (22 s): make test-long's
    pytest.param(8, {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2}, id="dp2xtp2xpp2", marks=pytest.mark.long),
]


LLAMA_LAYOUTS = [
    pytest.param(2, {"dp": 2}, id="dp2"),
    pytest.param(2, {"tp": 2}, id="tp2-gqa"),  # one kv head per tp rank
    pytest.param(4, {"tp": 4, "sequence_parallel": True}, id="tp4-sp-kv-replicated"),  # 2 kv heads on 4 ranks
    pytest.param(4, {"tp": 4}, id="tp4-kv-replicated"),
    pytest.param(2, {"tp": 2, "sequence_parallel": True}, id="tp2-sp"),
    pytest.param(2, {"pp": 2, "microbatches": 2}, id="pp2"),
    pytest.param(2, {"dp": 2, "zero_stage": 3}, id="dp2-zero3"),
    # the dense and tied GPTs keep an 8-rank row in the default suite; Llama's runs in make test-long
    pytest.param(8, {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2}, id="dp2xtp2xpp2", marks=pytest.mark.long),
    # three uneven stages (embedding + block, block, head) with fewer microbatches than stages
    pytest.param(3, {"pp": 3, "microbatches": 2, "stage_layers": [2, 1, 1]}, id="pp3-uneven"),
]


def test_llama_moe_matches_one_process(distributed, corpus, reference, tmp_path):
    # Llama's attention with SwiGLU experts split over ep, the variant Mixtral made common.
    results = distributed.run(4, _train, _config(corpus, "moe-gpt", llama=True, ep=2, tp=2), tmp_path)
    assert all(r == results[0] for r in results)
    assert results[0] == pytest.approx(reference["llama-moe"], rel=MOE_RTOL)  # aux-loss gradient, see MOE_RTOL


# Context parallelism: each sequence split into 2 x cp load-balanced chunks, attention over the cp
# ranks by the ring (K/V passed round) or one all-gather. The online softmax sums blocks in another
# order than one process's SDPA, so DENSE_RTOL applies as for any change of float32 summation order.
CP_LAYOUTS = [
    (2, {"cp": 2}, "cp2-ring"),
    (2, {"cp": 2, "cp_style": "allgather"}, "cp2-allgather"),
    (4, {"cp": 4}, "cp4-ring"),
    (4, {"cp": 4, "cp_style": "allgather"}, "cp4-allgather"),
    (4, {"cp": 2, "tp": 2}, "cp2xtp2"),
    (4, {"cp": 2, "tp": 2, "sequence_parallel": True}, "cp2xtp2-sp"),
    (4, {"cp": 2, "dp": 2}, "cp2xdp2"),
    (4, {"cp": 2, "pp": 2, "microbatches": 2}, "cp2xpp2"),
    (4, {"cp": 2, "dp": 2, "zero_stage": 3}, "cp2xdp2-zero3"),
    # Ulysses: all-to-alls around one process's SDPA on 2 of the 4 heads (the 2-D scheme: ring across pairs)
    (2, {"cp": 2, "cp_style": "ulysses"}, "cp2-ulysses"),
    (4, {"cp": 2, "pp": 2, "microbatches": 2, "cp_style": "ulysses"}, "cp2xpp2-ulysses"),
    (4, {"cp": 2, "dp": 2, "zero_stage": 3, "cp_style": "ulysses"}, "cp2xdp2-zero3-ulysses"),
    (4, {"cp": 4, "cp_style": "ulysses+ring", "cp_ulysses": 2}, "cp2x2-ulysses-ring"),
]
# The default suite runs each layout once, alternating the model; `make test-long` (CI) runs both
# models on every layout and the 8-rank row.
CP_ROWS = [
    pytest.param(
        model, world, parallel, id=f"{model}-{name}", marks=() if (i + (model == "llama")) % 2 else pytest.mark.long
    )
    for model in ("gpt", "llama")
    for i, (world, parallel, name) in enumerate(CP_LAYOUTS)
]
CP_ROWS.append(pytest.param("llama", 8, {"dp": 2, "cp": 2, "tp": 2}, id="llama-dp2xcp2xtp2", marks=pytest.mark.long))
CP_ROWS.append(
    pytest.param(
        "llama",
        8,
        {"dp": 4, "dp_shard": 2, "zero_stage": 2, "cp": 2, "cp_style": "ulysses"},
        id="llama-hybrid-dp4x2-cp2-ulysses",
        marks=pytest.mark.long,
    )
)


@pytest.mark.parametrize("model, world, parallel", CP_ROWS)
def test_context_parallel_losses_match_one_process(distributed, corpus, reference, tmp_path, model, world, parallel):
    results = distributed.run(world, _train, _config(corpus, llama=model == "llama", **parallel), tmp_path)
    assert all(r == results[0] for r in results)
    assert results[0] == pytest.approx(reference[model], rel=DENSE_RTOL)  # losses and pre-clip grad norms


@pytest.mark.parametrize("world, parallel", LLAMA_LAYOUTS)
def test_llama_losses_match_one_process(distributed, corpus, reference, tmp_path, world, parallel):
    results = distributed.run(world, _train, _config(corpus, llama=True, **parallel), tmp_path)
    assert all(r == results[0] for r in results)
    assert results[0] == pytest.approx(reference["llama"], rel=DENSE_RTOL)  # losses and pre-clip grad norms
    assert results[0][STEPS - 1] < results[0][0]  # it learns


@pytest.mark.parametrize("world, parallel", TIED_LAYOUTS)
def test_tied_gpt_losses_match_one_process(distributed, corpus, reference, tmp_path, world, parallel):
    # Before: tp untied the pair silently (loss 2.5e-3 and grad norm 0.5% off), pp refused it and
    # ZeRO-3 freed the shared weight after the embedding's forward (a crash in the head).
    results = distributed.run(world, _train, _config(corpus, tie_embeddings=True, **parallel), tmp_path)
    assert all(r == results[0] for r in results)
    assert results[0] == pytest.approx(reference["tied"], rel=DENSE_RTOL)  # losses and pre-clip grad norms


def test_bf16_gradient_norms_are_measured(distributed, corpus, reference, tmp_path):
    # Under bf16 at ZeRO stage 0 the reduced gradients live in fp32 buckets and p.grad stays None;
    # the norm used to read p.grad, so it was 0 and clipping never ran.
    config = _config(corpus, dp=2)
    config = dataclasses.replace(config, training=dataclasses.replace(config.training, precision="bf16"))
    norms = distributed.run(2, _train, config, tmp_path)[0][STEPS:]
    # bf16 weights and activations: the norms agree with float32's to a few percent, not to round-off.
    assert norms == pytest.approx(reference["gpt"][STEPS:], rel=5e-2)


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


def _train_checkpointed(config, out):
    training = dataclasses.replace(config.training, activation_checkpointing=True)
    return _train(dataclasses.replace(config, training=training), out)


def test_activation_checkpointing_changes_no_number(distributed, corpus, reference, tmp_path):
    # Recomputing each block in backward runs the same float32 operations again: same losses.
    results = distributed.run(2, _train_checkpointed, _config(corpus, tp=2, pp=1), tmp_path)
    assert results[0] == pytest.approx(reference["gpt"], rel=DENSE_RTOL)


@pytest.mark.parametrize("world, parallel", LAYOUTS)
def test_dense_gpt_losses_match_one_process(distributed, corpus, reference, tmp_path, world, parallel):
    results = distributed.run(world, _train, _config(corpus, **parallel), tmp_path)
    assert all(r == results[0] for r in results)  # every rank reports the same global losses
    assert results[0] == pytest.approx(reference["gpt"], rel=DENSE_RTOL)
    assert results[0][STEPS - 1] < results[0][0]  # and it is learning (the results hold losses, then norms)


@pytest.mark.parametrize(
    "world, parallel",
    [
        pytest.param(2, {"ep": 2}, id="ep2"),
        pytest.param(4, {"dp": 2, "ep": 2}, id="dp2xep2"),
        pytest.param(4, {"ep": 2, "pp": 2, "microbatches": 2}, id="ep2xpp2"),
        pytest.param(4, {"dp": 2, "ep": 2, "zero_stage": 1}, id="dp2xep2-zero1", marks=pytest.mark.long),
        pytest.param(2, {"tp": 2}, id="tp2"),
    ],
)
def test_moe_gpt_losses_match_one_process(distributed, corpus, reference, tmp_path, world, parallel):
    exact = distributed.run(world, _train, _config(corpus, "moe-gpt", aux_loss_weight=0.0, **parallel), tmp_path)
    assert exact[0] == pytest.approx(reference["moe-gpt-no-aux"], rel=DENSE_RTOL)  # losses and grad norms
    results = distributed.run(world, _train, _config(corpus, "moe-gpt", **parallel), tmp_path)
    assert results[0][:STEPS] == pytest.approx(reference["moe-gpt"][:STEPS], rel=MOE_RTOL)  # losses


# Context parallelism with experts: each cp rank routes its chunks' tokens through the ep all-to-all and
# computes the aux loss over its cp group's tokens (polyshard.models.common.moe.token_group), i.e. the loss the same
# data rank computes without cp. So cp alone matches one process exactly with the aux loss on, and cp x ep
# matches the same dp x ep layout without cp exactly; the aux-free runs match one process exactly.
# DENSE_RTOL: float32 sums in another order (ring/all-gather softmax, all-reduces), as for dense cp.
MOE_CP_LAYOUTS = [
    pytest.param(2, {"cp": 2}, id="cp2-ring"),
    pytest.param(4, {"cp": 2, "ep": 2}, id="cp2xep2-ring"),  # ~4 s once the module's 4-rank pool runs
    pytest.param(4, {"cp": 2, "ep": 2, "cp_style": "allgather"}, id="cp2xep2-allgather", marks=pytest.mark.long),
    pytest.param(4, {"cp": 2, "ep": 2, "cp_style": "ulysses"}, id="cp2xep2-ulysses"),
    pytest.param(4, {"cp": 2, "ep": 2, "zero_stage": 1}, id="cp2xep2-zero1", marks=pytest.mark.long),
    pytest.param(8, {"dp": 2, "cp": 2, "ep": 2}, id="dp2xcp2xep2", marks=pytest.mark.long),
    # microbatches: each one's aux loss is its own (as without cp), over its tokens on both cp ranks
    pytest.param(4, {"cp": 2, "pp": 2, "microbatches": 2}, id="cp2xpp2", marks=pytest.mark.long),
]


@pytest.mark.parametrize("world, parallel", MOE_CP_LAYOUTS)
def test_moe_gpt_with_context_parallel_matches_the_layout_without_it(
    distributed, corpus, reference, tmp_path, world, parallel
):
    results = distributed.run(world, _train, _config(corpus, "moe-gpt", **parallel), tmp_path / "cp")
    assert all(r == results[0] for r in results)
    without_cp = {k: v for k, v in parallel.items() if k not in ("cp", "cp_style", "cp_ulysses")}
    if without_cp.get("dp", 1) * without_cp.get("ep", 1) * without_cp.get("pp", 1) == 1:
        expected = reference["moe-gpt"]  # one data rank: one process computes the same aux losses
    else:
        expected = distributed.run(world // 2, _train, _config(corpus, "moe-gpt", **without_cp), tmp_path / "no-cp")[0]
    assert results[0] == pytest.approx(expected, rel=DENSE_RTOL)  # losses and pre-clip grad norms, aux included
    if world > 2:  # without the aux loss every layout computes one process's maths
        exact = distributed.run(world, _train, _config(corpus, "moe-gpt", aux_loss_weight=0.0, **parallel), tmp_path)
        assert exact[0] == pytest.approx(reference["moe-gpt-no-aux"], rel=DENSE_RTOL)


@pytest.mark.long
@pytest.mark.parametrize(
    "world, parallel, without_cp",
    [pytest.param(2, {"cp": 2}, {}, id="cp2"), pytest.param(4, {"cp": 2, "ep": 2}, {"ep": 2}, id="cp2xep2")],
)
def test_moe_capacity_with_context_parallel_matches_the_layout_without_it(
    distributed, corpus, tmp_path, world, parallel, without_cp
):
    # capacity_factor 1.0 drops assignments; each cp rank applies the rule to its data rank's whole batch.
    def config(**axes):
        base = _config(corpus, "moe-gpt", **axes)
        moe = dataclasses.replace(base.model.moe, capacity_factor=1.0)
        return dataclasses.replace(base, model=dataclasses.replace(base.model, moe=moe))

    expected = distributed.run(world // 2, _train, config(**without_cp), tmp_path / "no-cp")[0]
    results = distributed.run(world, _train, config(**parallel), tmp_path / "cp")
    assert all(r == results[0] for r in results)
    assert results[0] == pytest.approx(expected, rel=DENSE_RTOL)  # losses and pre-clip grad norms


@pytest.mark.long
def test_moe_gpt_on_three_cp_ranks_matches_one_process(distributed, corpus, tmp_path):
    # An odd cp group: 12 positions in 6 chunks of 2, rank r holding chunks r and 5 - r; aux loss on.
    def config(**parallel):
        base = _config(corpus, "moe-gpt", **parallel)
        return dataclasses.replace(base, model=dataclasses.replace(base.model, context_length=12))

    one = distributed.run(1, _train, config(), tmp_path / "one")[0]
    three = distributed.run(3, _train, config(cp=3), tmp_path / "cp3")
    assert all(r == three[0] for r in three)
    assert three[0] == pytest.approx(one, rel=DENSE_RTOL)  # losses and pre-clip grad norms


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
        pytest.param("gpt", 8, {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2}, id="dp2xtp2xpp2"),
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
    training = dataclasses.replace(config.training, lr=1e30, min_lr=0.0, warmup_steps=0, steps=8)
    config = dataclasses.replace(
        config, training=training, checkpoint=dataclasses.replace(config.checkpoint, every=1, keep=8)
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
    loss, norm = train_step(engine, *split_batch(config, train_data.next_batch()), lr=1e-2)
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
