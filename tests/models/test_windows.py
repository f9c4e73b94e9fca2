"""Sliding windows (alternating with full attention, as gpt-oss's layer_types) and per-head attention sinks,
with document masks, trained on tp2, tp2 + sequence parallelism, cp 2 and an uneven cp 3 (ring and
all-gather), Ulysses on cp 2 and with the ring on 2 x 2, pp2 and dp2 with ZeRO-3 against one process
on the same batches by tests/_layouts.py's runner, with this file's own loop (:func:`_train`): every
loss and gradient norm of a few AdamW steps with weight decay, every gradient of the first step, and every
parameter after the last."""

import pytest
import torch

from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from polyshard.trainer.errors import ConfigError
from tests._layouts import LONG, Tolerance, layout
from tests._pieces import buffer_pieces, gradient_pieces, parameter_pieces, where

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
TOLERANCE = Tolerance(numbers=LOSS_RTOL, grads={"rtol": TOL, "atol": TOL}, params={"rtol": TOL, "atol": PARAM_ATOL})


def _config(**parallel):
    model = {"vocab_size": VOCAB, "context_length": CONTEXT, "hidden": 32, "num_layers": 2, "num_heads": 4}
    return from_dict(
        {
            "model": {**model, **LLAMA, **ATTENTION},
            "parallel": parallel,
            "training": {"global_batch_size": ROWS},
            "optimizer": {"weight_decay": 0.1},
            "data": {"document_mask": True},
        }
    )


def _batch(step):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(1, VOCAB, (ROWS, CONTEXT + 1), generator=g)
    documents = DOCUMENTS[step % len(DOCUMENTS) :] + DOCUMENTS[: step % len(DOCUMENTS)]  # rows change places
    segments = torch.stack([torch.repeat_interleave(torch.arange(len(d)), torch.tensor(d)) for d in documents])
    return {"tokens": tokens, "segments": segments}


def _train(config, out=None):
    """STEPS training steps on this rank on :func:`_batch`'s rows (documents that change places): the
    runner's worker dict (tests/_layouts.py), the first step's gradients as the optimizer read them."""
    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.loop import batch_segments, split_batch, train_step

    par = config.parallel
    mesh = Mesh(par.mesh_axes)
    engine = build_engine(config, mesh)
    data_rank, rows = mesh.group_rank(par.batch_axes), ROWS // par.data_ranks
    losses, norms, first = [], [], []

    def keep_first_gradients():
        if not first:
            first.extend(gradient_pieces(engine))

    for step in range(STEPS):
        batch = {k: v[data_rank * rows : (data_rank + 1) * rows] for k, v in _batch(step).items()}
        inputs, targets = split_batch(config, batch)
        segments = batch_segments(config, batch)
        measured = train_step(engine, inputs, targets, LR, keep_first_gradients, segments)
        loss, norm = measured.loss, measured.grad_norm
        losses.append(loss)
        norms.append(norm)
    return {
        **where(mesh),
        "numbers": losses + norms,
        "grads": first,
        "params": parameter_pieces(engine),
        "buffers": buffer_pieces(engine),
    }


LAYOUTS = [
    layout("tp2"),
    layout("tp2-sp"),
    layout("cp2-ring"),
    layout("cp2-allgather"),
    layout("cp3-ring"),
    layout("cp3-allgather"),
    # Ulysses: the model's own core windows the whole sequence of each rank's heads, with their sinks
    layout("cp2-ulysses"),
    layout("cp2x2-ulysses-ring"),
    layout("cp2xtp2-ulysses", LONG),
    # the sliding block and the full one on different stages; sinks sharded by ZeRO-3 like any parameter
    layout("pp2-1f1b"),
    layout("dp2-zero3"),
]


@pytest.mark.parametrize("name", LAYOUTS)
def test_windows_and_sinks_train_as_on_one_process(parity, tmp_path, name):
    # three steps on random tokens: the losses need not fall
    compared = parity.check(name, _config, TOLERANCE, tmp_path, worker=_train, learns=False)
    assert any(n.endswith("attn.sinks") for n in compared.names["params"])


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
    from polyshard.models.hf_adapters import hf_adapter_of

    llama = from_dict({"model": {**LLAMA, "num_kv_heads": 2}}).model
    assert hf_adapter_of(llama).title == "Llama"  # the same model without them is a Llama
    key = next(iter(extra))
    with pytest.raises(CheckpointError, match=f"Llama would need .*{key}="):
        hf_adapter_of(from_dict({"model": {**LLAMA, "num_kv_heads": 2, **extra}}).model)
