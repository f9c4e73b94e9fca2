"""Bad input raises ContextParallelError naming what would work; local checks need no processes."""

import pytest
import torch
import torch.distributed as dist

from polyshard.cp import (
    ContextParallelAttention,
    ContextParallelError,
    check_sequence_length,
    context_parallel_attention,
    local_positions,
    position_ids,
    shard_sequence,
    unshard_sequence,
)


def test_sequence_not_divisible_names_the_fix():
    with pytest.raises(
        ContextParallelError,
        match=r"seq_len=10 is not divisible by 2\*cp=4.*pad the sequence to 12 tokens, or choose cp in \{1, 5\}",
    ):
        check_sequence_length(10, 2)
    with pytest.raises(ContextParallelError, match=r"seq_len=9 .*pad the sequence to 12 tokens$"):
        check_sequence_length(9, 2)  # odd: no cp works, only padding
    with pytest.raises(ContextParallelError, match="cp=0 must be a positive"):
        check_sequence_length(8, 0)
    with pytest.raises(ContextParallelError, match="2\\*cp=4"):
        local_positions(6, 0, 2)
    check_sequence_length(12, 3)  # divisible: no error


def _qkv(b=1, n=4, nk=2, s=6, d=8, e=8, sk=None, dk=None, bk=None):
    return torch.zeros(b, n, s, d), torch.zeros(bk or b, nk, sk or s, dk or d), torch.zeros(bk or b, nk, sk or s, e)


@pytest.mark.parametrize(
    "tensors,message",
    [
        ((torch.zeros(1, 6, 8),) * 3, r"must be 4-D \(B, heads, S_local, head_dim\).*transpose"),
        (_qkv(bk=2), "share the batch size; got 1, 2 and 2"),
        (_qkv(n=6, nk=4), r"q has 6 heads, k 4 and v 4.*choose key/value heads in \[1, 2, 3, 6\]"),
        (_qkv(sk=4), "same local tokens.*got local sequence lengths 6, 4 and 4"),
        (_qkv(s=5), "local sequence length 5 is odd.*divisible by 2\\*cp"),
        (_qkv(dk=4), "share the head dim; got 8 and 4"),
    ],
)
def test_local_shape_checks(tensors, message):
    with pytest.raises(ContextParallelError, match=message):
        context_parallel_attention(*tensors)  # raises before any communication: no process group needed


def test_mismatched_dtype_and_unknown_style():
    q, k, v = _qkv()
    with pytest.raises(ContextParallelError, match="share dtype and device"):
        context_parallel_attention(q, k.double(), v)
    with pytest.raises(
        ContextParallelError,
        match=r"style='tree' is unknown; choose one of \('ring', 'allgather', 'ulysses', 'ulysses\+ring'\)",
    ):
        context_parallel_attention(q, k, v, style="tree")
    with pytest.raises(ContextParallelError, match="style='tree' is unknown"):
        ContextParallelAttention(style="tree")


def test_module_refuses_masks_and_dropout():
    core = ContextParallelAttention()
    with pytest.raises(ContextParallelError, match="takes no attn_mask.*is_causal=True"):
        core(*_qkv(), attn_mask=torch.ones(6, 6, dtype=torch.bool))
    with pytest.raises(ContextParallelError, match="dropout_p=0.1.*set the attention dropout to 0"):
        core(*_qkv(), dropout_p=0.1)


def _helpers_reject():
    caught = []
    for call in (
        lambda: shard_sequence(torch.zeros(1, 10), 1),
        lambda: position_ids(10),
        lambda: unshard_sequence(torch.zeros(3, 2), 0),
    ):
        try:
            call()
        except ContextParallelError as err:
            caught.append(str(err))
    dist.barrier()  # nobody communicated: the group is still in step
    return caught


def test_helpers_reject_on_ranks(distributed):
    for caught in distributed.run(2, _helpers_reject):
        assert len(caught) == 3
        assert "seq_len=10 is not divisible by 2*cp=4" in caught[0] and "seq_len=10" in caught[1]
        assert "3 tokens along dim 0, an odd number" in caught[2]
