"""The benchmark's case on small sizes: records have the agreed keys and EP matches the one-process loop."""

import argparse

from polyshard.ep.bench import _case


def _small_case(top_k):
    args = argparse.Namespace(tokens=32, hidden=16, ffn=24, experts=4, iters=2)
    return _case(args, top_k)


def test_bench_records(distributed):
    records = distributed.run(2, _small_case, 2)
    record = records[0]
    assert {"case", "ours_s", "peer_s", "ratio", "outputs_match"} <= set(record)
    assert record["outputs_match"] is True
    assert 0 < record["all_to_all_fraction"] < 1
    # Timings are the slowest rank's (all-reduced), so every rank reports the same record.
    assert records[1]["ours_s"] == record["ours_s"]
