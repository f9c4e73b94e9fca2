"""Document masking: a packed row of several documents trains exactly as its documents run one by one.

The reference is one process with no packing: each document alone through the same model (positions
from 0, attention over itself only). The masked packed run, on every layout, must give the same
per-token losses (from the last stage's logits) and the same gradients of the batch's mean loss.
Rows hold documents of different lengths, one crossing cp chunk boundaries, one of a single token, and
a row that is one whole document. A GPT (learned positions) and a Llama (rotary, grouped-query) both.
"""

import pytest
import torch
import torch.nn.functional as F

from polyshard.cp import local_positions
from polyshard.mesh import Mesh
from polyshard.models import build_model
from polyshard.trainer.config import from_dict
from polyshard.trainer.errors import ConfigError
from tests._layouts import LONG, mesh_row
from tests._pieces import assemble, gradient_pieces, where

VOCAB, CONTEXT, ROWS = 64, 24, 4
# Documents per row, in tokens of the row's CONTEXT + 1 (inputs are the first CONTEXT). Under cp=2 the
# inputs split into chunks of 6: row 0's second document spans positions 5..13, across two boundaries.
DOCUMENTS = [[5, 9, 11], [25], [1, 3, 14, 7], [12, 13]]
# float32 throughout: the packed run sums the same terms as the reference in another order (masked
# softmax over a whole row with zero weights elsewhere, tp all-reduces, cp's log-sum-exp merges, dp
# averages, the mean over rows instead of per document): differences of a few float32 ulps of O(1)
# values (at most ~1e-6 seen), well under 1e-5; a position or mask off by one moves them by ~1e-1.
TOL = 1e-5

LLAMA = {"norm": "rms", "activation": "swiglu", "positions": "rope", "bias": False, "num_kv_heads": 2}


# Dropless experts and no load-balancing loss (which depends on which tokens share a batch): each token's
# expert output is its own, so a document alone and in a packed row meet the same experts.
MOE = {"kind": "moe-gpt", "aux_loss_weight": 0.0}


def _config(llama=False, document_mask=True, moe=False, **parallel):
    checkpointing = parallel.pop("activation_checkpointing", False)
    model = {"vocab_size": VOCAB, "context_length": CONTEXT, "hidden": 32, "num_layers": 2, "num_heads": 4}
    return from_dict(
        {
            "model": {**model, **(LLAMA if llama else {}), **(MOE if moe else {})},
            "parallel": parallel,
            "training": {"global_batch_size": ROWS, "activation_checkpointing": checkpointing},
            "data": {"document_mask": document_mask},
        }
    )


def _batch(documents=DOCUMENTS):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, VOCAB, (ROWS, CONTEXT + 1), generator=g)
    segments = torch.stack([torch.repeat_interleave(torch.arange(len(d)), torch.tensor(d)) for d in documents])
    ends = torch.cat([torch.zeros(ROWS, 1, dtype=torch.bool), segments[:, 1:] != segments[:, :-1]], 1).roll(-1, 1)
    tokens[ends] = 0  # each document ends with an end-of-text token (0), which belongs to it
    return {"tokens": tokens, "segments": segments}


def _reference(config):
    """Each document alone through the model: per-token losses (ROWS, CONTEXT) and the gradients of
    their mean over the batch."""
    model = build_model(config.model, seed=config.training.seed)
    batch = _batch()
    tokens, segments = batch["tokens"], batch["segments"][:, :-1]
    losses = torch.zeros(ROWS, CONTEXT)
    total = 0.0
    for row in range(ROWS):
        for doc in segments[row].unique():
            where = (segments[row] == doc).nonzero().flatten()
            a, b = int(where[0]), int(where[-1]) + 1
            logits = model(tokens[row, a:b][None])[0]
            per_token = F.cross_entropy(logits.float(), tokens[row, a + 1 : b + 1], reduction="none")
            losses[row, a:b] = per_token.detach()
            total = total + per_token.sum()
    (total / (ROWS * CONTEXT)).backward()
    return losses, {n: p.grad for n, p in model.named_parameters()}


def _run(config, masked=True, documents=DOCUMENTS):
    """One training step's forward/backward and an evaluation forward of the same batch on this rank: its
    logits (or None), its pieces of the gradients (tests/_pieces.py), where it sits, the evaluation loss."""
    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.loop import batch_segments, evaluate, split_batch
    from polyshard.trainer.tasks.loss import tokens_per_microbatch

    par = config.parallel
    mesh = Mesh(par.mesh_axes)
    engine = build_engine(config, mesh)
    data_rank, rows = mesh.group_rank(par.batch_axes), ROWS // par.data_ranks
    batch = {k: v[data_rank * rows : (data_rank + 1) * rows] for k, v in _batch(documents).items()}
    inputs, targets = split_batch(config, batch)
    segments = batch_segments(config, batch) if masked else None
    local_inputs, local_targets = engine.local_tokens(inputs), engine.local_tokens(targets)
    group = mesh.group(par.replica_axes)
    tokens = tokens_per_microbatch(local_targets, group, par.microbatches)
    engine.forward_backward(local_inputs, local_targets, segments, tokens=tokens)
    engine.finish_gradients()
    grads = gradient_pieces(engine)
    logits = engine.forward_only(local_inputs, lambda y: y.detach().clone(), segments)
    val_loss = evaluate(engine, inputs, targets, segments)[0]
    return {**where(mesh), "logits": logits, "grads": grads, "data_rank": data_rank, "val_loss": val_loss}


def _logits(results, config):
    """Every rank's logits -> the full logits (ROWS, CONTEXT, VOCAB)."""
    par = config.parallel
    logits = torch.full((ROWS, CONTEXT, VOCAB), float("nan"))
    for result in results:
        piece, coords, data_rank = result["logits"], result["coords"], result["data_rank"]
        if piece is not None:
            rows = ROWS // par.data_ranks
            seq = local_positions(CONTEXT, coords.get("cp", 0), par.cp) if par.cp > 1 else torch.arange(CONTEXT)
            width = piece.shape[-1]
            vocab = (
                slice(coords.get("tp", 0) * width, (coords.get("tp", 0) + 1) * width) if width < VOCAB else slice(None)
            )
            logits[data_rank * rows : (data_rank + 1) * rows, seq, vocab] = piece.float()
    return logits


def _check_exact(config, results):
    reference_losses, reference_grads = _reference(config)
    logits, grads = _logits(results, config), assemble(results, "grads")
    targets = _batch()["tokens"][:, 1:]
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(ROWS, CONTEXT)
    torch.testing.assert_close(losses, reference_losses, rtol=TOL, atol=TOL)
    for result in results:  # the trainer's evaluation: the mean over the batch, on every rank
        assert result["val_loss"] == pytest.approx(float(reference_losses.mean()), rel=TOL)
    assert set(grads) == set(reference_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad.float(), reference_grads[name], rtol=TOL, atol=TOL, msg=name)


# selective recompute: kept matmul outputs replayed in both halves of the split backward; the ring redone
SELECTIVE = [
    mesh_row("pp2-zbh1", activation_checkpointing="selective", id="pp2-zbh1-selective"),
    mesh_row("cp2-ring", activation_checkpointing="selective", id="cp2-ring-selective"),
]
MESHES = [
    mesh_row("one-process"),
    mesh_row("tp2-sp"),
    mesh_row("pp2-1f1b", activation_checkpointing=True, id="pp2-1f1b-recompute"),
    mesh_row("pp2-zbh1", id="pp2-zbh1-split-backward"),
    mesh_row("dp2-zero3"),
    mesh_row("cp2-ring"),
    mesh_row("cp2-allgather"),
    # Ulysses gathers each row's document ids for the model's core; the 2-D scheme's ring masks its blocks
    mesh_row("cp2-ulysses"),
    mesh_row("cp2x2-ulysses-ring"),
    mesh_row("cp2xtp2-ulysses", LONG),
    *SELECTIVE,
    mesh_row("dp2xcp2xtp2-sp", LONG),
]


@pytest.mark.parametrize("llama", [False, True], ids=["gpt", "llama"])
@pytest.mark.parametrize("world, parallel", MESHES)
def test_masked_packed_rows_match_each_document_alone(distributed, world, parallel, llama):
    config = _config(llama, **parallel)
    _check_exact(config, distributed.run(world, _run, config))


@pytest.mark.parametrize(
    "world, parallel",
    [
        mesh_row("one-process"),
        mesh_row("ep2"),
        mesh_row("ep2", activation_checkpointing="selective", id="ep2-selective"),
        mesh_row("cp2xep2-ulysses", id="ep2xcp2-ulysses"),
    ],
)
def test_moe_masked_packed_rows_match_each_document_alone(distributed, world, parallel):
    config = _config(True, moe=True, **parallel)
    _check_exact(config, distributed.run(world, _run, config))


def _masked_and_plain(config):
    """One document per row: the masked run and the plain causal run on the same batch, same weights."""
    whole = [[CONTEXT + 1]] * ROWS
    return _run(config, True, whole), _run(config, False, whole)


@pytest.mark.parametrize("llama", [False, True], ids=["gpt", "llama"])
@pytest.mark.parametrize(
    "world, parallel",
    [
        mesh_row("one-process"),
        mesh_row("cp2-ring"),
        mesh_row("cp2-allgather"),
        mesh_row("cp2-ulysses"),
        *SELECTIVE,
    ],
)
def test_one_document_per_row_matches_the_plain_causal_run(distributed, world, parallel, llama):
    # The same softmax over the same keys summed in another order, float32 ulps of O(1) values, well under
    # TOL (1e-5): without cp the masked run takes the block-sparse core and the plain one SDPA; under cp ring
    # and all-gather the masked run's diagonal blocks carry their document mask through the float32 reference
    # kernel and the plain run's go through ATen's fused one (polyshard.cp.blocks); Ulysses runs the model's
    # own cores on whole sequences, as without cp.
    for masked, plain in distributed.run(world, _masked_and_plain, _config(llama, **parallel)):
        masked_logits, plain_logits = masked["logits"], plain["logits"]
        assert (masked_logits is None) == (plain_logits is None)
        assert len(masked["grads"]) == len(plain["grads"]) > 0
        pairs = [(masked_logits, plain_logits, "logits")] if masked_logits is not None else []
        for (name, grad, _), (_, plain_grad, _) in zip(masked["grads"], plain["grads"]):
            pairs.append((grad, plain_grad, name))
        for mine, theirs, name in pairs:
            torch.testing.assert_close(mine, theirs, rtol=TOL, atol=TOL, msg=name)


def test_validate_refuses_document_masking_without_documents():
    from polyshard.trainer.engine.constraints import validate

    config = from_dict({"model": {"kind": "vit"}, "data": {"source": "digits", "document_mask": True}})
    with pytest.raises(ConfigError, match=r"data.document_mask = true .* set data.document_mask = false"):
        validate(config)
    validate(from_dict({"model": {"kind": "vit"}, "data": {"source": "digits"}}))  # the default passes


def test_a_batch_without_document_ids_is_named():
    from polyshard.trainer.loop import batch_segments

    config = _config()
    with pytest.raises(ConfigError, match="'segments' column"):
        batch_segments(config, {"tokens": torch.zeros(2, CONTEXT + 1, dtype=torch.int64)})
    assert batch_segments(_config(document_mask=False), _batch()) is None


def test_positions_restart_at_each_document():
    from polyshard.models.common import document_positions

    segments = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    assert document_positions(segments).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]
