"""The MoE layer on one process against plain formulas: outputs, aux losses and the capacity rule."""

import math

import pytest
import torch
import torch.nn.functional as F

from polyshard.models.common.moe import capacity_keep_mask, expert_capacity, load_balancing_loss, z_loss
from polyshard.models.common.moe.router import Routing

from .common import TOL, make_layer


def _dense_reference(layer, x):
    """y_t = sum over the top-k experts e of p_te * expert_e(x_t), written out token by token."""
    probs = torch.softmax(x @ layer.router.weight.t(), dim=-1)
    rows = []
    for t in range(x.shape[0]):
        weights, chosen = probs[t].topk(layer.config.top_k)
        if layer.config.renormalize:
            weights = weights / weights.sum()
        row = torch.zeros(x.shape[1])
        for w, e in zip(weights, chosen.tolist()):
            h = x[t] @ layer.experts.w1[e]
            h = F.silu(h) * (x[t] @ layer.experts.w3[e]) if layer.config.activation == "swiglu" else F.gelu(h)
            row = row + w * (h @ layer.experts.w2[e])
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("activation,renormalize", [("swiglu", True), ("gelu", False)])
def test_layer_matches_token_by_token_formula(top_k, activation, renormalize):
    layer = make_layer(top_k=top_k, activation=activation, renormalize=renormalize)
    x = torch.randn(2, 5, 16)
    y, _ = layer(x)
    assert y.shape == x.shape
    torch.testing.assert_close(y.reshape(-1, 16), _dense_reference(layer, x.reshape(-1, 16)), **TOL)
    assert sum(layer.last_metrics.tokens_per_expert) == 10 * top_k


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("activation,renormalize", [("swiglu", True), ("gelu", False)])
def test_layer_gradients_match_token_by_token_formula(top_k, activation, renormalize):
    # Independent of dispatch/combine: autograd through the written-out formula gives the
    # input, router and every expert gradient the layer must produce (aux losses left out of both).
    layer = make_layer(top_k=top_k, activation=activation, renormalize=renormalize)
    x = torch.randn(10, 16, requires_grad=True)
    g = torch.randn(10, 16)
    params = [x, *layer.parameters()]
    y, _ = layer(x)
    got = torch.autograd.grad((y * g).sum(), params)
    want = torch.autograd.grad((_dense_reference(layer, x) * g).sum(), params, allow_unused=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, **TOL)


def _routing(probs, experts, logits=None):
    probs = torch.tensor(probs)
    logits = probs.log() if logits is None else logits
    return Routing(logits, probs, torch.ones(len(experts), 1), torch.tensor(experts))


# pytest.approx's default (relative 1e-6): each value is a handful of float32 products of exact inputs.
def test_load_balancing_loss_is_one_when_uniform_and_e_when_collapsed():
    uniform = _routing([[0.25] * 4] * 4, [[0], [1], [2], [3]])
    assert float(load_balancing_loss(uniform, 4)) == pytest.approx(1.0)
    collapsed = _routing([[1.0, 0.0, 0.0, 0.0]] * 4, [[0]] * 4)
    assert float(load_balancing_loss(collapsed, 4)) == pytest.approx(4.0)


def test_z_loss_is_mean_squared_logsumexp():
    logits = torch.tensor([[0.0, 0.0], [1.0, 3.0]])
    routing = Routing(logits, torch.softmax(logits, -1), torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long))
    expected = (math.log(2) ** 2 + math.log(math.e + math.e**3) ** 2) / 2
    assert float(z_loss(routing)) == pytest.approx(expected)


def test_capacity_serves_first_choices_first_then_token_order():
    # 4 tokens, top-2, 3 experts, capacity 2 per expert.
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    keep = capacity_keep_mask(experts, num_experts=3, capacity=2)
    # First choices: e0 <- t0, t1 (t2 overflows), e1 <- t3. Second choices: e1 <- t0 (now full),
    # e2 <- t1, e1 <- t2 dropped (full), e0 <- t3 dropped (full).
    expected = torch.tensor([[True, True], [True, True], [False, False], [True, False]])
    assert torch.equal(keep, expected)
    assert expert_capacity(num_tokens=4, top_k=2, num_experts=3, capacity_factor=1.0) == 3  # ceil(8/3)


def test_dropped_token_gets_zero_output_and_metrics_count_it():
    layer = make_layer(top_k=1, capacity_factor=0.25)  # capacity ceil(0.25 * 8 / 4) = 1 per expert
    x = torch.randn(8, 16)
    y, _ = layer(x)
    metrics = layer.last_metrics
    kept = sum(min(n, 1) for n in metrics.tokens_per_expert)
    assert metrics.dropped_assignments == metrics.dropped_tokens == 8 - kept
    assert int((y.abs().sum(dim=1) == 0).sum()) == 8 - kept
