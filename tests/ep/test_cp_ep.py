"""A token group (context parallelism) under the MoE layer: cp ranks split each data rank's tokens.

The reference is one process holding all experts that runs each data rank's
whole batch (aux and z losses per batch, as GShard and the ep tests define
them). In the parallel run each of a data rank's cp ranks routes its part of
the batch; with :func:`polyshard.ep.share_routing_statistics` every cp rank
must report that batch's own aux loss, and after the trainer's gradient
recipe (experts summed over cp and divided by ep x cp, the rest averaged over
ep x cp) every gradient must be the reference's. Splits are uneven on
purpose: the group sums token counts, so it needs no equal chunks.
"""

import pytest
import torch
import torch.distributed as dist

from polyshard.collectives import ops
from polyshard.ep import (
    ExpertParallelError,
    apply_expert_parallel,
    average_replicated_gradients,
    expert_parameters,
    share_routing_statistics,
)
from polyshard.mesh import Mesh
from polyshard.models.common.moe import moe_metrics

from .common import TOL, expert_slice, make_layer, rank_targets, rank_tokens

HIDDEN = 16
OPTIONS = dict(num_experts=4, top_k=2, z_loss_coef=0.01)  # the z-loss too: its mean over tokens also spans cp


def _batch_losses(layer, xs, targets):
    """One process: each data rank's whole batch; loss = mean over batches of (token mean + aux)."""
    outputs, auxes, losses = [], [], []
    for x, target in zip(xs, targets):
        y, aux = layer(x)
        outputs.append(y.detach())
        auxes.append(float(aux))
        losses.append((y * target).sum(dim=-1).mean() + aux)
    torch.stack(losses).mean().backward()
    return outputs, auxes


def _contiguous(splits):
    """Each rank's token indices when rank c holds the c-th of consecutive runs of ``splits`` tokens."""
    starts = [sum(splits[:c]) for c in range(len(splits))]
    return [list(range(start, start + n)) for start, n in zip(starts, splits)]


def _load_balanced(cp, chunk):
    """polyshard.cp's layout: 2 cp chunks of ``chunk`` tokens, rank c holding chunks c and 2 cp - 1 - c."""
    return [[i for part in (c, 2 * cp - 1 - c) for i in range(part * chunk, (part + 1) * chunk)] for c in range(cp)]


def _cp_ep(ep, parts, capacity_factor=None):
    cp, rank = len(parts), dist.get_rank()
    mesh = Mesh({"ep": ep, "cp": cp})
    batch_tokens = sum(len(p) for p in parts)
    xs, targets = rank_tokens(ep, batch_tokens, HIDDEN), rank_targets(ep, batch_tokens, HIDDEN)
    options = dict(OPTIONS, capacity_factor=capacity_factor)
    reference = make_layer(**options)
    y_reference, aux_reference = _batch_losses(reference, xs, targets)

    layer = apply_expert_parallel(make_layer(**options), group=mesh.group("ep"))
    data, mine = mesh.coord("ep"), torch.tensor(parts[mesh.coord("cp")])  # this rank's tokens of its batch
    share_routing_statistics(layer, group=mesh.group("cp"), positions=mine)
    y, aux = layer(xs[data][mine])
    # The trainer's loss: this rank's token sum over the batch's count, times the replicas the
    # average divides by again (cp here), plus the batch's aux loss that every cp rank computes.
    token_sum = (y * targets[data][mine]).sum()
    (token_sum * cp / batch_tokens + aux).backward()
    for param in expert_parameters(layer):  # the trainer's recipe for experts: sum over cp, divide by ep x cp
        ops.all_reduce(param.grad, mesh.group("cp"))
        param.grad.div_(ep * cp)
    average_replicated_gradients(layer, mesh.group(("ep", "cp")))

    torch.testing.assert_close(y.detach(), y_reference[data][mine], **TOL)
    assert float(aux) == pytest.approx(aux_reference[data], rel=1e-6)  # float32 sums in another order
    torch.testing.assert_close(layer.router.weight.grad, reference.router.weight.grad, **TOL)
    for name in ("w1", "w2", "w3"):
        full = getattr(reference.experts, name).grad
        torch.testing.assert_close(getattr(layer.experts, name).grad, expert_slice(full, mesh), **TOL)
    metrics = moe_metrics(layer)[""]
    return rank, float(aux), metrics.aux_loss, sum(metrics.tokens_per_expert), metrics.dropped_assignments


@pytest.mark.parametrize(
    "ep, parts",
    [
        pytest.param(1, _contiguous((5, 3)), id="cp2-uneven"),
        pytest.param(2, _load_balanced(2, 2), id="cp2xep2"),
        pytest.param(1, _contiguous((2, 7, 3)), id="cp3-uneven", marks=pytest.mark.long),  # a 3-rank pool to start
    ],
)
def test_cp_ranks_compute_the_whole_batch_aux_loss(distributed, ep, parts):
    results = distributed.run(ep * len(parts), _cp_ep, ep, parts)
    cp = len(parts)
    for rank, aux, logged, assignments, _ in results:
        assert assignments == len(parts[rank % cp]) * OPTIONS["top_k"]  # each rank routed only its own tokens
        assert logged == aux  # the metrics log the batch's aux loss too
    for first in range(0, len(results), cp):  # the cp ranks of one data rank report one aux loss
        assert len({r[1] for r in results[first : first + cp]}) == 1


def test_the_capacity_rule_ranks_the_whole_batch(distributed):
    # 12 tokens per batch in polyshard.cp's layout (rank 0: tokens 0-2 and 9-11), capacity 1.0: at most
    # ceil(12 * 2 / 4) = 6 assignments per expert of the batch, served in the batch's token order. Outputs
    # and gradients equal the reference's (checked on the ranks), so the same assignments were dropped.
    results = distributed.run(4, _cp_ep, 2, _load_balanced(2, 3), 1.0)
    assert sum(r[4] for r in results) > 0  # assignments were dropped, exactly the reference's (checked on ranks)


def _own_tokens_only():
    """Without the group a cp rank's aux loss is its chunk's, which differs: the group is needed."""
    mesh = Mesh({"cp": 2})
    x = rank_tokens(1, 8, HIDDEN)[0]
    reference = make_layer(**OPTIONS)
    _, whole = reference(x)
    alone = make_layer(**OPTIONS)
    _, chunk = alone(x.chunk(2)[mesh.coord("cp")])
    shared = share_routing_statistics(make_layer(**OPTIONS), group=mesh.group("cp"))
    _, grouped = shared(x.chunk(2)[mesh.coord("cp")])
    return float(whole), float(chunk), float(grouped)


def test_without_the_group_a_chunk_has_its_own_aux_loss(distributed):
    for whole, chunk, grouped in distributed.run(2, _own_tokens_only):
        assert grouped == pytest.approx(whole, rel=1e-6)
        assert chunk != pytest.approx(whole, rel=1e-3)  # not linear in the tokens


def _capacity_needs_positions():
    mesh = Mesh({"cp": 2})
    with pytest.raises(ExpertParallelError, match="capacity_factor=1.25: .* pass positions="):
        share_routing_statistics(make_layer(capacity_factor=1.25), group=mesh.group("cp"))
    return True


def test_capacity_over_a_token_group_needs_the_positions(distributed):
    assert distributed.run(2, _capacity_needs_positions) == [True, True]
