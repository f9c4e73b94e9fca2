"""Learning-rate schedule and the placement-aware global gradient clip."""

import math

import pytest
import torch
import torch.distributed as dist

from polyshard.mesh import MeshLayout, Replicate, Shard, TensorPlacement, set_placement
from polyshard.trainer.engine.optim import clip_grad_norm, lr_at, parameter_gradients


def test_warmup_then_cosine():
    kw = {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 4, "total_steps": 14}
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, **kw) == 1.0
    assert lr_at(9, **kw) == pytest.approx(0.55)  # halfway: the mean of lr and min_lr
    assert lr_at(14, **kw) == pytest.approx(0.1) and lr_at(50, **kw) == pytest.approx(0.1)


def _full_grads():
    g = torch.Generator().manual_seed(0)
    # Per pipeline stage: a weight sharded over tp on dim 0, a bias replicated everywhere.
    return [(torch.randn(4, 3, generator=g), torch.randn(3, generator=g)) for _ in range(2)]


def _clip(axes, max_norm):
    layout = MeshLayout(axes)
    coords = layout.coords(dist.get_rank())
    stage = coords.get("pp", 0)
    weight_full, bias_full = _full_grads()[stage]
    tp = layout.size("tp")
    weight = torch.nn.Parameter(torch.zeros(4 // tp, 3))
    weight.grad = weight_full.chunk(tp, 0)[coords["tp"]].clone()
    set_placement(weight, TensorPlacement(f"w{stage}", (4, 3), (("dp", Replicate()), ("tp", Shard(0)))))
    bias = torch.nn.Parameter(torch.zeros(3))
    bias.grad = bias_full.clone()  # no record: replicated over dp and tp
    norm = clip_grad_norm(parameter_gradients([weight, bias]), max_norm, layout.as_dict())
    return norm, weight.grad, bias.grad


@pytest.mark.parametrize("axes", [{"dp": 2, "tp": 2}, {"pp": 2, "tp": 2}])
def test_global_norm_counts_every_element_once(distributed, axes):
    stages = _full_grads() if "pp" in axes else _full_grads()[:1]
    expected = math.sqrt(sum(w.double().pow(2).sum() + b.double().pow(2).sum() for w, b in stages))
    results = distributed.run(4, _clip, axes, 0.0)
    for norm, _, _ in results:
        assert norm == pytest.approx(expected, rel=1e-12)  # float64 sums of 30 numbers


def _clip_scales(axes):
    return _clip(axes, 0.5)


def test_clip_scales_to_max_norm(distributed):
    results = distributed.run(4, _clip_scales, {"dp": 2, "tp": 2})
    weight_full, bias_full = _full_grads()[0]
    scale = 0.5 / (math.sqrt(weight_full.pow(2).sum() + bias_full.pow(2).sum()) + 1e-6)
    for rank, (_, weight_grad, bias_grad) in enumerate(results):
        tp = MeshLayout({"dp": 2, "tp": 2}).coords(rank)["tp"]
        torch.testing.assert_close(weight_grad, weight_full.chunk(2, 0)[tp] * scale)  # float32 rounding only
        torch.testing.assert_close(bias_grad, bias_full * scale)
