"""parallelize: placement records, typed errors for bad plans and shapes, untouched model on error."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from polyshard.mesh import Mesh, Replicate, Shard, get_placement
from polyshard.tp import (
    ColumnParallel,
    ColumnParallelLinear,
    PlanError,
    RowParallel,
    RowParallelLinear,
    ShardHeads,
    TPEntry,
    TPShapeError,
    VocabParallel,
    heads_per_rank,
    is_sequence_parallel,
    parallelize,
    valid_tp_sizes,
)
from tests.tp.models import GPT, Block, block_plan, gpt_plan


def test_heads_per_rank_lists_valid_tp_sizes():
    assert heads_per_rank(8, 2, 2) == (4, 1)
    assert valid_tp_sizes(6, 2) == [1, 2]
    with pytest.raises(TPShapeError, match=r"tp=4 does not divide num_heads=6 of attn; choose tp in \{1, 2, 3, 6\}"):
        heads_per_rank(6, None, 4, where="attn")
    with pytest.raises(TPShapeError, match=r"tp=4 does not divide num_kv_heads=2; choose tp in \{1, 2\}"):
        heads_per_rank(8, 2, 4)


def _records():
    group = Mesh({"tp": 4}).group("tp")
    torch.manual_seed(0)
    model = parallelize(GPT(50, 32, 4, 1, max_seq=8), tp_group=group, plan=gpt_plan(sequence_parallel=True))
    records = {name: get_placement(p) for name, p in model.named_parameters()}
    assert all(r is not None and r.name == name for name, r in records.items())
    tok, head = records["tok.weight"], records["head.weight"]
    # 50 ids padded to 52 on tp=4: each rank holds 13 rows; the record keeps the real size.
    assert (tok.global_shape, tok.padded_shape, tok.placement("tp")) == ((50, 32), (52, 32), Shard(0))
    assert (head.global_shape, head.padded_shape, head.placement("tp")) == ((50, 32), (52, 32), Shard(0))
    assert model.tok.weight.shape == model.head.weight.shape == (13, 32)
    assert records["blocks.0.attn.q_proj.weight"].placement("tp") == Shard(0)
    assert records["blocks.0.attn.q_proj.bias"].placement("tp") == Shard(0)
    assert records["blocks.0.mlp.fc2.weight"].placement("tp") == Shard(1)
    for replicated in ("blocks.0.mlp.fc2.bias", "blocks.0.ln_1.weight", "ln_f.bias", "pos.weight"):
        assert records[replicated].placement("tp") == Replicate(), replicated
    flagged = sorted(n for n, p in model.named_parameters() if is_sequence_parallel(p))
    assert flagged == sorted(
        ["blocks.0.ln_1.weight", "blocks.0.ln_1.bias", "blocks.0.ln_2.weight", "blocks.0.ln_2.bias"]
        + ["blocks.0.attn.o_proj.bias", "blocks.0.mlp.fc2.bias", "ln_f.weight", "ln_f.bias"]
    )
    assert model.blocks[0].attn.num_heads == model.blocks[0].attn.num_kv_heads == 1
    return True


def test_placement_records(distributed):
    assert distributed.run(4, _records) == [True] * 4


def _bad_plans():
    group = Mesh({"tp": 4}).group("tp")
    block = Block(24, 6, 6)
    with pytest.raises(PlanError, match=r"'mlp\.fc3' \(ColumnParallel.*matches no module; candidates: attn\.q_proj"):
        parallelize(block, tp_group=group, plan={"mlp.fc3": ColumnParallel()})
    with pytest.raises(TPShapeError, match=r"tp=4 does not divide num_heads=6 of attn; choose tp in \{1, 2, 3, 6\}"):
        parallelize(block, tp_group=group, plan=block_plan("", sequence_parallel=False))
    # Every check runs before anything changes: the block is still plain.
    assert isinstance(block.attn.q_proj, nn.Linear) and block.attn.num_heads == 6
    with pytest.raises(TPShapeError, match=r"num_kv_heads=2 of attn; choose tp in \{1, 2\}"):
        parallelize(Block(32, 8, 2), tp_group=group, plan={"attn": ShardHeads()})
    with pytest.raises(PlanError, match="ColumnParallel.* cannot apply to 'ln_1', a LayerNorm"):
        parallelize(block, tp_group=group, plan={"ln_1": ColumnParallel()})
    with pytest.raises(PlanError, match="converted by two patterns: 'mlp.fc1' and 'mlp.fc\\*'"):
        parallelize(block, tp_group=group, plan={"mlp.fc1": ColumnParallel(), "mlp.fc*": RowParallel()})
    with pytest.raises(PlanError, match="'mlp' has none of the head-count attributes"):
        parallelize(block, tp_group=group, plan={"mlp": ShardHeads()})
    with pytest.raises(PlanError, match="not a tp style such as ColumnParallel"):
        parallelize(block, tp_group=group, plan={"mlp.fc1": "column"})
    with pytest.raises(
        TPShapeError, match=r"tp=4 does not divide out_features of ln_1.*=6; choose tp in \{1, 2, 3, 6\}"
    ):
        parallelize(nn.ModuleDict({"ln_1": nn.Linear(4, 6)}), tp_group=group, plan={"ln_1": ColumnParallel()})
    with pytest.raises(TPShapeError, match=r"tp=4 does not divide out_features=10; choose tp in \{1, 2, 5, 10\}"):
        ColumnParallelLinear(8, 10, tp_group=group)
    with pytest.raises(TPShapeError, match=r"tp=4 does not divide in_features=6; choose tp in \{1, 2, 3, 6\}"):
        RowParallelLinear(6, 8, tp_group=group)
    assert isinstance(block.mlp.fc1, nn.Linear)
    entered = parallelize(Block(24, 6, 6), tp_group=group, plan={"attn": TPEntry()})
    with pytest.raises(PlanError, match=r"TPEntry\(.*\) on 'attn' needs the activation as the first positional"):
        entered.attn(x=torch.zeros(1, 4, 24))
    # A tied embedding and head must be converted together and alike, or they would silently untie.
    tied = GPT(50, 32, 4, 1, max_seq=8)
    tied.head.weight = tied.tok.weight
    with pytest.raises(
        PlanError, match=r"\['tok.weight', 'head.weight'\] are one shared parameter.*only some.*\['head"
    ):
        parallelize(tied, tp_group=group, plan={"tok": VocabParallel()})
    with pytest.raises(PlanError, match="splits it differently in each user"):
        parallelize(tied, tp_group=group, plan={"tok": VocabParallel(), "head": RowParallel()})
    assert isinstance(tied.tok, nn.Embedding) and tied.head.weight is tied.tok.weight  # untouched
    return True


def test_bad_plans_are_typed_errors(distributed):
    assert distributed.run(4, _bad_plans) == [True] * 4


def _sequence_parallel_saves_less():
    """SP keeps norm inputs and residuals as (B, S/tp, H): autograd saves less for backward."""
    group = Mesh({"tp": dist.get_world_size()}).group("tp")
    n, (B, S, H) = dist.get_world_size(group), (2, 12, 32)
    saved = {}
    for sp in (False, True):
        torch.manual_seed(0)
        block = parallelize(Block(H, 8, 8), tp_group=group, plan=block_plan("", sp))
        if sp:
            norms = [m for m in block.modules() if isinstance(m, nn.LayerNorm)]
            assert all(is_sequence_parallel(p) for m in norms for p in m.parameters())
        x = torch.randn(B, S // n if sp else S, H, requires_grad=True)
        total = []

        def pack(t, total=total):
            total.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x)
        saved[sp] = sum(total)
    # At least the two norm inputs shrink from (B, S, H) to (B, S/tp, H) float32.
    assert saved[False] - saved[True] >= 2 * B * S * H * 4 * (n - 1) / n
    return True


def test_sequence_parallel_saves_less_activation_memory(distributed):
    assert distributed.run(2, _sequence_parallel_saves_less) == [True, True]
