"""The collective benchmark's records follow the nccl-tests definitions."""

import pytest
import torch.distributed as dist

from polyshard.bench.collectives import OPS, bus_factor, format_table, parse_size, run_benchmark


def _bench():
    return run_benchmark(OPS, [4096, 1 << 16], warmup=1, iters=2)


def test_records_have_nccl_tests_bandwidths(distributed):
    records = distributed.run(3, _bench)
    assert records[0] == records[1] == records[2]  # the slowest rank's time is shared
    rows = records[0]
    assert [(r["op"], r["bytes"]) for r in rows][:2] == [("all_reduce", 4092), ("all_reduce", 65532)]
    for r in rows:
        assert r["world_size"] == 3 and r["time_s"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * bus_factor(r["op"], 3))
    assert "busbw GB/s" in format_table(rows)


def test_bus_factors_and_sizes():
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_gather", 4) == bus_factor("all_to_all", 4) == 0.75
    assert bus_factor("broadcast", 4) == 1.0
    assert parse_size("4K") == 4096 and parse_size("1M") == 1 << 20 and parse_size("512") == 512
    with pytest.raises(ValueError, match="K/M/G suffix"):
        parse_size("lots")
    assert not dist.is_initialized()
