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
from tests._errors import assert_caught, caught
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
    return {
        "records": {name: get_placement(p) for name, p in model.named_parameters()},
        "tok_shape": tuple(model.tok.weight.shape),
        "head_shape": tuple(model.head.weight.shape),
        "flagged": sorted(n for n, p in model.named_parameters() if is_sequence_parallel(p)),
        "heads": (model.blocks[0].attn.num_heads, model.blocks[0].attn.num_kv_heads),
    }


def test_placement_records(distributed):
    results = distributed.run(4, _records)
    assert len(results) == 4
    for r in results:
        records = r["records"]
        assert records and all(rec is not None and rec.name == name for name, rec in records.items())
        tok, head = records["tok.weight"], records["head.weight"]
        # 50 ids padded to 52 on tp=4: each rank holds 13 rows; the record keeps the real size.
        assert (tok.global_shape, tok.padded_shape, tok.placement("tp")) == ((50, 32), (52, 32), Shard(0))
        assert (head.global_shape, head.padded_shape, head.placement("tp")) == ((50, 32), (52, 32), Shard(0))
        assert r["tok_shape"] == r["head_shape"] == (13, 32)
        assert records["blocks.0.attn.q_proj.weight"].placement("tp") == Shard(0)
        assert records["blocks.0.attn.q_proj.bias"].placement("tp") == Shard(0)
        assert records["blocks.0.mlp.fc_out.weight"].placement("tp") == Shard(1)
        for replicated in ("blocks.0.mlp.fc_out.bias", "blocks.0.norm1.weight", "ln_f.bias", "pos.weight"):
            assert records[replicated].placement("tp") == Replicate(), replicated
        assert r["flagged"] == sorted(
            ["blocks.0.norm1.weight", "blocks.0.norm1.bias", "blocks.0.norm2.weight", "blocks.0.norm2.bias"]
            + ["blocks.0.attn.o_proj.bias", "blocks.0.mlp.fc_out.bias", "ln_f.weight", "ln_f.bias"]
        )
        assert r["heads"] == (1, 1)


def _bad_plans():
    group = Mesh({"tp": 4}).group("tp")
    block = Block(24, 6, 6)
    seen = {}
    seen["no_match"] = caught(parallelize, block, tp_group=group, plan={"mlp.fc3": ColumnParallel()})
    seen["heads"] = caught(parallelize, block, tp_group=group, plan=block_plan("", sequence_parallel=False))
    seen["block_after_checks"] = (type(block.attn.q_proj), block.attn.num_heads)
    seen["kv_heads"] = caught(parallelize, Block(32, 8, 2), tp_group=group, plan={"attn": ShardHeads()})
    seen["layer_norm"] = caught(parallelize, block, tp_group=group, plan={"norm1": ColumnParallel()})
    two_patterns = {"mlp.fc_in": ColumnParallel(), "mlp.fc_*": RowParallel()}
    seen["two_patterns"] = caught(parallelize, block, tp_group=group, plan=two_patterns)
    seen["no_heads"] = caught(parallelize, block, tp_group=group, plan={"mlp": ShardHeads()})
    seen["not_a_style"] = caught(parallelize, block, tp_group=group, plan={"mlp.fc_in": "column"})
    odd_linear = nn.ModuleDict({"norm1": nn.Linear(4, 6)})
    seen["out_features"] = caught(parallelize, odd_linear, tp_group=group, plan={"norm1": ColumnParallel()})
    seen["column_linear"] = caught(ColumnParallelLinear, 8, 10, tp_group=group)
    seen["row_linear"] = caught(RowParallelLinear, 6, 8, tp_group=group)
    seen["fc_in_after_errors"] = type(block.mlp.fc_in)
    entered = parallelize(Block(24, 6, 6), tp_group=group, plan={"attn": TPEntry()})
    seen["keyword_input"] = caught(entered.attn, x=torch.zeros(1, 4, 24))
    tied = GPT(50, 32, 4, 1, max_seq=8)
    tied.head.weight = tied.tok.weight
    seen["tied_partly"] = caught(parallelize, tied, tp_group=group, plan={"tok": VocabParallel()})
    tied_plan = {"tok": VocabParallel(), "head": RowParallel()}
    seen["tied_differently"] = caught(parallelize, tied, tp_group=group, plan=tied_plan)
    # Object identity cannot cross processes: report whether the two are still one parameter.
    seen["tied_after_errors"] = (type(tied.tok), tied.head.weight is tied.tok.weight)
    return seen


def test_bad_plans_are_typed_errors(distributed):
    results = distributed.run(4, _bad_plans)
    assert len(results) == 4
    for seen in results:
        assert_caught(
            seen["no_match"], PlanError, r"'mlp\.fc3' \(ColumnParallel.*matches no module; candidates: attn\.q_proj"
        )
        assert_caught(
            seen["heads"], TPShapeError, r"tp=4 does not divide num_heads=6 of attn; choose tp in \{1, 2, 3, 6\}"
        )
        # Every check runs before anything changes: the block is still plain.
        q_proj_type, num_heads = seen["block_after_checks"]
        assert issubclass(q_proj_type, nn.Linear) and num_heads == 6
        assert_caught(seen["kv_heads"], TPShapeError, r"num_kv_heads=2 of attn; choose tp in \{1, 2\}")
        assert_caught(seen["layer_norm"], PlanError, "ColumnParallel.* cannot apply to 'norm1', a LayerNorm")
        assert_caught(seen["two_patterns"], PlanError, "converted by two patterns: 'mlp.fc_in' and 'mlp.fc_\\*'")
        assert_caught(seen["no_heads"], PlanError, "'mlp' has none of the head-count attributes")
        assert_caught(seen["not_a_style"], PlanError, "not a tp style such as ColumnParallel")
        assert_caught(
            seen["out_features"],
            TPShapeError,
            r"tp=4 does not divide out_features of norm1.*=6; choose tp in \{1, 2, 3, 6\}",
        )
        assert_caught(
            seen["column_linear"], TPShapeError, r"tp=4 does not divide out_features=10; choose tp in \{1, 2, 5, 10\}"
        )
        assert_caught(
            seen["row_linear"], TPShapeError, r"tp=4 does not divide in_features=6; choose tp in \{1, 2, 3, 6\}"
        )
        assert issubclass(seen["fc_in_after_errors"], nn.Linear)
        assert_caught(
            seen["keyword_input"], PlanError, r"TPEntry\(.*\) on 'attn' needs the activation as the first positional"
        )
        # A tied embedding and head must be converted together and alike, or they would silently untie.
        assert_caught(
            seen["tied_partly"],
            PlanError,
            r"\['tok.weight', 'head.weight'\] are one shared parameter.*only some.*\['head",
        )
        assert_caught(seen["tied_differently"], PlanError, "splits it differently in each user")
        tok_type, still_tied = seen["tied_after_errors"]
        assert issubclass(tok_type, nn.Embedding) and still_tied  # untouched


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
            norm_flags = [is_sequence_parallel(p) for m in norms for p in m.parameters()]
        x = torch.randn(B, S // n if sp else S, H, requires_grad=True)
        total = []

        def pack(t, total=total):
            total.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x)
        saved[sp] = sum(total)
    return {"tp": n, "shape": (B, S, H), "saved": saved, "norm_flags": norm_flags}


def test_sequence_parallel_saves_less_activation_memory(distributed):
    results = distributed.run(2, _sequence_parallel_saves_less)
    assert len(results) == 2
    for r in results:
        n, (B, S, H), saved = r["tp"], r["shape"], r["saved"]
        assert n == 2
        assert r["norm_flags"] and all(r["norm_flags"])  # every LayerNorm parameter is marked sequence-parallel
        # At least the two norm inputs shrink from (B, S, H) to (B, S/tp, H) float32.
        assert saved[False] - saved[True] >= 2 * B * S * H * 4 * (n - 1) / n
