"""ContextParallelAttention swapped into a small attention layer for SDPA: with tokens sharded by
shard_sequence and rotary positions from position_ids, outputs and every gradient equal the layer
on the full sequence on one process. It also shows what a trainer must add: the loss normalised
by the global token count and parameter gradients summed over the cp group."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from polyshard.collectives import ops
from polyshard.cp import ContextParallelAttention, position_ids, shard_sequence, unshard_sequence

HIDDEN, HEADS, KV_HEADS = 16, 4, 2
HEAD_DIM = HIDDEN // HEADS


def rotate(x, positions, theta=10000.0):
    """Rotary embedding of (B, N, S, D) at the given global positions (S,)."""
    d = x.shape[-1]
    angles = positions[:, None].float() * theta ** (-torch.arange(0, d, 2).float() / d)  # (S, D/2)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1) * sin


class TinyAttention(nn.Module):
    def __init__(self, core):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN)
        self.core = core  # F.scaled_dot_product_attention or a ContextParallelAttention

    def forward(self, x, positions):
        q, k, v = (p(x).unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = rotate(q, positions), rotate(k, positions)
        y = self.core(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).flatten(2))


def _layer_parity(style):
    seq = 2 * dist.get_world_size() * 2  # chunks of 2 tokens
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, seq, HIDDEN, generator=g)
    target = torch.randn(2, seq, HIDDEN, generator=g)

    torch.manual_seed(0)
    reference = TinyAttention(F.scaled_dot_product_attention)
    torch.manual_seed(0)
    sharded = TinyAttention(ContextParallelAttention(style=style))

    x_full = x.clone().requires_grad_()
    y_full = reference(x_full, torch.arange(seq))
    (y_full * target).sum(-1).mean().backward()  # mean over all B x S tokens

    x_local = shard_sequence(x, 1).detach().requires_grad_()
    y_local = sharded(x_local, position_ids(seq))
    # The same global mean: local sum over the global token count (a trainer divides by the tokens
    # of every cp rank); parameter gradients are partial sums over this rank's tokens -> sum over cp.
    ((y_local * shard_sequence(target, 1)).sum(-1).sum() / (2 * seq)).backward()
    ops.all_reduce_coalesced([p.grad for p in sharded.parameters()])
    results = {"out": (unshard_sequence(y_local.detach(), 1), y_full.detach())}
    results["dx"] = (unshard_sequence(x_local.grad, 1), x_full.grad)
    for (name, p), ref in zip(sharded.named_parameters(), reference.parameters()):
        results[name] = (p.grad, ref.grad)
    return results, repr(sharded.core)


@pytest.mark.parametrize("style", ["ring", "allgather"])
def test_swapped_into_an_attention_layer(distributed, style):
    for results, core_repr in distributed.run(2, _layer_parity, style):
        assert core_repr == f"ContextParallelAttention(style='{style}', cp=2)"
        for name, (ours, ref) in results.items():
            # float32; the projections' gradients are summed over two ranks' tokens instead of one
            # pass, and attention merges blocks: a few ulps of O(1) values, as in test_parity.
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
