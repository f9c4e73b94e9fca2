"""Learning-rate schedule and the placement-aware global gradient clip."""

import math

import pytest
import torch
import torch.distributed as dist

from polyshard.mesh import MeshLayout, Replicate, Shard, TensorPlacement, set_placement
from polyshard.trainer.engine.gradient_norm import clip_grad_norm, parameter_gradients
from polyshard.trainer.engine.schedule import lr_at


def test_warmup_then_cosine():
    kw = {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 4, "total_steps": 14}
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, **kw) == 1.0
    assert lr_at(9, **kw) == pytest.approx(0.55)  # halfway: the mean of lr and min_lr
    assert lr_at(14, **kw) == pytest.approx(0.1) and lr_at(50, **kw) == pytest.approx(0.1)


def _reference(step: int, kind: str, shape: str = "linear") -> float:
    """The schedules written out plainly for lr=2, min_lr=0.5, 3 warmup steps, 20 steps, decay over 5."""
    lr, low, warmup, total, decay = 2.0, 0.5, 3, 20, 5
    if step < warmup:
        return lr * (step + 1) / warmup
    p = min(1.0, (step - warmup) / (total - warmup))
    if kind == "constant":
        return lr
    if kind == "linear":
        return lr - (lr - low) * p
    if kind == "cosine":
        return low + (lr - low) * (1 + math.cos(math.pi * p)) / 2
    if step < total - decay:
        return lr
    q = (step - (total - decay) + 1) / decay
    f = {"linear": 1 - q, "cosine": (1 + math.cos(math.pi * q)) / 2, "sqrt": 1 - math.sqrt(q)}[shape]
    return low + (lr - low) * f


@pytest.mark.parametrize(
    "kind, shape",
    [("cosine", "linear"), ("linear", "linear"), ("constant", "linear"), ("wsd", "linear"), ("wsd", "cosine"),
     ("wsd", "sqrt")],
)  # fmt: skip
def test_every_schedule_equals_its_closed_form_at_every_step(kind, shape):
    from polyshard.trainer.config import from_dict
    from polyshard.trainer.engine.schedule import schedule_of

    chosen = {"min_lr": 0.5, "warmup_steps": 3, "name": kind, "decay_fraction": 0.25, "decay_shape": shape}
    config = {"training": {"steps": 20}, "optimizer": {"lr": 2.0}, "lr_schedule": chosen}
    schedule = schedule_of(from_dict(config))
    values = [schedule(step) for step in range(20)]
    # The same arithmetic in another order: equal to the last bits or a few ulps.
    assert values == pytest.approx([_reference(step, kind, shape) for step in range(20)], rel=1e-15, abs=0)
    if kind == "wsd":
        assert values[3:15] == [2.0] * 12 and values[-1] == 0.5  # stable at lr, then down to min_lr exactly


@pytest.mark.parametrize(
    "training, message",
    [
        ({"lr_schedule": "step"}, "lr_schedule.name='step'; choose one of"),
        ({"decay_shape": "exp"}, "lr_schedule.decay_shape='exp'; choose one of"),
        ({"decay_fraction": 0.0}, "decay_fraction=0.0 must be in \\(0, 1\\]"),
        ({"lr_schedule": "wsd", "steps": 10, "warmup_steps": 9, "decay_fraction": 0.2}, "overlaps the decay"),
    ],
)
def test_a_bad_schedule_is_named(training, message):
    from polyshard.trainer.config import from_dict
    from polyshard.trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        from_dict({"training": training})


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
