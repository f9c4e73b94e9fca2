"""The round-off bounds the parity tests take their tolerances from (tests/_bounds.py) hold, and stay
far enough below a real bug's size to catch it."""

import torch

from tests._bounds import AdamWDrift, U, reordered_sum


def test_two_orders_of_a_float32_sum_stay_within_the_bound():
    g = torch.Generator().manual_seed(0)
    for terms in (2, 7, 100, 4096):
        x = torch.randn(terms, generator=g) * torch.logspace(-3, 3, terms)  # magnitudes over six decades
        forward, backward = torch.zeros(()), torch.zeros(())
        for value in x:
            forward += value
        for value in x.flip(0):
            backward += value
        blocked = x.sum()  # torch's own blocked, vectorised order
        bound = reordered_sum(terms, float(x.abs().sum()))
        for other in (backward, blocked, x.double().sum().float()):
            assert abs(float(forward) - float(other)) <= bound, terms


def test_the_bound_counts_terms_and_unit_round_off():
    assert reordered_sum(1) == 0  # one term: nothing to reorder
    assert reordered_sum(3, 2.0) == 2 * 2 * U * 2.0


def test_adamw_drift_bounds_a_reordered_run_and_not_a_wrong_one():
    torch.manual_seed(0)
    reference, mine, wrong = (torch.nn.Linear(16, 4) for _ in range(3))
    for net in (mine, wrong):
        net.load_state_dict(reference.state_dict())
    optimizers = [torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1) for net in (reference, mine, wrong)]
    drift = AdamWDrift(optimizers[0], grad_rel=reordered_sum(16 + 24))
    for _ in range(3):
        x, y = torch.randn(24, 16), torch.randn(24, 4)
        torch.nn.functional.mse_loss(reference(x), y).backward()
        # the same mean in another order: two halves' means, averaged
        sum(torch.nn.functional.mse_loss(mine(xh), yh) for xh, yh in zip(x.chunk(2), y.chunk(2))).div(2).backward()
        torch.nn.functional.mse_loss(wrong(x[:12]), y[:12]).backward()  # a bug: half the batch
        for optimizer in optimizers:
            optimizer.step()
        drift.after_step()
        for optimizer in optimizers:
            optimizer.zero_grad()
    for p, q, r in zip(reference.parameters(), mine.parameters(), wrong.parameters()):
        assert ((p - q).abs() <= drift.bound[p]).all()
        assert not ((p - r).abs() <= drift.bound[p]).all()
