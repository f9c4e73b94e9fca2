"""Muon in polyshard.dp: the Newton-Schulz iteration, and the optimizer under ZeRO against one process.

The ZeRO runs shard the helpers' model (a 7-row head: padded rows on 2 and 3 ranks) and step it with
polyshard.dp.Muon inside a ZeroOptimizer; each matrix is gathered whole to one owner rank, orthogonalised
and scattered back. The reference is Muon written plainly below, on one process and the whole batch.
"""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from polyshard.collectives import CommLedger
from polyshard.dp import DataParallel, FullyShardedDataParallel, Muon, ZeroOptimizer, orthogonalise, shape_scale
from polyshard.mesh import Mesh
from tests._bounds import reordered_sum

from ._helpers import LR, STEPS, WEIGHT_DECAY, batch, local_step_loss, make_model


def plain_newton_schulz(g, steps=5):
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def test_orthogonalise_pushes_every_singular_value_near_one():
    g = torch.randn(48, 20, generator=torch.Generator().manual_seed(0)) @ torch.diag(torch.logspace(-1, 1, 20))
    out = orthogonalise(g)
    singular = torch.linalg.svdvals(out)
    # The quintic trades exactness for speed: five steps leave each value in about [0.7, 1.2]
    # (Keller Jordan's note); singular values 100x apart in g all land there (a value 1e-3 of the
    # norm would not yet: five steps lift a small value ~3.4^5 = 480x).
    assert singular.min() > 0.6 and singular.max() < 1.25
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    cosine = (out * (u @ vh)).sum() / (out.norm() * (u @ vh).norm())
    assert cosine > 0.98  # the polar factor's direction
    # The same iteration; float32 round-off of values ~0.2 (the norm over dims, the polynomial grouped otherwise).
    torch.testing.assert_close(out, plain_newton_schulz(g), rtol=0, atol=1e-5)


def test_a_stack_is_orthogonalised_matrix_by_matrix_and_zeros_stay_zero():
    stack = torch.randn(3, 16, 24, generator=torch.Generator().manual_seed(1))
    stack[1] = 0
    out = orthogonalise(stack)
    for e in (0, 2):
        # The batched matmuls against one matrix's: the same products (fan-in 16 and 24) possibly blocked
        # otherwise by the kernel, over the iteration's few steps, on values ~0.2: reordered_sum(5 x 40,
        # 0.2) ~ 5e-6 worst case; round-off stays ~1e-7 in practice and a mixed-up matrix differs by ~0.2.
        torch.testing.assert_close(out[e], orthogonalise(stack[e]), rtol=0, atol=reordered_sum(5 * 40, 0.2))
    assert torch.equal(out[1], torch.zeros(16, 24))
    assert shape_scale((3, 16, 24)) == pytest.approx(0.2 * math.sqrt(24))


def test_muon_refuses_vectors_in_a_muon_group():
    with pytest.raises(ValueError, match="Muon steps matrices"):
        Muon([{"params": [nn.Parameter(torch.zeros(4))], "muon": True}])


class PlainMuon:
    """Muon for the weights, AdamW for the biases, on whole tensors."""

    def __init__(self, model, momentum=0.95):
        self.weights = [p for p in model.parameters() if p.dim() == 2]
        self.adamw = torch.optim.AdamW(
            [p for p in model.parameters() if p.dim() == 1], lr=LR, weight_decay=0.0, betas=(0.9, 0.95)
        )
        self.buffers = {p: torch.zeros_like(p) for p in self.weights}
        self.momentum = momentum

    @torch.no_grad()
    def step(self):
        self.adamw.step()
        for p in self.weights:
            buf = self.buffers[p].mul_(self.momentum).add_(p.grad)
            ortho = plain_newton_schulz(p.grad + self.momentum * buf)
            p.mul_(1 - LR * WEIGHT_DECAY).sub_(LR * 0.2 * math.sqrt(max(p.shape)) * ortho)

    def zero_grad(self):
        self.adamw.zero_grad()
        for p in self.weights:
            p.grad = None


def _reference():
    model = make_model()
    opt = PlainMuon(model)
    for step in range(STEPS):
        x, y = batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _muon_run(strategy):
    world = dist.get_world_size()
    mesh = Mesh({"dp": world})
    model = make_model()
    if strategy == "zero3":
        wrapped = FullyShardedDataParallel(model, group=mesh.group("dp"))
    else:
        wrapped = DataParallel(model, group=mesh.group("dp"), zero_stage=1, bucket_cap_mb=0.001)
    weights = [p for p in wrapped.parameters() if p.dim() == 2]
    biases = [p for p in wrapped.parameters() if p.dim() == 1]
    groups = [{"params": weights, "muon": True, "weight_decay": WEIGHT_DECAY}, {"params": biases}]
    opt = ZeroOptimizer(Muon(groups, mesh=mesh, lr=LR), wrapped)
    for step in range(STEPS):
        local_step_loss(wrapped, step, 1, mesh.group("dp"))
        with CommLedger() as ledger:
            opt.step()
        opt.zero_grad()
    final = wrapped.full_parameters() if strategy == "zero3" else dict(wrapped.module.named_parameters())
    traffic = {op: (ledger.calls(op), ledger.total(op), ledger.wire(op)) for op in ("gather", "scatter")}
    return {n: p.detach().clone() for n, p in final.items()}, _reference(), traffic


@pytest.mark.parametrize("world, strategy", [(3, "zero1"), (2, "zero3")])
def test_muon_under_zero_matches_one_process(distributed, world, strategy):
    # The three weights (30, 12), (30, 30), (7, 30) in row blocks of ceil(rows / N): each rank's piece
    # of matrix k goes to rank k % N and comes back, once per step (the last step's ledger).
    pieces = [math.ceil(rows / world) * cols * 4 for rows, cols in ((30, 12), (30, 30), (7, 30))]
    for rank, (got, expected, traffic) in enumerate(distributed.run(world, _muon_run, strategy)):
        owned = sum(b for k, b in enumerate(pieces) if k % world == rank)
        assert traffic["gather"] == (3, sum(pieces), sum(pieces) - owned)  # calls, bytes, bytes this rank sent
        assert traffic["scatter"] == (3, sum(pieces), (world - 1) * owned)
        for name, value in expected.items():
            # float32; the ranks' gradient means are summed in another order (~1e-7 relative), which
            # Newton-Schulz passes on without growing much over five steps of lr 1e-2.
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
