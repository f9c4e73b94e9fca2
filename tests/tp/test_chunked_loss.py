"""chunked_linear_cross_entropy against F.cross_entropy(F.linear(...)) on the full logits: the summed
loss and the gradients of the hidden states and of the head's weight (and bias), one process and tp."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from polyshard.collectives import CommLedger
from polyshard.mesh import Mesh
from polyshard.tp import ColumnParallelLinear, TPError, chunked_linear_cross_entropy, head_input, padded_size

# float32 matmuls and softmax sums taken chunk by chunk and, under tp, split over ranks: a few ulps
# (~1e-7 relative) per element; a chunk counted twice or a lost gradient is O(1).
TOL = {"rtol": 1e-5, "atol": 1e-5}
N, HIDDEN, VOCAB, IGNORE = 13, 6, 11, -100  # 13 tokens in chunks of 5, 4, 4; 11 ids padded to 12 on tp=3


def _data():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g)
    bias = torch.randn(VOCAB, generator=g)
    target = torch.randint(0, VOCAB, (N,), generator=g)
    target[[2, 9]] = IGNORE
    return hidden, weight, bias, target


def _reference(with_bias):
    hidden, weight, bias, target = _data()
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    logits = F.linear(leaves[0], leaves[1], leaves[2] if with_bias else None)
    loss = F.cross_entropy(logits, target, ignore_index=IGNORE, reduction="sum")
    (loss * 0.7).backward()  # an upstream gradient other than 1
    return loss.detach(), *(leaf.grad for leaf in leaves)


@pytest.mark.parametrize("chunks", [1, 3, N, N + 4])  # more chunks than tokens: empty chunks count nothing
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_process_matches_the_full_logits(chunks, with_bias):
    want, want_hidden, want_weight, want_bias = _reference(with_bias)
    hidden, weight, bias, target = (t.clone() for t in _data())
    for t in (hidden, weight, bias):
        t.requires_grad_()
    got = chunked_linear_cross_entropy(
        hidden, weight, target, None, chunks=chunks, bias=bias if with_bias else None, ignore_index=IGNORE
    )
    (got * 0.7).backward()
    torch.testing.assert_close(got.detach(), want, **TOL)
    torch.testing.assert_close(hidden.grad, want_hidden, **TOL)
    torch.testing.assert_close(weight.grad, want_weight, **TOL)
    if with_bias:
        torch.testing.assert_close(bias.grad, want_bias, **TOL)


def test_bad_shapes_and_chunks_are_named():
    hidden, weight, _, target = _data()
    with pytest.raises(TPError, match="chunks=0 must be >= 1"):
        chunked_linear_cross_entropy(hidden, weight, target, None, chunks=0)
    with pytest.raises(TPError, match=r"give \(N, H\) hidden states"):
        chunked_linear_cross_entropy(hidden[None], weight, target, None, chunks=2)


def _tensor_parallel(chunks, sequence_parallel):
    """A column-parallel head (vocabulary padded to a multiple of tp) fed through head_input, as the trainer
    does; under sequence parallelism each rank holds its share of the tokens and head_input gathers them."""
    group = Mesh({"tp": dist.get_world_size()}).group("tp")
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    want, want_hidden, want_weight, _ = _reference(False)
    hidden, weight, _, target = _data()
    full = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    full.weight.data.copy_(weight)
    head = ColumnParallelLinear(
        HIDDEN, VOCAB, tp_group=group, bias=False, pad_output=True, sequence_parallel=sequence_parallel, source=full
    )
    # (1, N, H): one row of N tokens; SP splits the sequence over tp (N = 13: uneven needs equal shares, so pad)
    rows = hidden[None].clone()
    if sequence_parallel:
        share = -(-N // tp)
        rows = torch.cat([rows, torch.zeros(1, share * tp - N, HIDDEN)], dim=1)[:, rank * share : (rank + 1) * share]
    rows.requires_grad_()
    with CommLedger() as ledger:
        entered = head_input(head, rows)[:, :N]  # (1, N, H) on every rank
        got = chunked_linear_cross_entropy(
            entered.flatten(0, 1), head.weight, target, group, chunks=chunks, vocab_size=VOCAB, ignore_index=IGNORE
        )
        (got * 0.7).backward()
    rows_per_rank = padded_size(VOCAB, tp) // tp
    padded_grad = torch.cat([want_weight, torch.zeros(padded_size(VOCAB, tp) - VOCAB, HIDDEN)])
    share = rows.shape[1]
    want_rows = torch.cat([want_hidden, torch.zeros(share * tp - N if sequence_parallel else 0, HIDDEN)])
    return {
        "got": got.detach(),
        "want": want,
        "weight_grad": head.weight.grad,
        "want_weight_grad": padded_grad[rank * rows_per_rank : (rank + 1) * rows_per_rank],
        "hidden_grad": rows.grad[0],
        "want_hidden_grad": want_rows[rank * share : (rank + 1) * share] if sequence_parallel else want_rows,
        "all_reduces": ledger.calls("all_reduce"),
    }


@pytest.mark.parametrize(
    "world, chunks, sequence_parallel",
    [
        (2, 3, False),
        (3, 4, False),
        (2, 2, True),
        pytest.param(3, 3, True, marks=pytest.mark.long),
    ],  # 3: 11 ids padded to 12
)
def test_tensor_parallel_matches_the_full_logits(distributed, world, chunks, sequence_parallel):
    for r in distributed.run(world, _tensor_parallel, chunks, sequence_parallel):
        torch.testing.assert_close(r["got"], r["want"], **TOL)
        torch.testing.assert_close(r["weight_grad"], r["want_weight_grad"], **TOL)
        torch.testing.assert_close(r["hidden_grad"], r["want_hidden_grad"], **TOL)
        if not sequence_parallel:
            # per chunk: 2 all-reduces forward, 2 more when backward recomputes it; 1 for the input's gradient
            assert r["all_reduces"] == 4 * chunks + 1
