"""Shared pieces of the dp tests: a small model, its data, and a single-process reference run.

Every rank builds the model and the whole batch from the same seeds, so each
can run the single-process reference itself and compare with its own shard.
The model has dims (7, 12, 33 rows after padding…) that do not divide 2, 3 or
4, so the ZeRO padding paths are exercised.
"""

import torch
import torch.distributed as dist
from torch import nn

GLOBAL_BATCH = 24  # divides by 2, 3, 4 and, per rank, into 2 micro-batches
STEPS = 5
LR, WEIGHT_DECAY = 1e-2, 0.1


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Sequential(nn.Linear(12, 30), nn.Tanh()),
        nn.Sequential(nn.Linear(30, 30), nn.Tanh()),
        nn.Sequential(nn.Linear(30, 7)),
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 12, generator=g), torch.randn(GLOBAL_BATCH, 7, generator=g)


def local_rows(t: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    per = t.shape[0] // n
    return t[rank * per : (rank + 1) * per]


def adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def reference_run(seed: int = 0, steps: int = STEPS):
    """Single process, full batch: per step the loss and every gradient; at the end the parameters."""
    model = make_model(seed)
    opt = adamw(model.parameters())
    losses, grads = [], []
    for step in range(steps):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def local_step_loss(model, step: int, accum: int, group) -> torch.Tensor:
    """Forward/backward on this rank's rows in ``accum`` micro-batches; returns the global mean loss."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    x, y = (local_rows(t, rank, n) for t in batch(step))
    total = torch.zeros(())
    for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
        loss = nn.functional.mse_loss(model(xm).float(), ym) / accum
        no_sync = getattr(model, "no_sync", None)
        last = i == accum - 1
        if no_sync is not None and not last:
            with no_sync():
                loss.backward()
        else:
            loss.backward()
        total += loss.detach()
    dist.all_reduce(total, group=group)  # test-side bookkeeping only, not part of the product
    return total / n
