"""A made-up machine for planner tests."""

from polyshard.planner.profile import Link, Profile


def flat_profile(**changes):
    """A made-up machine with round numbers: 1 TFLOP/s, 1 GB/s everywhere, 10 us latency."""
    link = Link(10e-6, 1.0)
    ops = {
        op: {"intra": {2: link}, "inter": {2: link}}
        for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
    }
    fields = dict(
        name="flat", source="test", matmul_tflops={1: {64: 1.0}}, elementwise_gbps={1: {64: 1.0}},
        block_overhead_s={1: {64: 0.0}}, memory_gbps={1: 1.0}, optimizer_tensor_s={1: 0.0}, collectives={1: ops},
        devices_per_node=8,
    )  # fmt: skip
    return Profile(**{**fields, **changes})
