"""Sliding windows (alternating with full attention, as gpt-oss's layer_types) and per-head attention sinks,
with document masks, trained on tp2, tp2 + sequence parallelism, cp 2 and an uneven cp 3 (ring and
all-gather), Ulysses on cp 2 and with the ring on 2 x 2, pp2 and dp2 with ZeRO-3 against one process
on the same batches: every loss and gradient norm of a few AdamW steps with weight decay, every gradient
of the first step, and every parameter after the last."""

import pytest
import torch

from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from polyshard.trainer.errors import ConfigError

VOCAB, CONTEXT, ROWS, STEPS, LR = 64, 24, 4, 3, 1e-3
# Documents per row in tokens of CONTEXT + 1: under cp 2 (chunks of 6) and cp 3 (chunks of 4) documents cross
# chunk boundaries; one is a single token, one row is one document.
DOCUMENTS = [[5, 9, 11], [25], [1, 3, 14, 7], [12, 13]]
LLAMA = {"norm": "rms", "activation": "swiglu", "positions": "rope", "bias": False, "num_kv_heads": 2}
# A window of 5 tokens in block 0, full attention in block 1 (gpt-oss alternates them); sinks in both.
ATTENTION = {
    "sliding_window": 5,
    "layer_types": ["sliding_attention", "full_attention"],
    "attention_sinks": True,
}
# float32 throughout. One step's gradients differ from one process only in the order float32 sums are taken
# (tp all-reduces, cp's log-sum-exp merges, blocks summed in another order): a few ulps of O(1) values,
# under TOL = 1e-5. Losses and gradient norms compound that over the steps: 2e-5 relative, as the e2e
# parity tests. Parameters after STEPS AdamW steps: AdamW scales every update to about LR whatever the
# gradient's size, so an entry whose gradient is within rounding of zero can move by a fraction of LR
# differently (1.0e-5 seen with LR 1e-3 over 3 steps, 1.6e-5 with LR 1e-2): PARAM_ATOL = 5e-5, 5% of one
# step; a wrong mask or sink changes every update by about LR (1e-3), 20 times more.
TOL, LOSS_RTOL, PARAM_ATOL = 1e-5, 2e-5, 5e-5


def _config(**parallel):
    model = {"vocab_size": VOCAB, "context_length": CONTEXT, "hidden": 32, "num_layers": 2, "num_heads": 4}
    return from_dict(
        {
            "model": {**model, **LLAMA, **ATTENTION},
            "parallel": parallel,
            "training": {"global_batch_size": ROWS, "weight_decay": 0.1},
            "data": {"document_mask": True},
        }
    )


def _batch(step):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(1, VOCAB, (ROWS, CONTEXT + 1), generator=g)
    documents = DOCUMENTS[step % len(DOCUMENTS) :] + DOCUMENTS[: step % len(DOCUMENTS)]  # rows change places
    segments = torch.stack([torch.repeat_interleave(torch.arange(len(d)), torch.tensor(d)) for d in documents])
    return {"tokens": tokens, "segments": segments}


def _train(config):
    """STEPS training steps on this rank: (losses and gradient norms, [(placement, first step's gradient)],
    [(placement, parameter after the last step)], where the rank sits)."""
    from polyshard.mesh import get_placement
    from polyshard.trainer.checkpointing.state import _model_tensors
    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.loop import batch_segments, split_batch, train_step

    par = config.parallel
    mesh = Mesh(par.mesh_axes)
    engine = build_engine(config, mesh)
    data_rank, rows = mesh.group_rank(par.batch_axes), ROWS // par.data_ranks
    numbers, first = [], []

    def keep_first_gradients():
        if not first:
            first.extend((placement, grad.detach().clone()) for grad, placement in engine.gradients()[0])

    for step in range(STEPS):
        batch = {k: v[data_rank * rows : (data_rank + 1) * rows] for k, v in _batch(step).items()}
        inputs, targets = split_batch(config, batch)
        segments = batch_segments(config, batch)
        numbers += train_step(engine, inputs, targets, LR, keep_first_gradients, segments)
    # Each stage's parameters as a checkpoint reads them (ZeRO-3: this rank's rows), with their records.
    params = [
        (get_placement(tensor), tensor.detach().clone())
        for index in engine.stages
        for tensor in _model_tensors(engine, index).values()
    ]
    return numbers, first, params, mesh.coords()


def _assemble(pairs_of_every_rank, config):
    """[(placement, local tensor)] of every rank -> {name: full tensor}."""
    sizes = dict(config.parallel.mesh_axes)
    full = {}
    for pairs, coords in pairs_of_every_rank:
        for placement, local in pairs:
            tensor = full.setdefault(placement.name, torch.full(placement.tiled_shape, float("nan")))
            tensor[placement.local_slices(sizes, coords)] = local.float().reshape(placement.local_shape(sizes))
    return full


@pytest.fixture(scope="module")
def reference(distributed):
    numbers, grads, params, coords = distributed.run(1, _train, _config())[0]
    config = _config()
    return numbers, _assemble([(grads, coords)], config), _assemble([(params, coords)], config)


LAYOUTS = [
    pytest.param(2, {"tp": 2}, id="tp2"),
    pytest.param(2, {"tp": 2, "sequence_parallel": True}, id="tp2-sp"),
    pytest.param(2, {"cp": 2}, id="cp2-ring"),
    pytest.param(2, {"cp": 2, "cp_style": "allgather"}, id="cp2-allgather"),
    pytest.param(3, {"cp": 3}, id="cp3-ring"),
    pytest.param(3, {"cp": 3, "cp_style": "allgather"}, id="cp3-allgather"),
    # Ulysses: the model's own core windows the whole sequence of each rank's heads, with their sinks
    pytest.param(2, {"cp": 2, "cp_style": "ulysses"}, id="cp2-ulysses"),
    pytest.param(4, {"cp": 4, "cp_style": "ulysses+ring", "cp_ulysses": 2}, id="cp2x2-ulysses-ring"),
    pytest.param(4, {"cp": 2, "tp": 2, "cp_style": "ulysses"}, id="cp2xtp2-ulysses", marks=pytest.mark.long),
    # the sliding block and the full one on different stages; sinks sharded by ZeRO-3 like any parameter
    pytest.param(2, {"pp": 2, "microbatches": 2}, id="pp2"),
    pytest.param(2, {"dp": 2, "zero_stage": 3}, id="dp2-zero3"),
]


@pytest.mark.parametrize("world, parallel", LAYOUTS)
def test_windows_and_sinks_train_as_on_one_process(distributed, reference, world, parallel):
    config = _config(**parallel)
    results = distributed.run(world, _train, config)
    ref_numbers, ref_grads, ref_params = reference
    assert all(numbers == results[0][0] for numbers, *_ in results)  # every rank reports the same
    assert results[0][0] == pytest.approx(ref_numbers, rel=LOSS_RTOL)  # losses and pre-clip gradient norms
    for which, index, refs, atol in (("gradient", 1, ref_grads, TOL), ("parameter", 2, ref_params, PARAM_ATOL)):
        mine = _assemble([(r[index], r[3]) for r in results], config)
        assert set(mine) == set(refs) and any(name.endswith("attn.sinks") for name in mine)
        for name, tensor in mine.items():
            assert not tensor.isnan().any(), f"{which} {name}: a piece no rank holds"
            torch.testing.assert_close(
                tensor, refs[name], rtol=TOL, atol=atol, msg=lambda m, w=f"{which} {name}": f"{w}: {m}"
            )


def test_window_fields_are_checked():
    with pytest.raises(ConfigError, match="layer_types chooses which blocks slide"):
        from_dict({"model": {"layer_types": ["full_attention"] * 4}})
    with pytest.raises(ConfigError, match="must name each of the 4 blocks"):
        from_dict({"model": {"sliding_window": 4, "layer_types": ["sliding_attention"] * 3}})
    with pytest.raises(ConfigError, match="model.attention_core='dense'"):
        from_dict({"model": {"attention_core": "dense"}})
    with pytest.raises(ConfigError, match="model.dropout runs only on plain causal attention"):
        from_dict({"model": {"attention_sinks": True, "dropout": 0.1}})


def test_dropout_with_document_masks_is_refused_before_launch():
    from polyshard.trainer.engine.constraints import validate

    config = from_dict({"model": {"dropout": 0.1}, "data": {"source": "x.txt", "document_mask": True}})
    with pytest.raises(ConfigError, match="model.dropout=0.1 runs only on plain causal attention"):
        validate(config)


def test_the_vit_has_no_windows_or_sinks():
    # They are the GPT family's fields: the vit's [model] does not know them.
    with pytest.raises(ConfigError, match="attention_sinks"):
        from_dict({"model": {"kind": "vit", "attention_sinks": True}, "data": {"source": "digits"}})


@pytest.mark.parametrize("extra", [{"sliding_window": 8}, {"attention_sinks": True}])
def test_the_hugging_face_export_refuses_windows_and_sinks(extra):
    from polyshard.checkpoint import CheckpointError
    from polyshard.models.hf_families import family_of

    llama = from_dict({"model": {**LLAMA, "num_kv_heads": 2}}).model
    assert family_of(llama).title == "Llama"  # the same model without them is a Llama
    key = next(iter(extra))
    with pytest.raises(CheckpointError, match=f"Llama would need .*{key}="):
        family_of(from_dict({"model": {**LLAMA, "num_kv_heads": 2, **extra}}).model)
