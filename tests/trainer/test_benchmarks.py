"""The whole-model benchmarks run (their figures are for the README, not asserted here)."""

from polyshard.bench.context_memory import measure, saved_bytes


def test_saved_bytes_counts_each_storage_once():
    import torch

    x = torch.ones(256, requires_grad=True)  # 1 KiB
    assert saved_bytes(lambda: (x * x).sum()) == 1024  # x is saved twice by mul: one storage


def test_context_memory_measures_each_ranks_chunks(distributed):
    one = distributed.run(1, measure, 64, "ring")[0]
    two = distributed.run(2, measure, 64, "ring")
    assert one["tokens_per_rank"] == 64 and [r["tokens_per_rank"] for r in two] == [32, 32]
    assert 0 < two[0]["saved_mib"] < one["saved_mib"]  # a rank saves for its own tokens only
