"""Muon (`optimizer.name = "muon"`): every layout against one process stepping a Muon written here.

The reference below is the textbook algorithm on whole tensors, in plain loops (Keller Jordan's
Newton-Schulz, Moonlight's 0.2 * sqrt(max(m, n)) scale), with torch's AdamW for the rest. Layouts run
polyshard's own Muon, which gathers each split matrix to one rank, orthogonalises it and scatters it
back (polyshard.dp.muon); their losses and final parameters must match the reference's.
"""

import dataclasses
import math

import pytest
import torch

from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from polyshard.trainer.loop import train
from tests._layouts import LAYOUTS, LONG, layout

STEPS = 6
# Layouts differ from one process only in the order float32 sums are taken (~1e-7 relative per
# operation). Muon's update has a fixed size whatever the gradient's, so round-off does not grow
# through the step as AdamW's can on near-zero moments; losses stay within DENSE_RTOL as in
# tests/trainer/test_e2e_parity.py.
DENSE_RTOL = 2e-5
# Parameters after six steps: the worst measured difference is ~3e-6, on a bias AdamW steps (its
# update divides by the root of a near-zero second moment, magnifying round-off, as in
# test_e2e_parity's exported-checkpoint test); Muon's matrices differ by less. 2e-5 leaves room for
# other summation orders and is ~100x below what six steps move each matrix (checked below).
PARAM_ATOL = 2e-5


def _config(corpus, kind="gpt", llama=False, **parallel):
    model = {"kind": kind, "hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16}
    if kind == "moe-gpt":
        model["aux_loss_weight"] = 0.0  # the aux loss is per data rank: without it layouts do the same maths
    if llama:
        model |= {"norm": "rms", "activation": "swiglu", "positions": "rope", "bias": False, "num_kv_heads": 2}
    return from_dict(
        {
            "model": model,
            "parallel": parallel,
            "training": {
                "steps": STEPS,
                "global_batch_size": 12,  # divides over 1, 2, 3 and 4 data ranks
            },
            "optimizer": {
                "lr": 3e-3,
                "name": "muon",
            },
            "lr_schedule": {
                "warmup_steps": 2,
            },
            "eval": {
                "every": 0,
                "sample_tokens": 0,
            },
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
        }
    )


# -- the reference: Muon written plainly ------------------------------------------------------------


def plain_newton_schulz(g, steps=5):
    """Keller Jordan's iteration on one matrix, float32."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def is_block_matrix(name, p):
    return p.dim() >= 2 and (".attn." in name or ".mlp." in name) and ".router." not in name


def decays(name, p):
    return p.dim() >= 2 and not any(part in name for part in ("tok.", "pos.", ".cls", ".pos"))


class PlainMuon:
    """Muon on the blocks' matrices (stacked experts one by one), AdamW on the rest."""

    def __init__(self, named, weight_decay, momentum=0.95):
        named = [(n, p) for n, p in named if p.requires_grad]
        self.matrices = [p for n, p in named if is_block_matrix(n, p)]
        rest = [(n, p) for n, p in named if not is_block_matrix(n, p)]
        self.adamw = torch.optim.AdamW(
            [
                {"params": [p for n, p in rest if decays(n, p)], "weight_decay": weight_decay},
                {"params": [p for n, p in rest if not decays(n, p)], "weight_decay": 0.0},
            ],
            betas=(0.9, 0.95),
        )
        self.muon_group = {"params": self.matrices, "lr": 0.0}
        self.param_groups = [*self.adamw.param_groups, self.muon_group]
        self.buffers = {}
        self.weight_decay, self.momentum = weight_decay, momentum

    @property
    def state(self):  # what keep_idle_experts reads
        return {**self.adamw.state, **{p: {"momentum_buffer": b} for p, b in self.buffers.items()}}

    @torch.no_grad()
    def step(self):
        self.adamw.step()
        lr = self.muon_group["lr"]
        for p in self.matrices:
            if p.grad is None:
                continue
            buf = self.buffers.setdefault(p, torch.zeros_like(p))
            buf.mul_(self.momentum).add_(p.grad)
            update = p.grad + self.momentum * buf  # Nesterov
            matrices = update.reshape(-1, *update.shape[-2:])  # experts one by one
            ortho = torch.stack([plain_newton_schulz(m) for m in matrices]).reshape(update.shape)
            p.mul_(1 - lr * self.weight_decay)
            p.sub_(lr * 0.2 * math.sqrt(max(p.shape[-2:])) * ortho)

    def zero_grad(self, set_to_none=True):
        self.adamw.zero_grad(set_to_none=set_to_none)
        for p in self.matrices:
            p.grad = None


def _reference(config):
    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.engine.schedule import schedule_of
    from polyshard.trainer.loop import make_loaders, split_batch, train_step

    mesh = Mesh(config.parallel.mesh_axes)
    engine = build_engine(config, mesh)
    names = engine.global_names(0)
    named = [(names[n], p) for n, p in engine.stages[0].named_parameters()]
    initial = {n: p.detach().clone() for n, p in named}
    engine.optimizers[:] = [PlainMuon(named, config.optimizer.weight_decay)]
    schedule = schedule_of(config)
    data, _ = make_loaders(config, mesh)
    losses = [train_step(engine, *split_batch(config, data.next_batch()), lr=schedule(s)).loss for s in range(STEPS)]
    return losses, {n: p.detach().clone() for n, p in named}, initial


def _train(config, out):
    return train(config, Mesh(config.parallel.mesh_axes), out, log=False).losses


def _parameters(out):
    from polyshard.trainer.checkpointing.run_export import consolidate

    return consolidate(sorted((out / "checkpoints").iterdir())[-1])


@pytest.fixture(scope="module")
def reference(distributed, corpus):
    """kind -> (losses, final parameters, initial parameters) of the plain Muon, run once when first asked."""
    runs = {}

    def of(kind, llama=False):
        if (kind, llama) not in runs:
            runs[kind, llama] = distributed.run(1, _reference, _config(corpus, kind, llama))[0]
        return runs[kind, llama]

    return of


ROWS = [
    layout("one-process", LONG, model="gpt"),
    layout("dp2-zero1", model="gpt"),
    layout("tp2", model="gpt"),
    layout("ep2", LONG, model="moe-gpt"),
    layout("dp2", LONG, model="gpt"),
    layout("dp2-zero3", LONG, model="gpt"),
    layout("tp2-sp", LONG, model="gpt"),
    layout("pp2-1f1b", LONG, model="gpt"),
    layout("dp2xtp2-zero2", LONG, model="gpt"),  # ZeRO rows of tp slices: each matrix gathered from four ranks
    layout("dp3-zero1", LONG, model="gpt"),  # three ranks: rows split unevenly (padding), owners 0, 1, 2, 0, ...
    layout("dp2xtp2xpp2", LONG, model="gpt"),
    layout("dp2xep2-zero1", LONG, model="moe-gpt"),
    layout("pp2-interleaved", LONG, model="gpt"),  # two stages per rank: two optimizers step one after the other
    # hybrid sharding: ZeRO rows over dp_shard=2 only, replicated across the two dp_replicate groups
    layout("dp4-shard2-zero3", LONG, model="gpt"),
    # Llama's 2 kv heads on tp=4: k/v whole on every tp rank (replicated, no gather), q/o/MLP in 4 pieces
    layout("tp4", LONG, model="llama"),
]


@pytest.mark.parametrize("kind, name", ROWS)
def test_muon_matches_the_plain_reference(distributed, corpus, reference, tmp_path, kind, name):
    world, parallel = LAYOUTS[name]
    llama = kind == "llama"
    kind = "gpt" if llama else kind
    config = _config(corpus, kind, llama, **parallel)
    results = distributed.run(world, _train, config, tmp_path)
    assert all(r == results[0] for r in results)  # every rank reports the same global losses
    losses, params, initial = reference(kind, llama)
    assert results[0] == pytest.approx(losses, rel=DENSE_RTOL)
    assert results[0][-1] < results[0][0]  # it learns
    got = _parameters(tmp_path)
    assert set(got) == set(params)
    errors = {name: float((got[name] - value).abs().max()) for name, value in params.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= PARAM_ATOL, f"{worst}: {errors[worst]:.3g}"  # see PARAM_ATOL
    for name, value in params.items():
        if is_block_matrix(name, value):  # ... far below how far Muon moved each matrix
            assert (value - initial[name]).abs().max() > 50 * PARAM_ATOL, name


# -- resume and reshard ----------------------------------------------------------------------------------


def _stop_and_resume(config, out):
    mesh = Mesh(config.parallel.mesh_axes)
    whole = train(config, mesh, out / "whole", log=False).losses
    half = dataclasses.replace(config, training=dataclasses.replace(config.training, stop_at=STEPS // 2))
    train(half, mesh, out / "split", log=False)
    resumed = train(config, mesh, out / "split", log=False, resume=True).losses
    return whole, resumed


@pytest.mark.parametrize(
    "world, kind, parallel",
    [
        pytest.param(2, "gpt", {"tp": 2, "zero_stage": 1}, id="tp2-zero1"),
        pytest.param(4, "gpt", {"dp": 2, "tp": 2, "zero_stage": 3}, id="dp2xtp2-zero3", marks=pytest.mark.long),
        pytest.param(4, "moe-gpt", {"dp": 2, "ep": 2, "pp": 1}, id="dp2xep2", marks=pytest.mark.long),
    ],
)
def test_resume_is_bitwise_identical(distributed, corpus, tmp_path, world, kind, parallel):
    # The momentum buffers are saved and restored like AdamW's moments: the resumed run is the same run.
    config = _config(corpus, kind, **parallel)
    for whole, resumed in distributed.run(world, _stop_and_resume, config, tmp_path):
        assert resumed == whole  # exact: same data, same state, same order of operations on CPU
    whole, resumed = _parameters(tmp_path / "whole"), _parameters(tmp_path / "split")
    for name, value in whole.items():
        assert torch.equal(resumed[name], value), name


def _train_saving(config, out, resume=False):
    return train(config, Mesh(config.parallel.mesh_axes), out, log=False, resume=resume).losses


def _global_state(folder):
    from polyshard.checkpoint import Checkpoint

    source = Checkpoint(folder)
    return {
        key: source.read(key, tuple(0 for _ in source.global_shape(key)), source.global_shape(key), source.dtype(key))
        for key in source.pieces
        if key.startswith(("model/", "optim/"))
    }


@pytest.mark.parametrize(
    "world, parallel, target_world, target",
    [
        pytest.param(2, {"tp": 2}, 2, {"dp": 2, "zero_stage": 1}, id="tp2->zero1"),
        pytest.param(
            4,
            {"dp": 2, "tp": 2, "zero_stage": 2},
            2,
            {"pp": 2, "microbatches": 2},
            id="dp2xtp2-zero2->pp2",
            marks=pytest.mark.long,
        ),
    ],
)
def test_momentum_reshards_and_training_continues(distributed, corpus, tmp_path, world, parallel, target_world, target):
    from polyshard.checkpoint import step_dir
    from polyshard.trainer.checkpointing.run_reshard import reshard

    config = _config(corpus, **parallel)
    config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, every=STEPS // 2, keep=4))
    losses = distributed.run(world, _train_saving, config, tmp_path / "source")[0]
    src = step_dir(tmp_path / "source" / "checkpoints", STEPS // 2)
    moved = _config(corpus, **target)
    moved = dataclasses.replace(moved, checkpoint=config.checkpoint)
    folder = reshard(src, tmp_path / "target" / "checkpoints", moved, max_block_bytes=4096).folder
    before, after = _global_state(src), _global_state(folder)
    buffers = [k for k in before if k.endswith("/momentum_buffer")]
    assert len(buffers) == 12  # 2 blocks x (q, k, v, o, fc_in, fc_out)
    assert set(after) - set(before) <= {k for k in after if k.endswith("/master")}  # ZeRO's masters may come or go
    for key, value in before.items():  # every weight, buffer and moment, bitwise, whatever the layout
        if not key.endswith("/master"):
            assert torch.equal(after[key], value), key
    continued = distributed.run(target_world, _train_saving, moved, tmp_path / "target", True)[0]
    assert continued[: STEPS // 2] == losses[: STEPS // 2]  # carried over from the checkpoint
    # Another layout sums in another order: as in the parity test above.
    assert continued[STEPS // 2 :] == pytest.approx(losses[STEPS // 2 :], rel=DENSE_RTOL)


def _resume_with_the_other_optimizer(config, out):
    from polyshard.checkpoint import CheckpointError

    adamw = dataclasses.replace(
        config,
        training=dataclasses.replace(config.training, stop_at=2),
        optimizer=dataclasses.replace(config.optimizer, name="adamw"),
    )
    mesh = Mesh(config.parallel.mesh_axes)
    train(adamw, mesh, out, log=False)
    try:
        train(config, mesh, out, log=False, resume=True)
    except CheckpointError as error:
        return str(error)
    return None


def test_a_checkpoint_of_the_other_optimizer_is_refused(distributed, corpus, tmp_path):
    message = distributed.run(1, _resume_with_the_other_optimizer, _config(corpus), tmp_path)[0]
    assert message is not None and "optimizer.name='muon' keeps ['momentum_buffer']" in message
    assert "['exp_avg', 'exp_avg_sq', 'step']" in message
    # The launcher refuses it before any process starts, from the checkpoint's index alone.
    from polyshard.checkpoint import CheckpointError
    from polyshard.trainer.runtime.launch import prepare_launch

    settings = dataclasses.asdict(_config(corpus))
    with pytest.raises(
        CheckpointError,
        match=r"optimizer.name='adamw', but this run sets 'muon'; resume with --set optimizer.name=adamw",
    ):
        prepare_launch(settings, out=tmp_path, nproc=1, resume=True)
