"""A small MoE transformer trained 5 steps with ep in {2, 4} ends with the single-process parameters.

The model is plain PyTorch (attention, layer norms, embeddings) with an
:class:`MoELayer` as each block's MLP; only the MoE layers know about ep.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from polyshard.ep import apply_expert_parallel, is_expert_parameter, sync_gradients
from polyshard.models.common.moe import MoEConfig, MoELayer

from .common import ep_mesh, expert_slice

VOCAB, HIDDEN, SEQ, BATCH, STEPS = 32, 16, 8, 2, 5


class Block(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        # No biases: the key bias has an exactly-zero true gradient (softmax ignores a shift), so
        # its computed gradient is rounding noise that Adam would scale up to full lr-sized steps.
        self.attn = nn.MultiheadAttention(HIDDEN, num_heads=2, batch_first=True, bias=False)
        self.moe = MoELayer(config, hidden=HIDDEN)

    def forward(self, x, causal_mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal_mask, need_weights=False)[0]
        y, aux = self.moe(self.ln2(x))
        return x + y, aux


class TinyMoETransformer(nn.Module):
    def __init__(self, config: MoEConfig, depth: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.02)
        self.blocks = nn.ModuleList(Block(config) for _ in range(depth))
        self.ln_f, self.head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        x = self.embed(ids) + self.pos  # (B, S, H)
        mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)
        aux_total = x.new_zeros(())
        for block in self.blocks:
            x, aux = block(x, mask)
            aux_total = aux_total + aux
        return self.head(self.ln_f(x)), aux_total


def _loss(model, ids):
    logits, aux = model(ids[:, :SEQ])  # predict token s+1 from tokens 0..s
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)) + aux


def _token_ids(seed):
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def _train(top_k):
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = ep_mesh()
    torch.manual_seed(0)
    config = MoEConfig(ffn_hidden=24, num_experts=4, top_k=top_k, z_loss_coef=1e-3)
    reference = TinyMoETransformer(config)
    parallel = apply_expert_parallel(copy.deepcopy(reference), group=mesh.group("ep"))
    initial = {name: p.detach().clone() for name, p in reference.named_parameters()}
    batches = [[_token_ids(seed=1000 * step + r) for r in range(world)] for step in range(STEPS)]
    # SGD with momentum: an update proportional to the gradient keeps ulp-level gradient
    # differences at ulp level (Adam's 1/sqrt(v) would blow up noise on near-zero gradients).
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    par_opt = torch.optim.SGD(parallel.parameters(), lr=0.2, momentum=0.9)
    for step in range(STEPS):
        ref_opt.zero_grad()
        torch.stack([_loss(reference, ids) for ids in batches[step]]).mean().backward()  # union of all ranks' batches
        ref_opt.step()
        par_opt.zero_grad()
        _loss(parallel, batches[step][rank]).backward()
        sync_gradients(parallel, mesh.group("ep"))
        par_opt.step()

    reference_params = dict(reference.named_parameters())
    for name, param in parallel.named_parameters():
        expected = reference_params[name]
        if is_expert_parameter(param):
            expected = expert_slice(expected, mesh)
        # Matmuls blocked differently (each expert sees all ranks' rows at once) differ by ulps;
        # 5 steps keep that near 1e-7. A routing flip or a wrong gradient scale would be >= 1e-3.
        torch.testing.assert_close(param, expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # Training moved every parameter well beyond the tolerance, so the comparison is not of initial values.
    return min(float((p - initial[n]).abs().max()) for n, p in reference_params.items())


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_transformer_five_steps(distributed, world, top_k):
    smallest_change = distributed.run(world, _train, top_k, timeout_s=120)
    assert all(change > 1e-3 for change in smallest_change)
