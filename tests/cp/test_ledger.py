"""Communication volumes in the byte ledger: the ring moves cp - 1 K/V blocks per rank forward
(and cp - 1 K/V plus cp dK/dV blocks backward); the all-gather moves (cp - 1)/cp of K and V; Ulysses
all-to-alls Q, K, V and the output, sending (cp - 1)/cp of each, and the same again backward."""

import pytest
import torch
import torch.distributed as dist

from polyshard.collectives import CommLedger
from polyshard.cp import context_parallel_attention


def _volumes(style):
    # bf16 inputs: K/V travel in bf16, dK/dV in float32 (2 bytes vs 4 per element).
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 8, generator=g).bfloat16().requires_grad_()
    k = torch.randn(1, 2, 6, 8, generator=g).bfloat16().requires_grad_()
    v = torch.randn(1, 2, 6, 8, generator=g).bfloat16().requires_grad_()
    with CommLedger() as forward:
        out = context_parallel_attention(q, k, v, causal=True, style=style)
    with CommLedger() as backward:
        out.float().sum().backward()
    kv_elements = k.numel() + v.numel()  # this rank's K and V: 2 x 1 x 2 x 6 x 8 = 192
    views = {}
    for name, ledger in (("forward", forward), ("backward", backward)):
        views[name] = {
            op: (ledger.calls(op), ledger.total(op), ledger.wire(op))
            for op in ("send", "recv", "all_gather", "reduce_scatter", "all_to_all")
        }
        views[name]["all"] = ledger.calls()
    return kv_elements, views, q.numel()


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_volumes(distributed, cp):
    for kv_elements, views, _ in distributed.run(cp, _volumes, "ring"):
        kv_bf16, kv_f32 = 2 * kv_elements, 4 * kv_elements
        fwd, bwd = views["forward"], views["backward"]
        # Forward: one packed K/V transfer per step but the last.
        assert fwd["send"] == (cp - 1, (cp - 1) * kv_bf16, (cp - 1) * kv_bf16)
        assert fwd["recv"][:2] == (cp - 1, (cp - 1) * kv_bf16)
        assert fwd["all"] == 2 * (cp - 1)  # nothing but those sends and receives
        # Backward: the K/V blocks again, and cp float32 dK/dV transfers (the last takes it home).
        assert bwd["send"][:2] == (2 * cp - 1, (cp - 1) * kv_bf16 + cp * kv_f32)
        assert bwd["all"] == 2 * (2 * cp - 1)


@pytest.mark.parametrize("cp", [2, 4])
def test_allgather_volumes(distributed, cp):
    for kv_elements, views, _ in distributed.run(cp, _volumes, "allgather"):
        full_kv_bf16 = cp * 2 * kv_elements  # the gathered K and V of the whole sequence
        fwd, bwd = views["forward"], views["backward"]
        calls, size, wire = fwd["all_gather"]
        assert calls == 2 and size == full_kv_bf16  # one all-gather for K, one for V
        assert wire == pytest.approx((cp - 1) / cp * full_kv_bf16)  # each rank sends (cp-1)/cp of K and V
        assert fwd["all"] == 2 and fwd["send"][0] == 0
        calls, size, wire = bwd["reduce_scatter"]  # float32 gradients of the gathered K and V
        assert calls == 2 and size == 2 * full_kv_bf16 and wire == pytest.approx((cp - 1) / cp * size)
        assert bwd["all"] == 2


def _ring_posts_before_computing():
    # The flight recorder notes every posted transfer (its last 8 calls: enough here); at each block
    # computed, count the sends this rank had posted by then. Step s's transfer (the block for step
    # s+1) must already be posted when step s computes: that is the overlap.
    from polyshard.collectives import flight
    from polyshard.cp import ring

    posted_when_computing = []
    original = ring.block_forward

    def spy(*args, **kwargs):
        posted_when_computing.append(sum(p.op == "send" for p in flight.RECENT))
        return original(*args, **kwargs)

    flight.RECENT.clear()
    ring.block_forward = spy
    try:
        q = torch.randn(1, 2, 4, 8)
        context_parallel_attention(q, q, q, causal=False)
    finally:
        ring.block_forward = original
    dist.barrier()
    return posted_when_computing


def test_ring_posts_the_next_block_before_computing(distributed):
    # cp=4, non-causal: one block per step. Steps 0..2 compute after posting sends 1..3; the last
    # step has nothing left to send.
    for posted in distributed.run(4, _ring_posts_before_computing):
        assert posted == [1, 2, 3, 3]


@pytest.mark.parametrize("cp", [2, 4])
def test_ulysses_volumes(distributed, cp):
    for kv_elements, views, q_elements in distributed.run(cp, _volumes, "ulysses"):
        copies = max(1, cp // 2)  # 2 kv heads: on 4 ranks each is repeated twice before the all-to-all
        moved = 2 * (2 * q_elements + copies * kv_elements)  # bf16 Q, K, V in and the output (as Q) back
        for phase in ("forward", "backward"):  # backward: dO in, dQ, dK, dV back, each in bf16
            calls, size, wire = views[phase]["all_to_all"]
            assert calls == 4 and size == moved, phase
            assert wire == pytest.approx((cp - 1) / cp * moved), phase  # 1/cp of each stays on this rank
            assert views[phase]["all"] == 4, phase
