"""The benchmark on tiny sizes: records carry the agreed keys and both styles match SDPA."""

from polyshard.bench.cp import COLUMNS, compare
from polyshard.bench.timing import format_table


def _tiny():
    return compare((8, 16), heads=4, kv_heads=2, head_dim=8, iters=1)


def test_bench_records(distributed):
    records = distributed.run(2, _tiny)
    assert [r["case"] for r in records[0]] == [
        "causal S=8 cp=2 B=1 N=4/2 D=8",
        "causal S=16 cp=2 B=1 N=4/2 D=8",
    ]
    for record in records[0]:
        assert {"ours_s", "peer_s", "ratio", "allgather_s", "allgather_ratio", "ring_max_diff"} <= set(record)
        assert record["outputs_match"] is True and record["allgather_max_diff"] < 1e-5
    # Timings and differences are the slowest rank's (all-reduced): every rank reports the same.
    assert records[1] == records[0]
    assert "ring/sdpa" in format_table(records[0], COLUMNS)
