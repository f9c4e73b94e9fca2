"""The reducer's behaviour beyond parity: overlap with backward, unused parameters, frozen ones,
and parameter sets that reduce over their own groups (experts over dp, the rest over dp x ep)."""

import torch
import torch.distributed as dist
from torch import nn

from polyshard.dp import DataParallel, ParamSet
from polyshard.mesh import Mesh, Replicate, get_placement

from ._helpers import batch, local_rows, make_model

EXACT_ENOUGH = {"rtol": 1e-5, "atol": 1e-6}  # float32 sums in another order (a few ulps), as in test_parity


def _overlap():
    model = DataParallel(make_model(), group=dist.group.WORLD, bucket_cap_mb=0.001)
    buckets = model.buckets()
    first_layer_weight = model.module[0][0].weight  # its gradient is the last one backward produces
    seen = {}

    def at_last_grad(_):
        # Still inside backward: how many buckets have already started reducing?
        seen["launched"] = sum(b.launched for b in buckets)
        seen["in_flight"] = sum(b.work is not None for b in buckets)

    first_layer_weight.register_post_accumulate_grad_hook(at_last_grad)
    x, y = (local_rows(t, dist.get_rank(), dist.get_world_size()) for t in batch(0))
    nn.functional.mse_loss(model(x), y).backward()
    model.finish_grad_sync()
    return len(buckets), seen


def test_bucket_reduction_starts_before_backward_ends(distributed):
    for num_buckets, seen in distributed.run(2, _overlap):
        assert num_buckets >= 3
        # The buckets holding later layers were launched while the first layer's
        # gradient was still being computed, i.e. before backward ended.
        assert seen["launched"] >= 1
        assert seen["in_flight"] >= 1


class _TwoHeads(nn.Module):
    """``head_b`` is used only on rank 1, ``spare`` on no rank, ``frozen`` never trains."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        # Registration order sets the bucket order (reversed): head_b's bucket comes
        # first, so rank 1 launches buckets during backward while rank 0 launches
        # them all in finish_grad_sync; both must still pair up.
        self.spare = nn.Linear(6, 2)
        self.trunk = nn.Linear(6, 6)
        self.head_a = nn.Linear(6, 2)
        self.head_b = nn.Linear(6, 2)
        self.frozen = nn.Linear(6, 6).requires_grad_(False)

    def forward(self, x, use_b: bool):
        h = torch.tanh(self.trunk(self.frozen(x)))
        return self.head_a(h) + (self.head_b(h) if use_b else 0)


def _unused_params():
    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(7))
    ref = _TwoHeads()
    for r in range(n):  # reference: sum of every rank's mean loss / n
        (ref(local_rows(x, r, n), use_b=r == 1).square().mean() / n).backward()
    model = DataParallel(_TwoHeads(), group=dist.group.WORLD, bucket_cap_mb=0.0001)
    model(local_rows(x, rank, n), use_b=rank == 1).square().mean().backward()
    model.finish_grad_sync()  # must not hang although buckets of head_b/spare never completed on rank 0
    frozen = model.module.frozen.weight
    trainable = {}
    for (name, p), (_, p_ref) in zip(model.module.named_parameters(), ref.named_parameters()):
        if not p.requires_grad:
            continue
        trainable[name] = {"grad": p.grad, "ref_grad": p_ref.grad, "placement": get_placement(p).placement("dp")}
    return {"frozen_grad": frozen.grad, "frozen_record": get_placement(frozen), "trainable": trainable}


def test_unused_and_frozen_parameters(distributed):
    results = distributed.run(2, _unused_params)
    assert len(results) == 2
    trainable = {f"{module}.{p}" for module in ("spare", "trunk", "head_a", "head_b") for p in ("weight", "bias")}
    for r in results:
        assert r["frozen_grad"] is None and r["frozen_record"] is None
        assert set(r["trainable"]) == trainable
        for name, seen in r["trainable"].items():
            if seen["ref_grad"] is None:  # unused on every rank: no gradient, as on one process (not zeros)
                assert seen["grad"] is None, name
            else:
                torch.testing.assert_close(seen["grad"], seen["ref_grad"], **EXACT_ENOUGH, msg=name)
            assert seen["placement"] == Replicate()
        # spare is the parameter no rank uses; head_b's gradient comes from rank 1 alone.
        assert r["trainable"]["spare.weight"]["ref_grad"] is None
        assert r["trainable"]["head_b.weight"]["ref_grad"] is not None


class _Moe(nn.Module):
    """A shared layer and one expert per ep coordinate (this rank's data goes to its own expert)."""

    def __init__(self, expert_seed: int):
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(5, 5)
        torch.manual_seed(100 + expert_seed)
        self.expert = nn.Linear(5, 3)

    def forward(self, x):
        return self.expert(torch.relu(self.shared(x)))


def _param_sets():
    mesh = Mesh({"dp": 2, "ep": 2})
    ep, world = mesh.coord("ep"), dist.get_world_size()
    x = torch.randn(16, 5, generator=torch.Generator().manual_seed(1))
    # Reference: one process holds the shared layer and both experts; the global
    # loss is the mean over all 16 rows, rows of rank r going to expert ep(r).
    refs = [_Moe(e) for e in range(2)]
    refs[1].shared = refs[0].shared
    for r in range(world):
        (refs[mesh.layout.coords(r)["ep"]](local_rows(x, r, world)).square().mean() / world).backward()
    model = _Moe(ep)
    sets = [ParamSet(list(model.expert.parameters()), mesh.group("dp"), divide_by=world)]
    model = DataParallel(model, group=mesh.group(("dp", "ep")), param_sets=sets)
    model(local_rows(x, dist.get_rank(), world)).square().mean().backward()
    model.finish_grad_sync()
    reference = dict(refs[ep].named_parameters())
    return {name: (p.grad, reference[name].grad) for name, p in model.module.named_parameters()}


def test_expert_params_reduce_over_their_own_group(distributed):
    results = distributed.run(4, _param_sets)
    assert len(results) == 4
    for grads in results:
        assert set(grads) == {"shared.weight", "shared.bias", "expert.weight", "expert.bias"}
        for name, (grad, expected) in grads.items():
            torch.testing.assert_close(grad, expected, **EXACT_ENOUGH, msg=name)


class _WithSpare(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = make_model()
        self.spare = nn.Linear(3, 3)  # no rank uses it: its gradient stays None

    def forward(self, x):
        return self.trunk(x)


def _solo():
    from polyshard.collectives import CommLedger

    rank, world = dist.get_rank(), dist.get_world_size()
    alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank joins every new group's creation
    reference, base = make_model(), _WithSpare()
    # The last block's gradients divided by 2 (as experts' are by every replica), the rest by the group's 1.
    sets = [ParamSet(list(base.trunk[2].parameters()), alone, divide_by=2)]
    model = DataParallel(base, group=alone, param_sets=sets)
    x, y = (local_rows(t, rank, world) for t in batch(0))
    nn.functional.mse_loss(reference(x), y).backward()
    with CommLedger() as ledger:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        model.finish_grad_sync()
    buckets = model.buckets()
    expected = {f"trunk.{n}": p.grad / (2 if n.startswith("2.") else 1) for n, p in reference.named_parameters()}
    grads = {n: (p.grad, model.grad_shard(p)) for n, p in model.module.named_parameters()}
    return [b.solo for b in buckets], [b.buffer for b in buckets], ledger.calls("all_reduce"), grads, expected


def test_a_one_rank_group_reduces_nothing_and_leaves_each_gradient_in_place(distributed):
    # A pipeline or tensor-parallel layout without dp: every bucket is solo, packs nothing, runs no
    # collective, and each gradient is autograd's own (divided where its set says), bit for bit.
    for solo, buffers, all_reduces, grads, expected in distributed.run(2, _solo):
        assert all(solo) and buffers == [None] * len(buffers) and all_reduces == 0
        assert grads.pop("spare.weight") == (None, None) and grads.pop("spare.bias") == (None, None)
        assert set(grads) == set(expected)
        for name, (grad, shard) in grads.items():
            assert shard is grad, name  # the reduced gradient is p.grad itself, not a copy
            assert torch.equal(grad, expected[name]), name


def _frozen_experts():
    mesh = Mesh({"dp": 1, "ep": 2})
    model = _Moe(mesh.coord("ep"))
    model.expert.requires_grad_(False)  # frozen beside adapters (LoRA): each ep rank keeps its own expert
    mine = model.expert.weight.detach().clone()
    sets = [ParamSet(list(model.expert.parameters()), mesh.group("dp"))]
    wrapped = DataParallel(model, group=mesh.group(("dp", "ep")), param_sets=sets)
    return torch.equal(wrapped.module.expert.weight, mine), len(wrapped.buckets())


def test_frozen_parameters_of_a_set_stay_replicated_over_its_group_only(distributed):
    # Before: every frozen parameter was broadcast over the wrapper's whole group, so ep rank 1's frozen
    # expert became rank 0's. Only the trainable shared layer has buckets.
    for kept, buckets in distributed.run(2, _frozen_experts):
        assert kept and buckets == 1
