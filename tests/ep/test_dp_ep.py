"""ep x dp on 4 ranks (dp=2, ep=2): the gradient recipe of polyshard.ep.parallel composes with data parallelism.

Expert grads are scaled by 1/ep here and averaged over dp (what a dp reducer
does with the expert parameters and the dp group); replicated grads are
averaged over dp x ep. The result must be the single-process gradient on all
four ranks' tokens.
"""

import torch
import torch.distributed as dist

from polyshard.collectives import ops
from polyshard.ep import apply_expert_parallel, average_replicated_gradients, expert_parameters, scale_expert_gradients
from polyshard.mesh import Mesh
from polyshard.models.common.moe import moe_metrics

from .common import TOL, local_loss, make_layer, rank_targets, rank_tokens, run_reference

TOKENS = 8


def _dp_ep():
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = Mesh({"dp": 2, "ep": 2})
    reference = make_layer(num_experts=4, top_k=2)
    xs, targets = rank_tokens(world, TOKENS, 16), rank_targets(world, TOKENS, 16)
    layer = apply_expert_parallel(make_layer(num_experts=4, top_k=2), group=mesh.group("ep"))

    y, aux = layer(xs[rank])
    local_loss(y, aux, targets[rank]).backward()
    scale_expert_gradients(layer, mesh.size("ep"))
    for param in expert_parameters(layer):  # the dp reducer's job for expert params
        ops.all_reduce(param.grad, mesh.group("dp"))
        param.grad.div_(mesh.size("dp"))
    average_replicated_gradients(layer, mesh.group(("dp", "ep")))

    y_reference = run_reference(reference, xs, targets)
    torch.testing.assert_close(y.detach(), y_reference[rank], **TOL)
    torch.testing.assert_close(layer.router.weight.grad, reference.router.weight.grad, **TOL)
    ep_rank = mesh.coord("ep")
    for name in ("w1", "w2", "w3"):
        full_grad = getattr(reference.experts, name).grad
        torch.testing.assert_close(getattr(layer.experts, name).grad, full_grad.chunk(2)[ep_rank], **TOL)
    return moe_metrics(layer)[""].tokens_per_expert


def test_dp_times_ep_gradients(distributed):
    counts = distributed.run(4, _dp_ep)
    assert all(sum(c) == TOKENS * 2 for c in counts)
