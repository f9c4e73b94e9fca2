"""The expert-parallel MoE layer against a single-process MoE holding all experts.

Outputs, metrics, every gradient and the parameters after an SGD step must
match, for ep in {2, 4}, top-1 and top-2, both expert MLPs, with and without a
capacity factor, and with routing so uneven that experts and ranks get nothing.
"""

import pytest
import torch
import torch.distributed as dist

from polyshard.models.common.moe import expert_capacity

from .common import (
    TOL,
    ep_mesh,
    expert_slice,
    make_layer,
    parallel_copy,
    rank_targets,
    rank_tokens,
    run_parallel,
    run_reference,
)

TOKENS = 12  # per rank
NUM_EXPERTS = 8  # 4 per rank at ep=2, 2 per rank at ep=4


def _skew(layer, xs):
    """Make expert 0 every token's first choice: a constant feature that only expert 0's router row sees."""
    with torch.no_grad():
        layer.router.weight[:, 0] = 0.0
        layer.router.weight[0, 0] = 8.0
    for x in xs:
        x[:, 0] = 4.0  # logit of expert 0 is ~32, the others O(1)


def _compare_grads_and_step(reference, parallel, mesh):
    torch.testing.assert_close(parallel.router.weight.grad, reference.router.weight.grad, **TOL)
    for name in ("w1", "w2", "w3"):
        full = getattr(reference.experts, name)
        if full is None:
            continue
        torch.testing.assert_close(getattr(parallel.experts, name).grad, expert_slice(full.grad, mesh), **TOL)
    for module in (reference, parallel):
        torch.optim.SGD(module.parameters(), lr=0.5).step()
    torch.testing.assert_close(parallel.router.weight, reference.router.weight, **TOL)
    torch.testing.assert_close(parallel.experts.w1, expert_slice(reference.experts.w1, mesh), **TOL)
    torch.testing.assert_close(parallel.experts.w2, expert_slice(reference.experts.w2, mesh), **TOL)


def _parity(top_k, activation, capacity_factor, skewed):
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = ep_mesh()
    options = dict(top_k=top_k, activation=activation, num_experts=NUM_EXPERTS, capacity_factor=capacity_factor)
    # z-loss and no renormalisation in the gelu cases, so both router variants are covered.
    if activation == "gelu":
        options.update(z_loss_coef=0.01, renormalize=False)
    reference = make_layer(**options)
    xs = rank_tokens(world, TOKENS, 16)
    if skewed:
        _skew(reference, xs)
    xs = [x.requires_grad_() for x in xs]  # the input gradient is checked too
    targets = rank_targets(world, TOKENS, 16)
    parallel = parallel_copy(reference, mesh)
    x_parallel = xs[rank].detach().clone().requires_grad_()

    y_parallel = run_parallel(parallel, x_parallel, targets[rank], mesh)
    reference_metrics = []
    y_reference = []
    for x, target in zip(xs, targets):  # one rank's batch at a time, to keep each rank's metrics
        y_reference += run_reference(reference, [x], [target])
        reference_metrics.append(reference.last_metrics)
    # run_reference per batch summed the gradients; the union loss is their mean.
    for p in reference.parameters():
        p.grad.div_(world)

    torch.testing.assert_close(y_parallel, y_reference[rank], **TOL)
    # Each rank's input gradient is that of its own loss (activation grads are never averaged).
    torch.testing.assert_close(x_parallel.grad, xs[rank].grad, **TOL)
    mine, theirs = parallel.last_metrics, reference_metrics[rank]
    assert mine.tokens_per_expert == theirs.tokens_per_expert
    assert mine.dropped_assignments == theirs.dropped_assignments
    assert mine.aux_loss == pytest.approx(theirs.aux_loss, rel=1e-5)  # same routing, reduction order of T values
    _compare_grads_and_step(reference, parallel, mesh)
    return mine


CASES = [
    pytest.param(1, "swiglu", id="top1-swiglu"),
    pytest.param(2, "swiglu", id="top2-swiglu"),
    pytest.param(2, "gelu", id="top2-gelu-zloss-raw-weights"),
]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("top_k,activation", CASES)
def test_dropless_parity(distributed, world, top_k, activation):
    metrics = distributed.run(world, _parity, top_k, activation, None, False)
    assert all(m.dropped_assignments == 0 for m in metrics)
    # Every assignment is processed by exactly one expert somewhere.
    assert sum(sum(m.tokens_per_local_expert) for m in metrics) == world * TOKENS * top_k


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("top_k", [1, 2])
def test_uneven_routing_parity(distributed, world, top_k):
    metrics = distributed.run(world, _parity, top_k, "swiglu", None, True)
    for m in metrics:
        assert m.tokens_per_expert[0] == TOKENS  # every token chose expert 0
    # Expert 0 (on rank 0) received every rank's tokens; with top-1 all other experts got none.
    assert metrics[0].tokens_per_local_expert[0] == world * TOKENS
    if top_k == 1:
        assert all(sum(m.tokens_per_local_expert) == 0 for m in metrics[1:])


def _one_call_equals_per_rank(top_k):
    """Dropless routing is per token: one call on all ranks' tokens gives the per-rank outputs."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = ep_mesh()
    reference = make_layer(top_k=top_k, num_experts=NUM_EXPERTS)
    xs = rank_tokens(world, TOKENS, 16)
    parallel = parallel_copy(reference, mesh)
    with torch.no_grad():
        y_all, _ = reference(torch.cat(xs))
        y_mine, _ = parallel(xs[rank])
    return y_mine, y_all.split(TOKENS)[rank].clone()


@pytest.mark.parametrize("top_k", [1, 2])
def test_parallel_equals_one_call_on_all_tokens(distributed, top_k):
    results = distributed.run(4, _one_call_equals_per_rank, top_k)
    assert len(results) == 4
    for y_mine, y_expected in results:
        assert y_mine.shape == (TOKENS, 16)
        torch.testing.assert_close(y_mine, y_expected, **TOL)


def _naive_capacity_moe(layer, x, capacity):
    """Independent per-rank capacity rule: first choices before second, earlier tokens first."""
    routing = layer.router(x)
    num_tokens, top_k = routing.experts.shape
    used = [0] * layer.config.num_experts
    kept = torch.zeros(num_tokens, top_k, dtype=torch.bool)
    for slot in range(top_k):
        for t in range(num_tokens):
            e = int(routing.experts[t, slot])
            if used[e] < capacity:
                used[e] += 1
                kept[t, slot] = True
    w1, w2, w3 = layer.experts.w1, layer.experts.w2, layer.experts.w3
    rows = []
    for t in range(num_tokens):
        row = torch.zeros(x.shape[1])
        for slot in range(top_k):
            if kept[t, slot]:
                e = int(routing.experts[t, slot])
                hidden = torch.nn.functional.silu(x[t] @ w1[e]) * (x[t] @ w3[e])
                row = row + routing.weights[t, slot] * (hidden @ w2[e])
        rows.append(row)
    return torch.stack(rows).detach(), kept


def _capacity(top_k, capacity_factor):
    world, rank = dist.get_world_size(), dist.get_rank()
    metrics = _parity(top_k, "swiglu", capacity_factor, True)  # skewed, so expert 0 overflows
    reference = make_layer(top_k=top_k, num_experts=NUM_EXPERTS, capacity_factor=capacity_factor)
    xs = rank_tokens(world, TOKENS, 16)
    _skew(reference, xs)
    capacity = expert_capacity(TOKENS, top_k, NUM_EXPERTS, capacity_factor)
    y_naive, kept = _naive_capacity_moe(reference, xs[rank], capacity)
    parallel = parallel_copy(reference, ep_mesh())
    with torch.no_grad():
        y_parallel, _ = parallel(xs[rank])
    torch.testing.assert_close(y_parallel, y_naive, **TOL)
    assert parallel.last_metrics.dropped_assignments == int((~kept).sum())
    fully_dropped = ~kept.any(dim=1)
    assert parallel.last_metrics.dropped_tokens == int(fully_dropped.sum())
    assert torch.equal(y_parallel[fully_dropped], torch.zeros_like(y_parallel[fully_dropped]))
    return metrics.dropped_assignments


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("top_k,capacity_factor", [(1, 1.0), (2, 0.5)])
def test_capacity_drops_match_reference(distributed, world, top_k, capacity_factor):
    dropped = distributed.run(world, _capacity, top_k, capacity_factor)
    # Every token wants expert 0 and each rank lets ceil(factor*T*k/E) of them in, so drops are certain.
    capacity = expert_capacity(TOKENS, top_k, NUM_EXPERTS, capacity_factor)
    assert all(d >= TOKENS - capacity for d in dropped)
