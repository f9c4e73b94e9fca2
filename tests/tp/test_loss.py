"""vocab_parallel_cross_entropy against F.cross_entropy on the full logits.

Every rank builds the full (N, V) logits from one seed, pads them to a
multiple of tp with *large* values (so any probability mass leaking onto
padding would change the loss visibly) and keeps its own column range.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from polyshard.collectives import CommLedger
from polyshard.mesh import Mesh
from polyshard.tp import TPError, padded_size, vocab_parallel_cross_entropy
from tests._errors import assert_caught, caught

# float32 softmax/log-sum-exp whose sums are split over ranks: a few ulps of
# difference (~1e-7 relative); a wrong target, mask or normaliser is O(0.1).
TOL = {"rtol": 1e-5, "atol": 1e-6}
N, VOCAB, IGNORE = 14, 10, -100


def _data(ignore_index):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N, VOCAB, generator=g) * 3
    target = torch.randint(0, VOCAB, (N,), generator=g)
    target[[1, 5, 6]] = ignore_index  # ignored positions
    return logits, target


def _my_shard(full_logits, group):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    padded = padded_size(VOCAB, n)
    pad = torch.full((full_logits.shape[0], padded - VOCAB), 50.0)  # would dominate if not masked
    return torch.cat([full_logits, pad], dim=1).chunk(n, dim=1)[r].clone().requires_grad_()


def _check(reduction, ignore_index):
    group = Mesh({"tp": dist.get_world_size()}).group("tp")
    n, r = dist.get_world_size(group), dist.get_rank(group)
    full, target = _data(ignore_index)
    ref_logits = full.clone().requires_grad_()
    want = F.cross_entropy(ref_logits, target, ignore_index=ignore_index, reduction=reduction)
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (want * upstream).sum().backward()

    local = _my_shard(full, group)
    with CommLedger() as ledger:
        got = vocab_parallel_cross_entropy(
            local, target, group, vocab_size=VOCAB, ignore_index=ignore_index, reduction=reduction
        )
    (got * upstream).sum().backward()
    padded_grad = torch.cat([ref_logits.grad, torch.zeros(N, padded_size(VOCAB, n) - VOCAB)], dim=1)
    return {
        "tp": n,
        "got": got.detach(),
        "want": want.detach(),
        "grad": local.grad,
        "want_grad": padded_grad.chunk(n, dim=1)[r].clone(),
        "all_reduce": (ledger.calls("all_reduce"), ledger.total("all_reduce")),
    }


def _assert_matches(results, world):
    assert len(results) == world
    for r in results:
        torch.testing.assert_close(r["got"], r["want"], **TOL)
        # Padding columns get exactly zero gradient (no probability mass).
        torch.testing.assert_close(r["grad"], r["want_grad"], **TOL)
        # Never the full logits: a max and one (sum-exp, target-logit) pair per token, whatever V is.
        if r["tp"] > 1:
            calls, total = r["all_reduce"]
            assert calls == 2
            assert total == 3 * N * 4


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_f_cross_entropy(distributed, world, reduction):
    _assert_matches(distributed.run(world, _check, reduction, IGNORE), world)


def test_custom_ignore_index_that_is_a_real_id(distributed):
    # ignore_index=3 is inside the vocabulary: it must be skipped, not scored.
    _assert_matches(distributed.run(3, _check, "mean", 3), 3)


def _all_ignored():
    group = Mesh({"tp": 2}).group("tp")
    local = _my_shard(torch.randn(N, VOCAB), group)
    loss = vocab_parallel_cross_entropy(local, torch.full((N,), IGNORE), group, vocab_size=VOCAB)
    return loss.item(), F.cross_entropy(torch.randn(N, VOCAB), torch.full((N,), IGNORE)).item()


def test_all_ignored_is_nan_like_torch(distributed):
    results = distributed.run(2, _all_ignored)
    assert len(results) == 2
    for loss, torch_loss in results:
        assert math.isnan(loss) and math.isnan(torch_loss)


def _bad_inputs():
    group = Mesh({"tp": 2}).group("tp")
    local = torch.zeros(N, 5)
    ids = torch.zeros(N, dtype=torch.long)
    return [
        caught(vocab_parallel_cross_entropy, local, ids, group, reduction="avg"),
        caught(vocab_parallel_cross_entropy, local, torch.zeros(N + 1, dtype=torch.long), group),
        caught(vocab_parallel_cross_entropy, local, ids, group, vocab_size=7),
        caught(vocab_parallel_cross_entropy, local, torch.full((N,), 10), group, vocab_size=10),
    ]


def test_bad_inputs_are_typed_errors(distributed):
    results = distributed.run(2, _bad_inputs)
    assert len(results) == 2
    for reduction, shape, vocab_size, ids in results:
        assert_caught(reduction, TPError, "reduction='avg' is not supported; use 'mean', 'sum' or 'none'")
        assert_caught(shape, TPError, "logits must be target's shape plus a trailing vocabulary dim")
        assert_caught(vocab_size, TPError, "vocab_size=7 does not fit logit shards of 5 columns on tp=2")
        assert_caught(ids, TPError, r"ids outside \[0, 10\)")


def _ignored_rows_exactly():
    group = Mesh({"tp": 2}).group("tp")
    full, target = _data(IGNORE)
    local = _my_shard(full, group)
    total = vocab_parallel_cross_entropy(local, target, group, vocab_size=VOCAB, reduction="sum")
    (total / (target != IGNORE).sum()).backward()
    mean = vocab_parallel_cross_entropy(local.detach(), target, group, vocab_size=VOCAB)
    return local.grad, target, total.item(), mean.item()


def test_ignored_tokens_get_exactly_zero_gradient_and_sum_over_count_is_the_mean(distributed):
    # A fine-tuning loss mask: ignored rows must not leak even rounding noise into the gradient, and
    # the sum divided by the counted tokens (the trainer's global token mean) is the "mean" reduction.
    for grad, target, total, mean in distributed.run(2, _ignored_rows_exactly):
        ignored = target == IGNORE
        assert torch.equal(grad[ignored], torch.zeros_like(grad[ignored]))
        assert grad[~ignored].abs().sum() > 0
        assert total / int((~ignored).sum()) == pytest.approx(mean, rel=1e-6)  # float32 division order
