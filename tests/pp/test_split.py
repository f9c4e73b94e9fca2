"""The zero-bubble split of a backward (polyshard.pp.split): B then W gives exactly a full backward's
gradients, and W does not walk the input path again."""

import torch
from torch import nn

from polyshard.pp.split import backward_input, backward_weight


def _stage(shared=False):
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    if shared:  # one weight used by two layers
        stage[2].weight = stage[0].weight
    return stage


def _full(stage, x, grad):
    x = x.detach().clone().requires_grad_(x.requires_grad)
    torch.autograd.backward(stage(x), grad)
    return x.grad, [p.grad.clone() for p in stage.parameters()]


def _split(stage, x, grad):
    x = x.detach().clone().requires_grad_(x.requires_grad)
    input_grad, work = backward_input(stage(x), grad, x, list(stage.parameters()))
    assert all(p.grad is None for p in stage.parameters())  # B computes no weight gradient
    backward_weight(work)
    return input_grad, [p.grad.clone() for p in stage.parameters()]


def test_b_then_w_equals_a_full_backward():
    g = torch.Generator().manual_seed(1)
    x, grad = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    for shared in (False, True):
        for needs_input_grad in (True, False):  # a middle stage's received input / stage 0's data
            x.requires_grad_(needs_input_grad)
            stage = _stage(shared)
            expected_input, expected = _full(stage, x, grad)
            stage.zero_grad(set_to_none=True)
            got_input, got = _split(stage, x, grad)
            # the same kernels on the same numbers: equal to the bit
            if needs_input_grad:
                assert torch.equal(got_input, expected_input)
            else:
                assert got_input is None
            assert all(torch.equal(a, b) for a, b in zip(got, expected)), (shared, needs_input_grad)


def test_w_runs_only_the_weight_branches():
    stage = _stage()
    x = torch.randn(4, 8, requires_grad=True)
    y = stage(x)
    # the last Tanh's backward: on the input path only
    tanh = next(n for n, _ in y.grad_fn.next_functions if n is not None and "Tanh" in n.name())
    calls = []
    tanh.register_prehook(lambda grads: calls.append(1))
    _, work = backward_input(y, torch.ones_like(y), x, list(stage.parameters()))
    assert calls == [1]  # B ran it
    backward_weight(work)
    assert calls == [1]  # W did not run it again
    assert all(p.grad is not None for p in stage.parameters())


class _Linear(torch.autograd.Function):
    """forward: x @ w.T / backward: both gradients at once, whatever the graph task needs (as a compiled
    block's AOTAutograd node computes its input and weight gradients together)."""

    calls = 0

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.T

    @staticmethod
    def backward(ctx, grad):
        _Linear.calls += 1
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.flatten(0, -2).T @ x.flatten(0, -2)


class _FusedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        return torch.tanh(_Linear.apply(x, self.weight))


def test_w_does_not_run_a_node_again_that_computed_its_weight_gradients_in_b():
    # A compiled block is one autograd node that computes its weight gradients while B runs it for the
    # input gradient; W used to run it a second time from the gradients that arrived there.
    torch.manual_seed(0)
    stage = nn.Sequential(_FusedBlock(), nn.Linear(8, 8), _FusedBlock())
    g = torch.Generator().manual_seed(1)
    x, grad = torch.randn(4, 8, generator=g, requires_grad=True), torch.randn(4, 8, generator=g)
    expected_input, expected = _full(stage, x, grad)
    stage.zero_grad(set_to_none=True)
    _Linear.calls = 0
    got_input, got = _split(stage, x, grad)
    assert _Linear.calls == 2  # once per block, in B; none in W
    assert torch.equal(got_input, expected_input)
    # the same kernels on the same numbers, accumulated once: equal to the bit
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
