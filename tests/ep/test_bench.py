"""The benchmark's case on small sizes: records have the agreed keys and EP matches the one-process loop."""

import argparse

from polyshard.bench.ep import _case


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


def test_one_process_section_compares_equal_outputs():
    # Small sizes (the dims stay multiples of 4 floats, so torch._grouped_mm applies): the grouped
    # experts equal the per-expert loop, and our layer equals the torch-ops MoE built on its tensors.
    from polyshard.bench import ep_experts

    grouped = ep_experts.grouped_vs_loop(experts=4, rows=64, hidden=16, ffn=24, iters=1)
    layer = ep_experts.layer_vs_torch_ops(experts=4, tokens=32, hidden=16, ffn=24, top_k=2, iters=1)
    for record in (grouped, layer):
        assert record["outputs_match"] is True, record["case"]
        assert record["ratio"] == record["ours_s"] / record["peer_s"] > 0


def test_torch_ops_moe_equals_the_layer_with_gradients():
    import torch

    from polyshard.bench.ep_experts import TorchOpsMoE
    from polyshard.models.common.moe import MoEConfig, MoELayer

    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(ffn_hidden=24, num_experts=4, top_k=2), hidden=16)
    x = torch.randn(32, 16)
    y, aux = layer(x)
    grads = torch.autograd.grad(y.sum() + aux, list(layer.parameters()))
    y_peer, aux_peer = TorchOpsMoE(layer)(x)
    grads_peer = torch.autograd.grad(y_peer.sum() + aux_peer, list(layer.parameters()))
    # float32; the peer adds a token's k expert outputs in another order: ulp-level differences
    torch.testing.assert_close(y_peer, y, rtol=1e-5, atol=1e-6)
    assert torch.equal(aux_peer, aux)
    for mine, theirs in zip(grads, grads_peer, strict=True):
        torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-6)
