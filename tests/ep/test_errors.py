"""Bad input: typed errors whose messages say what would work."""

import copy

import pytest
import torch.distributed as dist
from torch import nn

from polyshard.ep import ExpertParallelError, apply_expert_parallel, check_ep_size
from polyshard.mesh import Mesh
from polyshard.models.common.moe import MoEConfig, MoEConfigError

from .common import make_layer

BASE = dict(ffn_hidden=24, num_experts=4)


def test_top_k_above_num_experts():
    with pytest.raises(MoEConfigError, match=r"top_k=5 exceeds num_experts=4.*choose top_k in 1\.\.4"):
        MoEConfig(**BASE, top_k=5)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("capacity_factor", 0.0, r"capacity_factor=0.0 must be > 0 \(e.g. 1.25\), or None for dropless"),
        ("activation", "relu", r"activation='relu' is unknown; choose one of \('swiglu', 'gelu', 'clamped-swiglu'\)"),
        ("top_k", 0, r"model.moe.top_k=0 must be an integer >= 1"),
        ("z_loss_coef", -1.0, r"must be >= 0.*use 0 to turn a loss off"),
    ],
)
def test_config_rejects(field, value, message):
    with pytest.raises(MoEConfigError, match=message):
        MoEConfig(**{**BASE, field: value})


def test_ep_must_divide_num_experts_without_processes():
    with pytest.raises(ExpertParallelError, match=r"ep=4 does not divide num_experts=6.*choose ep in \{1, 2, 3, 6\}"):
        check_ep_size(6, 4)
    check_ep_size(6, 3)  # divides: no error


def _apply_bad():
    group = Mesh({"ep": dist.get_world_size()}).group("ep")
    odd = make_layer(num_experts=3, top_k=1)
    with pytest.raises(ExpertParallelError, match=r"ep=2 does not divide num_experts=3; .*choose ep in \{1, 3\}"):
        apply_expert_parallel(odd, group=group)
    with pytest.raises(ExpertParallelError, match="contains no MoE layer"):
        apply_expert_parallel(nn.Linear(4, 4), group=group)
    twice = apply_expert_parallel(copy.deepcopy(make_layer()), group=group)
    with pytest.raises(ExpertParallelError, match="already expert-parallel; apply_expert_parallel once"):
        apply_expert_parallel(twice, group=group)
    return [p.shape[0] for p in odd.experts.parameters()], odd.ep_group


def test_apply_expert_parallel_rejects(distributed):
    for expert_rows, group in distributed.run(2, _apply_bad):
        # The rejected layer was left whole: every expert weight keeps all 3 experts, no group attached.
        assert expert_rows == [3, 3, 3] and group is None
