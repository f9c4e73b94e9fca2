"""Multi-token prediction (model.mtp_depth, training.mtp_loss_weight) against a plain reference.

The reference below is written from torch ops on one process: the model's trunk (embedding, blocks,
head), then each depth as DeepSeek-V3 describes it (RMSNorm of the embedding of the token k ahead and
of the previous depth's hidden, concatenated, the (2H -> H) matrix, the depth's block, its norm, the
shared head), cross-entropy against the token k + 1 ahead where it exists (in the row, in the same
document), and loss = main + lambda / D * sum_k L_k, then torch.optim.AdamW with weight decay on the
matrices. It calls none of polyshard's multi-token prediction code. Each layout runs the trainer's
engine (build_engine, train_step) on the same global batch and must give the same losses, the same
MTP losses, every gradient of the first step and every parameter after the steps.
"""

import pytest
import torch
import torch.nn.functional as F

from polyshard.mesh import Mesh
from polyshard.models import build_model
from polyshard.models.spec import decays
from polyshard.trainer.config import from_dict
from polyshard.trainer.engine.mtp import shifted_tokens
from polyshard.trainer.errors import ConfigError
from tests._pieces import assemble, gradient_pieces, parameter_pieces, where

STEPS, ROWS, LENGTH, VOCAB, LR = 2, 4, 16, 67, 1e-3
# Layouts differ from one process only in the order float32 sums are taken (all-reduces, sharded
# matmuls, the vocabulary-parallel softmax, the ring's online softmax): ~1e-7 relative per op, a few
# AdamW steps compound it; gradients of size ~1e-3 then agree to ~1e-7 absolute.
TOL = {"rtol": 2e-5, "atol": 2e-6}
# AdamW divides each gradient by its own running magnitude: an element whose gradient is ~1e-8 takes a
# step of up to lr set by float32 noise (1.1e-5 seen at lr 1e-2, so ~1e-6 at lr 1e-3). Weight decay 2.0
# moves every decayed matrix by lr x 2.0 x |p| ~ 4e-5 a step, ten times this bound: a missed decay shows.
PARAM_TOL = {"rtol": 2e-5, "atol": 4e-6}


def _config(kind="gpt", depth=2, tie=False, weight=0.3, training=None, **parallel):
    model = {
        "kind": kind,
        "hidden": 32,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "context_length": LENGTH,
        "vocab_size": VOCAB,  # no multiple of tp: the head's padded rows are in the vocabulary-parallel loss
        "norm": "rms",
        "activation": "swiglu",
        "positions": "rope",
        "bias": False,
        "mlp_hidden": 40,
        "tie_embeddings": tie,
        "mtp_depth": depth,
    }
    if kind in ("moe-gpt", "deepseek-v3"):  # no balance loss: ep ranks route different rows (its gradient differs)
        model["moe"] = {"num_experts": 4, "top_k": 2, "aux_loss_coef": 0.0}
    if kind == "deepseek-v3":  # MLA in every block and depth, the first block dense, the depth's block sparse
        del model["num_kv_heads"]
        model["moe"]["dense_layers"] = [0]
        model |= {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}
    return from_dict(
        {
            "model": model,
            "parallel": parallel,
            "training": {
                "steps": STEPS,
                "global_batch_size": ROWS,
                "mtp_loss_weight": weight,
                **(training or {}),
            },
            "optimizer": {
                "grad_clip": 0.0,
                "weight_decay": 2.0,
            },
        }
    )


def _batch(documents=False):
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (STEPS, ROWS, LENGTH + 1), generator=generator)
    segments = None
    if documents:  # documents of 3 to 9 tokens, packed
        segments = torch.cumsum(torch.rand(STEPS, ROWS, LENGTH, generator=generator) < 0.2, dim=-1)
    return tokens[..., :-1], tokens[..., 1:], segments


# -- the plain reference --------------------------------------------------------------------------------


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference_loss(model, config, inputs, targets, segments):
    """(main loss, each depth's loss, the trained total) on one process, from torch ops."""
    depth, weight = config.model.mtp_depth, config.training.mtp_loss_weight
    layers = model.layers
    blocks = list(layers[1:-1])
    head = layers[-1]
    documents = None if segments is None else _documents(segments)
    hidden = layers[0](inputs, documents)
    for block in blocks:
        hidden = block(hidden, documents)
    tok, proj = layers[0].tok.weight, head.proj.weight
    eps = config.model.norm_eps  # the family's (DeepSeek: 1e-6)
    logits = _rms(hidden, head.norm.weight, eps) @ proj.T
    main = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    losses = []
    rows, length = inputs.shape
    for k in range(1, depth + 1):
        d = head.mtp.depths[k - 1]
        ahead = torch.zeros_like(inputs)
        ahead[:, : length - k] = inputs[:, k:]  # the token k places ahead (0 past the row: masked below)
        combined = torch.cat(
            [_rms(F.embedding(ahead, tok), d.embed_norm.weight, eps), _rms(hidden, d.hidden_norm.weight, eps)], -1
        )
        hidden = d.block(combined @ d.combine.weight.T, documents)
        logits_k = _rms(hidden, d.norm.weight, eps) @ proj.T
        wanted = torch.full_like(targets, -100)
        wanted[:, : length - k] = targets[:, k:]
        if segments is not None:  # the token k ahead belongs to another document: no target
            wanted[:, : length - k] = wanted[:, : length - k].masked_fill(segments[:, k:] != segments[:, :-k], -100)
        losses.append(F.cross_entropy(logits_k.flatten(0, 1), wanted.flatten(), ignore_index=-100))
    total = main + weight / depth * sum(losses)
    return main, losses, total


def _documents(segments):
    from polyshard.models.common import Documents, document_positions

    return Documents(segments, document_positions(segments))


def _reference(config, documents=False):
    model = build_model(config.model, seed=config.training.seed)
    named = dict(model.named_parameters())
    groups = [
        {"params": [p for n, p in named.items() if decays(n, p)], "weight_decay": config.optimizer.weight_decay},
        {"params": [p for n, p in named.items() if not decays(n, p)], "weight_decay": 0.0},
    ]
    t = config.optimizer
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=(t.beta1, t.beta2), foreach=False)
    inputs, targets, segments = _batch(documents)
    losses, grads = [], None
    for step in range(STEPS):
        main, mtp, total = _reference_loss(
            model, config, inputs[step], targets[step], None if segments is None else segments[step]
        )
        total.backward()
        losses.append([float(main.detach()), *(float(v.detach()) for v in mtp)])
        if step == 0:
            grads = {n: p.grad.clone() for n, p in named.items()}
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in named.items()}


# -- the engine on a layout -------------------------------------------------------------------------------


def _run(config, documents=False):
    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.loop import train_step

    mesh = Mesh(config.parallel.mesh_axes)
    engine = build_engine(config, mesh)
    par = config.parallel
    replica = mesh.coord("dp") * par.ep + mesh.coord("ep")  # this data rank's rows of the global batch
    share = ROWS // (par.dp * par.ep)
    rows = slice(replica * share, (replica + 1) * share)
    inputs, targets, segments = _batch(documents)
    losses, grads = [], []

    def keep_gradients():
        if not grads:
            grads.extend(gradient_pieces(engine))

    for step in range(STEPS):
        seg = None if segments is None else segments[step][rows]
        measured = train_step(engine, inputs[step][rows], targets[step][rows], LR, keep_gradients, seg)
        losses.append([measured.loss, *measured.mtp_losses])
    return {**where(mesh), "losses": losses, "grads": grads, "params": parameter_pieces(engine)}


@pytest.fixture(scope="module")
def references():
    return {}


def _expected(references, key, config, documents=False):
    if (key, documents) not in references:
        references[(key, documents)] = _reference(config, documents)
    return references[(key, documents)]


LAYOUTS = [
    pytest.param(1, "gpt", False, {}, True, id="one-process-documents"),
    pytest.param(2, "gpt", False, {"pp": 2, "microbatches": 2}, False, id="pp2"),
    pytest.param(2, "gpt", True, {"pp": 2, "microbatches": 2}, False, id="pp2-tied"),
    pytest.param(2, "gpt", False, {"tp": 2}, False, id="tp2"),
    pytest.param(2, "moe-gpt", False, {"ep": 2}, False, id="ep2"),
    pytest.param(2, "deepseek-v3", False, {"ep": 2}, False, id="deepseek-ep2"),
    pytest.param(1, "deepseek-v3", False, {}, True, id="deepseek-one-documents", marks=pytest.mark.long),
    pytest.param(2, "gpt", True, {"dp": 2, "zero_stage": 3}, False, id="dp2-zero3-tied"),
    pytest.param(2, "gpt", False, {"cp": 2}, True, id="cp2-documents"),
    # the V puts the embedding and the head (with the depths' copy of the embedding and the tied head's)
    # on one rank in two stages; make test-long keeps the suite's time
    pytest.param(
        2,
        "gpt",
        True,
        {"pp": 2, "microbatches": 4, "schedule": "zb-v", "virtual_stages": 2},
        False,
        id="pp2-zbv-tied",
        marks=pytest.mark.long,
    ),
    pytest.param(2, "gpt", False, {"dp": 2, "zero_stage": 3}, False, id="dp2-zero3", marks=pytest.mark.long),
    pytest.param(
        4, "moe-gpt", False, {"ep": 2, "pp": 2, "microbatches": 2}, True, id="ep2xpp2-documents", marks=pytest.mark.long
    ),
    pytest.param(4, "deepseek-v3", False, {"tp": 2, "cp": 2}, True, id="deepseek-tp2xcp2", marks=pytest.mark.long),
    # the chunked loss projects each depth's normed states with the shared head, vocabulary-parallel
    pytest.param(
        2, "gpt", False, {"tp": 2, "training": {"loss_chunks": 3}}, False, id="tp2-loss-chunks", marks=pytest.mark.long
    ),
]


@pytest.mark.parametrize("world, kind, tie, parallel, documents", LAYOUTS)
def test_layout_trains_the_plain_reference(distributed, references, world, kind, tie, parallel, documents):
    depth = 1 if kind in ("moe-gpt", "deepseek-v3") else 2
    config = _config(kind, depth, tie, **parallel)  # a "training" entry of parallel overrides [training]
    losses, grads, params = _expected(references, (kind, tie), _config(kind, depth, tie), documents)
    results = distributed.run(world, _run, config, documents)
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(losses), **TOL)
    got_grads, got_params = assemble(results, "grads"), assemble(results, "params")
    assert set(got_params) == set(params)  # every parameter, the shared embedding under its own name
    assert set(got_grads) == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name], grad, **TOL, msg=lambda m, n=name: f"gradient {n}: {m}")
    for name, value in params.items():
        torch.testing.assert_close(got_params[name], value, **PARAM_TOL, msg=lambda m, n=name: f"parameter {n}: {m}")


def test_shifted_targets_stop_at_the_row_and_at_document_ends():
    inputs = torch.arange(10, 16).view(1, 6)
    targets = inputs + 1
    segments = torch.tensor([[0, 0, 0, 1, 1, 1]])
    ahead, wanted = shifted_tokens(inputs, targets, 2, segments)
    assert ahead[0, :, 0].tolist() == [11, 12, 13, 14, 15, 0]
    assert ahead[0, :, 1].tolist() == [12, 13, 14, 15, 0, 0]
    # depth 1 at i reads token i + 1 and predicts i + 2; position 2's token ahead opens document 1, but
    # position 1 (reading document 0's last token) predicts document 1's first, as the main loss does
    assert wanted[0, :, 0].tolist() == [12, 13, -100, 15, 16, -100]
    assert wanted[0, :, 1].tolist() == [13, -100, -100, 16, -100, -100]


def test_refusals_name_the_setting():
    with pytest.raises(ConfigError, match="model.mtp_depth=-1 must be an integer >= 0"):
        _config(depth=-1)
    with pytest.raises(ConfigError, match="training.mtp_loss_weight=-0.5 must be a number >= 0"):
        _config(weight=-0.5)
    with pytest.raises(ConfigError, match="mtp_depth < context_length"):
        _config(depth=LENGTH)
    from polyshard.trainer.engine.constraints import validate

    with pytest.raises(ConfigError, match="model.mtp_depth=2 with model.kind='moe-gpt' is not supported"):
        validate(_config("moe-gpt", 2))
    with pytest.raises(ConfigError, match="with parallel.sequence_parallel is not supported"):
        validate(_config(tp=2, sequence_parallel=True))


def test_a_hugging_face_export_says_it_leaves_the_depths_out():
    from polyshard.trainer.checkpointing.hugging_face import export_note

    assert "the 2 multi-token prediction depth(s) (layers.3.mtp.*) are left out" in export_note(_config().model)
    assert export_note(_config(depth=0).model) is None  # a Llama without depths exports whole, nothing to say


def _add_depths(plain, with_depths, out):
    """Train ``plain`` one step (a checkpoint), then load it into an engine of ``with_depths``: the trunk's
    weights (name -> tensor) as trained, and the depths' as built."""
    from polyshard.checkpoint import MODEL, Checkpoint, latest_checkpoint
    from polyshard.trainer.checkpointing.run_reshard import load_into
    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.loop import train

    train(plain, Mesh(plain.parallel.mesh_axes), out, log=False)
    saved = Checkpoint(latest_checkpoint(out / "checkpoints"))
    engine = build_engine(with_depths, Mesh(with_depths.parallel.mesh_axes))
    built = {n: p.detach().clone() for n, p in engine.stages[0].named_parameters()}
    load_into(engine, saved)
    names = engine.global_names(0)
    loaded = {names[n]: p.detach().clone() for n, p in engine.stages[0].named_parameters()}
    return loaded, {names[n]: t for n, t in built.items()}, {n: saved.whole(MODEL + n) for n in saved.params()}


def test_depths_added_to_a_model_trained_without_them_start_as_built(distributed, corpus, tmp_path):
    def config(depth):
        return from_dict(
            {
                "model": {**_config(depth=depth).model.__dict__, "vocab_size": 260},
                "training": {"steps": 1, "global_batch_size": 2},
                "eval": {"every": 0, "sample_tokens": 0},
                "data": {"source": corpus},
                "logging": {"progress_bar": False},
            }
        )

    loaded, built, saved = distributed.run(1, _add_depths, config(0), config(2), tmp_path)[0]
    depths = [n for n in loaded if ".mtp." in n]
    assert depths and all(torch.equal(loaded[n], built[n]) for n in depths)
    trunk = [n for n in loaded if ".mtp." not in n]
    assert set(trunk) == set(saved) and all(torch.equal(loaded[n], saved[n]) for n in trunk)
    assert any(not torch.equal(built[n], saved[n]) for n in trunk)  # the trained step moved them: a real load
