"""The routing rules against plainly written references, token by token: sigmoid weights with a
selection bias, group-limited selection, the sequence-wise balance loss and the bias update."""

import pytest
import torch

from polyshard.models.common.moe import (
    MoEConfig,
    MoEConfigError,
    MoELayer,
    Router,
    limit_to_groups,
    sequence_balance_loss,
)
from polyshard.models.common.moe.router import Routing

from .common import TOL


def _router(num_experts=8, top_k=2, seed=0, **kw):
    torch.manual_seed(seed)
    return Router(16, num_experts, top_k, **kw)


def _reference_choice(scores, bias, top_k, groups, group_topk):
    """One token: the experts DeepSeek-V3 chooses, written out with Python lists and sorts."""
    biased = [s + b for s, b in zip(scores, bias)]
    size = len(scores) // groups
    group_score = [sum(sorted(biased[g * size : (g + 1) * size], reverse=True)[: min(2, size)]) for g in range(groups)]
    best_groups = sorted(range(groups), key=lambda g: -group_score[g])[:group_topk]
    allowed = [e for g in best_groups for e in range(g * size, (g + 1) * size)]
    return sorted(allowed, key=lambda e: -biased[e])[:top_k]


@pytest.mark.parametrize("groups, group_topk, top_k", [(1, 1, 2), (4, 2, 3), (4, 1, 2), (2, 1, 1), (8, 3, 3)])
@pytest.mark.parametrize("renormalize, scale", [(True, 1.0), (True, 2.5), (False, 1.0)])
def test_sigmoid_routing_matches_the_written_out_rule(groups, group_topk, top_k, renormalize, scale):
    router = _router(top_k=top_k, score="sigmoid", groups=groups, group_topk=group_topk,
                     renormalize=renormalize, scale=scale)  # fmt: skip
    router.bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(3)) * 0.3)  # moves choices
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(1))
    routing = router(x)
    scores = torch.sigmoid(x @ router.weight.t()).detach()
    for t in range(x.shape[0]):
        chosen = _reference_choice(scores[t].tolist(), router.bias.tolist(), top_k, groups, group_topk)
        assert sorted(routing.experts[t].tolist()) == sorted(chosen), t
        # the weights are the *unbiased* affinities of the chosen experts, normalised, times the scale
        weights = scores[t, routing.experts[t]]
        weights = (weights / weights.sum() if renormalize else weights) * scale
        torch.testing.assert_close(routing.weights[t], weights, **TOL)
    torch.testing.assert_close(routing.probs, scores / scores.sum(-1, keepdim=True), **TOL)


def test_the_bias_changes_the_choice_not_the_weights():
    router = _router(score="sigmoid")
    x = torch.randn(30, 16, generator=torch.Generator().manual_seed(1))
    before = router(x)
    router.bias[5] = 10.0  # every token now takes expert 5 first
    after = router(x)
    assert (after.experts[:, 0] == 5).all() and not (before.experts[:, 0] == 5).all()
    scores = torch.sigmoid(x @ router.weight.t()).detach()
    chosen = scores.gather(-1, after.experts)
    torch.testing.assert_close(after.weights, chosen / chosen.sum(-1, keepdim=True), **TOL)


def test_softmax_groups_choose_within_the_best_groups():
    router = _router(top_k=2, groups=4, group_topk=2)
    x = torch.randn(25, 16, generator=torch.Generator().manual_seed(2))
    routing = router(x)
    probs = torch.softmax(x @ router.weight.t(), -1).detach()
    for t in range(x.shape[0]):
        chosen = _reference_choice(probs[t].tolist(), [0.0] * 8, 2, 4, 2)
        assert sorted(routing.experts[t].tolist()) == sorted(chosen)
    # renormalised over the chosen experts only, as without groups
    torch.testing.assert_close(routing.weights.sum(-1), torch.ones(25), **TOL)


def test_limit_to_groups_masks_whole_groups():
    choice = torch.tensor([[0.9, 0.1, 0.5, 0.6, 0.0, 0.95, 0.2, 0.2]])  # group sums of top-2: 1.0, 1.1, 0.95, 0.4
    masked = limit_to_groups(choice, groups=4, group_topk=2)
    inf = float("-inf")
    assert torch.equal(masked, torch.tensor([[0.9, 0.1, 0.5, 0.6, inf, inf, inf, inf]]))


def test_sequence_balance_loss_matches_the_per_sequence_formula():
    num_experts, top_k, seq = 4, 2, 5
    probs = torch.softmax(torch.randn(3 * seq, num_experts, generator=torch.Generator().manual_seed(0)), -1)
    experts = torch.stack([torch.randperm(num_experts, generator=torch.Generator().manual_seed(t))[:top_k]
                           for t in range(3 * seq)])  # fmt: skip
    routing = Routing(probs.log(), probs, torch.ones(3 * seq, top_k), experts)
    losses = []
    for b in range(3):
        rows = range(b * seq, (b + 1) * seq)
        total = 0.0
        for e in range(num_experts):
            f = num_experts / (top_k * seq) * sum(int(e in experts[t].tolist()) for t in rows)
            p = sum(float(probs[t, e]) for t in rows) / seq
            total += f * p
        losses.append(total)
    assert float(sequence_balance_loss(routing, num_experts, seq)) == pytest.approx(sum(losses) / 3)
    # 1 for a sequence spread evenly with uniform probabilities
    even = Routing(torch.zeros(4, 4), torch.full((4, 4), 0.25), torch.ones(4, 2), torch.tensor([[0, 1], [2, 3]] * 2))
    assert float(sequence_balance_loss(even, 4, 4)) == pytest.approx(1.0)


def test_sequence_balance_loss_gradient_reaches_the_router():
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(ffn_hidden=8, num_experts=4, top_k=2, aux_loss_coef=0.0,
                               score="sigmoid", seq_aux_loss_coef=0.1), hidden=16)  # fmt: skip
    _, aux = layer(torch.randn(2, 6, 16))
    assert layer.last_metrics.sequence_balance_loss > 0
    assert aux.item() == pytest.approx(0.1 * layer.last_metrics.sequence_balance_loss)
    (grad,) = torch.autograd.grad(aux, [layer.router.weight])
    assert grad.abs().sum() > 0


def test_bias_update_moves_toward_the_mean_load():
    router = _router(num_experts=4, score="sigmoid")
    router.update_bias(torch.tensor([10, 2, 4, 4]), rate=0.01)  # mean 5: over, under, under, under
    assert router.bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    router.update_bias(torch.tensor([5, 5, 5, 5]), rate=0.01)  # balanced: no change
    assert router.bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    with pytest.raises(ValueError, match="score='sigmoid'"):
        _router(num_experts=4).update_bias(torch.tensor([1, 1, 1, 1]), rate=0.01)


def test_only_sigmoid_routers_carry_a_bias_and_it_is_saved():
    assert "bias" not in _router().state_dict()
    state = _router(score="sigmoid").state_dict()
    assert state["bias"].dtype == torch.float32 and state["bias"].shape == (8,)


def test_layer_counts_the_load_of_training_forwards_once():
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(ffn_hidden=8, num_experts=4, top_k=2, capacity_factor=0.5), hidden=16)
    x = torch.randn(2, 6, 16)
    layer(x)
    with torch.no_grad():
        layer(x)  # evaluation: not counted
    load = layer.take_load()
    metrics = layer.last_metrics
    assert load[:4].tolist() == list(metrics.tokens_per_expert) and load[4] == metrics.dropped_tokens
    assert load[5] == 12 and load[:4].sum() == 24
    assert layer.take_load().tolist() == [0] * 6  # reset
    # activation checkpointing's recompute inside backward counts nothing again
    y = torch.utils.checkpoint.checkpoint(lambda t: layer(t)[0], x.requires_grad_(), use_reentrant=False)
    y.sum().backward()
    assert layer.take_load()[:4].sum() == 24


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"score": "tanh"}, "score='tanh'"),
        ({"groups": 3}, "groups=3 must divide num_experts=8"),
        ({"groups": 4, "group_topk": 5}, "group_topk=5"),
        ({"groups": 4, "group_topk": 1, "top_k": 3}, "top_k=3 exceeds the 2 experts"),
        ({"scale": 0.0}, "scale=0.0"),
        ({"seq_aux_loss_coef": -1.0}, "seq_aux_loss_coef=-1.0"),
    ],
)
def test_bad_routing_configs_name_the_field(fields, match):
    with pytest.raises(MoEConfigError, match=match):
        MoEConfig(**{"ffn_hidden": 8, "num_experts": 8, "top_k": 2, **fields})
