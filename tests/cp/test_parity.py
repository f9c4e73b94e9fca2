"""Ring and all-gather attention against ``F.scaled_dot_product_attention`` on the full sequence on
one process: outputs and dQ/dK/dV, gathered back into sequence order, for cp = 2, 3 and 4."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from polyshard.cp import context_parallel_attention, shard_sequence, unshard_sequence
from polyshard.mesh import Mesh

# float32 throughout. The ring merges per-block softmaxes with the log-sum-exp rule and sums dK/dV
# round the ring, so the same terms are added in another order than one softmax over all keys:
# differences of a few float32 ulps of O(1) values (at most 1.5e-6 seen), well under 1e-5.
RTOL, ATOL = 1e-5, 1e-5


def _parity(
    causal,
    style,
    batch=1,
    heads=4,
    kv_heads=2,
    head_dim=8,
    value_dim=8,
    chunk=3,
    dtype=torch.float32,
    scale=None,
    group=None,
    seed=0,
):
    cp = dist.get_world_size(group)
    seq = 2 * cp * chunk  # odd chunk length: S = 2 * cp * 3
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, seq, value_dim, generator=g).to(dtype)
    grad_out = torch.randn(batch, heads, seq, value_dim, generator=g).to(dtype)

    full = [t.detach().float().requires_grad_() for t in (q, k, v)]  # the reference runs in float32
    ref = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=True, scale=scale)
    ref.backward(grad_out.float())

    local = [shard_sequence(t, 2, group).detach().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, group, causal=causal, style=style, scale=scale)
    out.backward(shard_sequence(grad_out, 2, group))
    ours = [out.detach()] + [t.grad for t in local]
    gathered = [unshard_sequence(t, 2, group).float() for t in ours]
    return {
        name: (mine, reference.detach())
        for name, mine, reference in zip(("out", "dq", "dk", "dv"), gathered, [ref] + [t.grad for t in full])
    }


def _assert_all_close(results, rtol=RTOL, atol=ATOL):
    for rank, result in enumerate(results):
        for name, (ours, ref) in result.items():
            where = f"{name} on rank {rank}"
            torch.testing.assert_close(ours, ref, rtol=rtol, atol=atol, msg=lambda m, w=where: f"{w}: {m}")


@pytest.mark.parametrize("style", ["ring", "allgather"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_matches_sdpa_with_gqa(distributed, cp, causal, style):
    # 4 query heads share 2 key/value heads; B=1, D=8, S = 2 * cp * 3 (cp 3: an odd ring, chunk pairs
    # that skip the diagonal on some steps and not others).
    _assert_all_close(distributed.run(cp, _parity, causal, style))


@pytest.mark.parametrize("style", ["ring", "allgather"])
def test_multi_query_batch_and_value_dim(distributed, style):
    # One key/value head for 3 query heads (multi-query), B=2, values of width 6 (not D=8), chunks of 1.
    kwargs = dict(batch=2, heads=3, kv_heads=1, value_dim=6, chunk=1)
    _assert_all_close(distributed.run(2, _parity, True, style, **kwargs))


def _parity_on_a_mesh(style):
    # cp is the outer axis, so the cp groups are [0, 2] and [1, 3]: group ranks differ from global
    # ranks, and the two cp groups (one per dp replica) attend over different data at the same time.
    mesh = Mesh({"cp": 2, "dp": 2})
    return _parity(True, style, group=mesh.group("cp"), seed=mesh.coord("dp"), scale=0.3)


@pytest.mark.parametrize("style", ["ring", "allgather"])
def test_cp_subgroups_of_a_mesh_with_a_given_scale(distributed, style):
    _assert_all_close(distributed.run(4, _parity_on_a_mesh, style))


@pytest.mark.parametrize("style", ["ring", "allgather"])
def test_bfloat16_inputs(distributed, style):
    # bf16 q/k/v, and the reference is float32 on the same bf16 values. Blocks are computed in float32
    # and the output and each gradient are rounded once to bf16 (8 significant bits: at most 2^-8 =
    # 3.9e-3 relative), so that rounding is the only error beyond float32 noise (3.6e-3 seen).
    _assert_all_close(distributed.run(2, _parity, True, style, dtype=torch.bfloat16), rtol=4e-3, atol=1e-5)
